"""Train pipelines: same results as the plain loop, bit for bit; collectives in priority order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freescale.pipeline import PipelineConfig, build_pipeline
from tests.conftest import REPO, events, read_log, run_cli

PIPELINES = ["plain", "torchrec", "prioritized"]


def run_pipeline(kind: str, model: str, data: Path, out: Path, *extra: str) -> tuple[dict[int, float], str]:
    proc = run_cli(
        "launch", "--nproc-per-node=2", "--config", str(REPO / "configs" / f"tiny_{model}.toml"),
        f"--data.path={data}", f"--train.output_dir={out}", "--train.steps=12", "--train.log_every=1",
        "--train.eval=false", f"--pipeline.kind={kind}", *extra,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    log = read_log(out)
    (summary,) = events(log, "summary")
    return {e["step"]: e["loss"] for e in events(log, "step")}, summary["state_digest"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["hstu", "dlrm"])
def test_pipelines_match_the_plain_loop_bit_for_bit(model: str, tiny_data: Path, tmp_path: Path) -> None:
    """Losses of every step and the final state (parameters, both optimizers) are identical.

    The pipelined runs checkpoint every 5 steps, so they also drain and refill
    their read-ahead twice.
    """
    results = {}
    for kind in PIPELINES:
        extra = ["--checkpoint.every=0"] if kind == "plain" else ["--checkpoint.every=5"]
        results[kind] = run_pipeline(kind, model, tiny_data, tmp_path / kind, *extra)
    plain_losses, plain_digest = results["plain"]
    assert sorted(plain_losses) == list(range(1, 13))
    assert len(plain_digest) == 64
    for kind in ("torchrec", "prioritized"):
        losses, digest = results[kind]
        assert losses == plain_losses, kind
        assert digest == plain_digest, kind


def test_config_errors_name_the_key() -> None:
    with pytest.raises(Exception, match="kind"):
        PipelineConfig(kind="fast").validate()
    with pytest.raises(Exception, match="comm"):
        PipelineConfig(comm="rdma").validate()
    with pytest.raises(RuntimeError, match="copy_engine.*needs a GPU"):
        build_pipeline(PipelineConfig(kind="prioritized", comm="copy_engine"), torch.nn.Linear(1, 1),
                       torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), torch.device("cpu"))


@pytest.mark.multiprocess
def test_prioritized_pipeline_issues_transfers_in_priority_order(tiny_data: Path, tmp_path: Path) -> None:
    """From the recorded collectives of each step, on each rank:

    forward: the item sequence's output all-to-all (the attention stack's input)
    is issued before the user side feature's; backward: dense gradients travel
    on their own group, in chunks no larger than configured, issued while
    backward still runs (before its last embedding-gradient all-to-all).
    """
    chunk_kb = 8
    run_pipeline("prioritized", "hstu", tiny_data, tmp_path, "--checkpoint.every=0", "--train.trace_comm=true",
                 f"--pipeline.chunk_kb={chunk_kb}")
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
