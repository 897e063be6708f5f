"""Train pipelines: same results as the plain loop, bit for bit; collectives in priority order."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from freescale.pipeline import PipelineConfig, check_comm
from tests.conftest import REPO, events, read_log
from tests.trainings import run_trainings

PIPELINES = ["plain", "torchrec", "prioritized"]
SLOWED_FROM = 10
TRACED_CHUNK_KB = 8


def losses_and_digest(out: Path) -> tuple[dict[int, float], str]:
    log = read_log(out)
    (summary,) = events(log, "summary")
    return {e["step"]: e["loss"] for e in events(log, "step")}, summary["state_digest"]


@pytest.fixture(scope="module")
def pipeline_runs(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Every (model, pipeline) for 12 steps on 2 ranks, in one pair of rank processes
    (``tests.trainings``).  The pipelined runs checkpoint every 5 steps, so they also drain and
    refill their read-ahead twice.  The sequence model runs with its relative attention bias (position
    and time): the batches' timestamps travel through every pipeline."""
    tmp = tmp_path_factory.mktemp("pipelines")
    runs, items = {}, []
    for model in ("hstu", "dlrm"):
        for kind, comm in [(k, c) for k in PIPELINES for c in ("nccl", "copy_engine") if model == "hstu" or c == "nccl"]:
            out = tmp / f"{model}-{kind}-{comm}"
            runs[(model, kind if comm == "nccl" else f"{kind}-sm-free")] = out
            items.append((str(REPO / "configs" / f"tiny_{model}.toml"), [
                f"--data.path={tiny_data}", f"--train.output_dir={out}", "--train.steps=12", "--train.log_every=1",
                "--train.eval=false", "--train.progress=false", f"--pipeline.kind={kind}", f"--pipeline.comm={comm}",
                "--checkpoint.every=0" if kind == "plain" else "--checkpoint.every=5",
                *(["--model.hstu.relative_bias=position_time"] if model == "hstu" else [])]))
    for kind in ("plain", "prioritized"):  # next-item retrieval, its item table cut by columns, evaluated
        out = runs[("retrieval", kind)] = tmp / f"retrieval-{kind}"
        items.append((str(REPO / "configs" / "tiny_hstu.toml"), [
            f"--data.path={tiny_data}", f"--train.output_dir={out}", "--train.steps=12", "--train.log_every=1",
            "--train.progress=false", f"--pipeline.kind={kind}", "--checkpoint.every=0", "--model.task=retrieval",
            "--model.hstu.relative_bias=position_time", "--model.retrieval.uniform_negatives=32",
            "--optim.sharding=column_wise", "--optim.column_shard_min_dim=16"]))
    out = runs[("dlrm", "signal")] = tmp / "dlrm-signal"  # the shipped DLRM config, as configured, evaluated
    items.append((str(REPO / "configs" / "tiny_dlrm.toml"), [
        f"--data.path={tiny_data}", f"--train.output_dir={out}", "--train.progress=false", "--checkpoint.every=0"]))
    out = runs[("hstu", "traced")] = tmp / "hstu-prioritized-traced"  # for the priority-order test
    items.append((str(REPO / "configs" / "tiny_hstu.toml"), [
        f"--data.path={tiny_data}", f"--train.output_dir={out}", "--train.steps=12", "--train.eval=false",
        "--train.progress=false", "--pipeline.kind=prioritized", "--checkpoint.every=0", "--train.trace_comm=true",
        f"--pipeline.chunk_kb={TRACED_CHUNK_KB}"]))
    for policy in ("report", "rebalance"):  # rank 1 three times slower from step 10 (``freescale.rank_speed``)
        out = runs[("slow", policy)] = tmp / f"dlrm-slow-{policy}"
        items.append((str(REPO / "configs" / "tiny_dlrm.toml"), [
            f"--data.path={tiny_data}", f"--train.output_dir={out}", "--train.steps=50", "--train.log_every=10",
            "--train.eval=false", "--train.progress=false", "--checkpoint.every=0", f"--balance.slow_policy={policy}",
            f"--train.trace_comm={str(policy == 'report').lower()}"],
            {"FREESCALE_FAULTS": f"0:1:{SLOWED_FROM}:compute:3", "FREESCALE_AUDIT": "1"}))
    run_trainings(items, 2, tmp)
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_pipelines_match_the_plain_loop_bit_for_bit(model: str, pipeline_runs: dict[tuple[str, str], Path]) -> None:
    """Losses of every step and the final state (parameters, both optimizers) are identical, with the embedding
    all-to-alls on gloo and (the sequence model; the DLRM at 3 ranks below) on the SM-free backend's shared-memory
    transport (``pipeline.comm = "copy_engine"``)."""
    kinds = [*PIPELINES, *(f"{kind}-sm-free" for kind in PIPELINES if model == "hstu")]
    results = {kind: losses_and_digest(pipeline_runs[(model, kind)]) for kind in kinds}
    plain_losses, plain_digest = results["plain"]
    assert sorted(plain_losses) == list(range(1, 13))
    assert len(plain_digest) == 64
    for kind in kinds[1:]:
        (start,) = events(read_log(pipeline_runs[(model, kind)]), "start")
        assert start["embedding_comm"] == ("freescale_sm_free" if kind.endswith("sm-free") else "gloo"), kind
        losses, digest = results[kind]
        assert losses == plain_losses, kind
        assert digest == plain_digest, kind


@pytest.fixture(scope="module")
def three_rank_runs(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The DLRM for 8 steps on 3 ranks (every all-to-all split three ways, unevenly; its pooled embeddings, where
    the sequence model's runs at 2 ranks above send sequences): each pipeline with
    its embedding all-to-alls on the SM-free backend, and on gloo the plain loop and the prioritized pipeline."""
    tmp = tmp_path_factory.mktemp("pipelines3")
    runs, items = {}, []
    for kind, comm in [("plain", "nccl"), ("prioritized", "nccl"), *((k, "copy_engine") for k in PIPELINES)]:
        out = runs[f"{kind}-{comm}"] = tmp / f"{kind}-{comm}"
        items.append((str(REPO / "configs" / "tiny_dlrm.toml"), [
            f"--data.path={tiny_data}", f"--train.output_dir={out}", "--train.steps=8", "--train.log_every=1",
            "--train.eval=false", "--train.progress=false", f"--pipeline.kind={kind}", f"--pipeline.comm={comm}",
            "--checkpoint.every=0" if kind == "plain" else "--checkpoint.every=5"]))
    run_trainings(items, 3, tmp)
    return runs


@pytest.mark.multiprocess
def test_pipelines_on_the_sm_free_backend_match_the_plain_loop_on_three_ranks(three_rank_runs: dict[str, Path]) -> None:
    """At 3 ranks too, every pipeline over the SM-free backend's shared-memory rings trains exactly as over gloo:
    the plain loop and torchrec's pipeline (DDP reduces their dense gradients) the plain loop's losses and final
    state, bit for bit; the prioritized pipeline its own run on gloo's (its chunked all-reduce sums three ranks'
    gradients in another order than DDP's buckets: the same losses to the printed digits, a different last bit)."""
    plain_losses, plain_digest = losses_and_digest(three_rank_runs["plain-nccl"])
    assert sorted(plain_losses) == list(range(1, 9))
    for kind, reference in [("plain", "plain-nccl"), ("torchrec", "plain-nccl"), ("prioritized", "prioritized-nccl")]:
        out = three_rank_runs[f"{kind}-copy_engine"]
        (start,) = events(read_log(out), "start")
        assert start["embedding_comm"] == "freescale_sm_free" and start["world_size"] == 3, kind
        assert losses_and_digest(out) == losses_and_digest(three_rank_runs[reference]), kind
    prioritized_losses, _ = losses_and_digest(three_rank_runs["prioritized-nccl"])
    assert all(math.isclose(prioritized_losses[s], plain_losses[s], rel_tol=1e-5) for s in plain_losses)


@pytest.mark.multiprocess
def test_dlrm_learns_the_planted_signal_on_two_ranks(pipeline_runs: dict[tuple[str, str], Path]) -> None:
    """The shipped DLRM config as configured (2 ranks): the loss falls and the held-out AUC passes 0.7."""
    log = read_log(pipeline_runs[("dlrm", "signal")])
    start, steps, (evaluation,), (summary,) = events(log, "start")[0], events(log, "step"), events(log, "eval"), events(log, "summary")
    assert start["world_size"] == 2 and start["backend"] == "gloo"
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05
    assert evaluation["auc"] > 0.7 and evaluation["ne"] < 0.95, evaluation
    assert summary["steps"] == 150 and summary["samples"] == 150 * 2 * 128


@pytest.mark.multiprocess
def test_retrieval_trains_and_ranks_alike_through_the_pipelines(pipeline_runs: dict[tuple[str, str], Path]) -> None:
    """Next-item retrieval on 2 ranks, its item table column-wise sharded: the prioritized pipeline (torchrec's
    batches in flight, the model traced) gives the plain loop's losses and final state, and the evaluation
    over the sharded table (partial scores summed across ranks) the same HR, NDCG and MRR."""
    results = {}
    for kind in ("plain", "prioritized"):
        log = read_log(pipeline_runs[("retrieval", kind)])
        (evaluation,) = events(log, "eval")
        results[kind] = (losses_and_digest(pipeline_runs[("retrieval", kind)]), evaluation)
    (plain_losses, plain_digest), plain_eval = results["plain"]
    # (gen-data's histories are random: nothing to learn about the next item; the prepared log's test learns)
    assert sorted(plain_losses) == list(range(1, 13)) and all(math.isfinite(v) for v in plain_losses.values())
    assert results["prioritized"][0] == (plain_losses, plain_digest)
    assert plain_eval == {**results["prioritized"][1], "time": plain_eval["time"]}
    assert plain_eval["samples"] > 0 and 0 < plain_eval["hr@50"] <= 1


def test_config_errors_name_the_key() -> None:
    with pytest.raises(Exception, match="kind"):
        PipelineConfig(kind="fast").validate()
    with pytest.raises(Exception, match="comm"):
        PipelineConfig(comm="rdma").validate()
    sm_free = PipelineConfig(kind="prioritized", comm="copy_engine")
    with pytest.raises(NotImplementedError, match="copy_engine' on CUDA across nodes"):
        check_comm(sm_free, torch.device("cuda", 0), world_size=16, local_world_size=8)
    check_comm(sm_free, torch.device("cuda", 0), world_size=8, local_world_size=8)  # one node: CUDA IPC
    check_comm(sm_free, torch.device("cpu"), world_size=16, local_world_size=8)  # (CPU: the backend says so itself)


@pytest.mark.multiprocess
def test_prioritized_pipeline_issues_transfers_in_priority_order(pipeline_runs: dict[tuple[str, str], Path]) -> None:
    """From the recorded collectives of each step, on each rank:

    forward: the item sequence's output all-to-all (the attention stack's input)
    is issued before the user side feature's; backward: dense gradients travel
    on their own group, in chunks no larger than configured, issued while
    backward still runs (before its last embedding-gradient all-to-all).
    """
    chunk_kb, tmp_path = TRACED_CHUNK_KB, pipeline_runs[("hstu", "traced")]
    for rank in (0, 1):
        trace = [json.loads(line) for line in (tmp_path / f"comm_trace_rank{rank}.jsonl").read_text().splitlines()]
        for step in range(1, 12):
            events_of_step = [e for e in trace if e["step"] == step]
            forward = [e["source"] for e in events_of_step if e["phase"] == "forward" and e["source"]]
            assert forward == ["item_embeddings", "user_embeddings"], (rank, step, forward)
            backward = [e for e in events_of_step if e["phase"] == "backward"]
            dense = [i for i, e in enumerate(backward) if e["op"] == "all_reduce"]
            embedding = [i for i, e in enumerate(backward) if e["op"] == "all_to_all_single"]
            assert dense and embedding, (rank, step)
            assert all(backward[i]["group"] == "dense" for i in dense)
            assert all(backward[i]["group"] == "world" for i in embedding)
            assert all(backward[i]["bytes"] <= chunk_kb * 1024 for i in dense)
            assert dense[0] < embedding[-1], "dense reduction waited for the end of backward"


@pytest.mark.multiprocess
def test_a_rank_made_three_times_slower_is_found_and_planned_at_its_speed(
        pipeline_runs: dict[tuple[str, str], Path]) -> None:
    """Rank 1's compute takes three times as long from step 10 (its own CPU time, in proportion to its work).
    Both runs flag it fail-slow once, within 20 steps, naming rank, host and its share of the median speed,
    and never flag rank 0 (no false flag before the slowdown either); ``report`` keeps planning halves, while
    ``rebalance`` plans rank 1 a smaller share from the next step on (a trial: kept if the steps got no slower,
    else undone; which one depends on this machine's timing and is not asserted).  Both train the same rows at
    every step, and the same losses."""
    for policy in ("report", "rebalance"):
        log = read_log(pipeline_runs[("slow", policy)])
        flagged = events(log, "fail_slow")
        assert [e["rank"] for e in flagged] == [1], flagged
        (event,) = flagged
        assert SLOWED_FROM < event["step"] <= SLOWED_FROM + 20 and 0.2 < event["share"] < 0.75, event
        assert event["host"] and event["policy"] == policy
        # The latest scores measured (right after a replan the new plan has too few steps measured yet: NaN).
        scored = [e for e in events(log, "step") if all(math.isfinite(v) for v in e.get("speed_relative", [math.nan]))]
        # (Below the fail-slow threshold, 0.7: a 3x slowdown reads 0.33-0.53 of the other rank on a loaded machine.)
        assert scored[-1]["speed_relative"][0] == 1.0 and scored[-1]["speed_relative"][1] < 0.7, scored[-1]
        commits = {e["step"]: e for e in events(log, "commit")}
        trial = [commits[s]["rank_sizes"] for s in range(event["step"] + 1, event["step"] + 5)]
        share = sum(sizes[1] for sizes in trial) / sum(sum(sizes) for sizes in trial)
        if policy == "report":
            assert abs(share - 0.5) < 0.1, share
        else:
            assert share < 0.45, share  # planned at its measured share of the median speed (< 0.75) from here
        assert all(sum(commits[s]["rank_sizes"]) == 256 for s in commits)  # the global batch is whole
    # Planning by speed changes who trains what, never what is trained: each step trains the same rows as when the
    # slow rank sets the pace, and the job's loss is the same to float32 summation order (the ranks' shares differ).
    logs = {policy: read_log(pipeline_runs[("slow", policy)]) for policy in ("report", "rebalance")}
    rows = {policy: {e["step"]: sorted(e["rows"]) for e in events(log, "commit")} for policy, log in logs.items()}
    assert rows["report"] == rows["rebalance"]
    losses = {policy: [e["loss"] for e in events(log, "step")] for policy, log in logs.items()}
    assert losses["rebalance"] == pytest.approx(losses["report"], rel=1e-5)
    # The C4 view of the report run's collective traces: the others waited for rank 1, and the run report says so.
    from freescale.comm_report import read_traces, waited_for
    from freescale.report.page import wait_rows

    view = waited_for(read_traces(pipeline_runs[("slow", "report")]))
    assert view.slowest() == 1 and view.waited_s[1] > 2 * view.waited_s.get(0, 0.0) and not view.unmatched, view
    assert wait_rows(pipeline_runs[("slow", "report")])[0][0] == 1
