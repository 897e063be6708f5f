"""The `freescale` command as a user meets it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from freescale import checkpoint
from freescale.cli import main
from tests.conftest import REPO, events, read_log, run_cli


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``freescale ARGS`` in this process (errors that come before any rank starts, and ``--help``):
    (exit status, stdout, stderr).  An exception escaping ``main`` fails the test: no traceback."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # --help
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_for_each_command(capsys: pytest.CaptureFixture[str]) -> None:
    top = run_cli("--help")  # one real process: the entry point itself
    assert top.returncode == 0 and all(c in top.stdout for c in ("gen-data", "train", "launch"))
    code, out, _ = run_main(capsys, "train", "--help")
    assert code == 0 and "--train.steps" in out and "--model.hstu.num_blocks" in out
    code, out, _ = run_main(capsys, "launch", "--help")
    assert code == 0 and "--nproc-per-node" in out
    assert "freescale launch [options] [--section.key VALUE ...]" in out  # both forms, the second one a user's loop
    assert "freescale launch [options] -- COMMAND [ARG ...]" in out and "-- python my_loop.py" in out
    code, out, _ = run_main(capsys, "gen-data", "--help")
    assert code == 0 and "--lengths" in out


def test_gen_data_writes_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "gen-data", "--out", str(tmp_path / "d"), "--rows", "1000", "--eval-rows", "100",
                            "--max-len", "16")
    assert code == 0, err
    manifest = json.loads((tmp_path / "d" / "dataset.json").read_text())
    assert manifest["rows"] == {"train": 1000, "eval": 100} and manifest["max_len"] == 16
    code, _, err = run_main(capsys, "gen-data", "--out", str(tmp_path / "e"), "--lengths", "pareto")
    assert code == 2 and err.strip().splitlines() == [
        "freescale: error: gen-data: lengths: must be one of ml-1m, ml-20m, zipf, uniform, got 'pareto'"
    ]


def test_bad_key_is_one_line_for_train_and_launch(tiny_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("launch", "train"):
        code, _, err = run_main(capsys, command, "--config", str(REPO / "configs" / "tiny_hstu.toml"),
                                "--train.stpes", "5")
        assert code == 2
        assert err.strip().splitlines() == [
            "freescale: error: unknown config key 'train.stpes' (did you mean 'train.steps'?)"
        ]


def test_a_sharding_torchrec_cannot_make_is_one_line(tiny_data: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "train", "--config", str(REPO / "configs" / "tiny_hstu.toml"), f"--data.path={tiny_data}",
                            f"--train.output_dir={tmp_path}", "--optim.sharding", "row_wise")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "row_wise for table 'user_table': torchrec does not shard a pooled table (EmbeddingBagCollection)" in err


def test_missing_data_path_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "launch", "--data.path", str(tmp_path / "missing"))
    assert code == 2 and f"data path not found: {tmp_path / 'missing'}" in err and "Traceback" not in err


def test_every_row_skipped_stops_in_one_line_and_nothing_is_saved(
        tiny_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``data.on_bad_rows = skip`` over data whose every label is bad: the first step trains no sample, and the
    run stops there in one line naming the data and the reason with its count; no checkpoint is written."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "bad"
    shutil.copytree(tiny_data, data)
    for file in data.glob("train*.parquet"):
        table = pq.read_table(file)
        index = table.schema.get_field_index("label")
        pq.write_table(table.set_column(index, "label", pa.array([2.0] * table.num_rows, table.schema.field(index).type)),
                       file, row_group_size=4_096)
    code, _, err = run_main(capsys, "train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={data}",
                            f"--train.output_dir={tmp_path / 'run'}", "--train.steps=3", "--data.on_bad_rows=skip")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{data}: up to step 1 the model trained on no sample" in err and "label: is 2.0" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


def test_a_table_resumes_between_sharded_and_data_parallel(
        tiny_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The item table trained table-wise, resumed ``data_parallel`` (its fused row-wise state becomes the
    replicated optimizer's accumulator), then table-wise again: the losses stay those of the run that never
    changed, to the rounding of two Adagrad implementations (measured at 2 ranks: <= 2.6e-7 either way; a
    wrong accumulator, e.g. a quarter of it, gave 1e-5 there)."""
    import shutil

    common = ["train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}",
              "--train.eval=false", "--train.log_every=1", "--checkpoint.every=2", "--checkpoint.keep=10",
              "--checkpoint.async_save=false"]
    assert run_main(capsys, *common, f"--train.output_dir={tmp_path / 'ref'}", "--train.steps=8")[0] == 0
    run = tmp_path / "changed"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "ref" / "checkpoints" / "step_000000004", run / "checkpoints" / "step_000000004")
    code, out, err = run_main(capsys, *common, f"--train.output_dir={run}", "--train.steps=6", "--resume",
                              "--optim.sharding", "item_table=data_parallel")
    assert code == 0 and "resumed from" in out, err
    code, out, err = run_main(capsys, *common, f"--train.output_dir={run}", "--train.steps=8", "--resume")
    assert code == 0 and "step_000000006 at step 6" in out, err

    def losses(where: Path) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in read_log(where) if e["event"] == "step"}

    ref, changed = losses(tmp_path / "ref"), losses(run)
    assert sorted(changed) == [5, 6, 7, 8]
    assert all(abs(changed[s] - ref[s]) < 2e-6 for s in changed), (changed, ref)


def test_single_process_train_without_torchrun_resumes_under_another_shape_and_inspects(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``freescale train`` in this process: 5 steps, saved; resumed to 8 under another sharding plan and
    another global batch: the state converts (a note where it is approximate), and the resumed steps train
    samples the first 5 did not.  Then ``freescale checkpoint inspect`` on it, and each of its one-line
    errors (a partial, truncated or unreadable checkpoint; another model's)."""
    import shutil

    monkeypatch.setenv("FREESCALE_AUDIT", "1")  # each commit record holds the rows it trained
    train = ["train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}",
             f"--train.output_dir={tmp_path}", "--train.eval=false"]
    code, out, err = run_main(capsys, *train, "--train.steps=5", "--train.log_every=5", "--log.tensorboard=true",
                              "--eval.every=5")
    assert code == 0, err[-3000:]
    assert "freescale: dlrm on 1 rank(s)" in out
    # The run log's numbers as TensorBoard scalars too, at their steps (the JSONL log is unchanged).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    tags = set(board.Tags()["scalars"])
    assert {"step/loss", "step/auc", "step/imbalance", "commit/seconds", "commit/batch_wait_s", "validate/auc"} <= tags, tags
    assert [e.step for e in board.Scalars("validate/auc")] == [5]
    assert [e.step for e in board.Scalars("commit/seconds")] == list(range(5))
    assert [e.step for e in board.Scalars("step/loss")] == [5]
    summary = [e for e in read_log(tmp_path) if e["event"] == "summary"][0]
    assert summary["world_size"] == 1 and summary["steps"] == 5
    code, _, err = run_main(capsys, "train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"),
                            f"--data.path={tiny_data}", "--log.tensorboard=maybe", "--train.steps=1",
                            f"--train.output_dir={tmp_path / 'refused'}")
    assert code == 2 and "log.tensorboard" in err and len(err.strip().splitlines()) == 1, err
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    code, _, err = run_main(capsys, *train, "--train.steps=1", "--log.tensorboard=true")
    assert code == 2 and err.strip().splitlines() == [
        "freescale: error: log.tensorboard: needs the tensorboard package (pip install 'freescale[tensorboard]')"], err
    monkeypatch.undo()
    monkeypatch.setenv("FREESCALE_AUDIT", "1")
    # A new run started afresh where this one's checkpoints lie would lose its own saves to them (the newest
    # steps are kept) and leave a later resume to pick theirs: refused in one line, nothing touched.
    saved = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    code, _, err = run_main(capsys, *train, "--train.steps=3")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds the checkpoints of an earlier run (newest: step_000000005)" in err and "--resume" in err, err
    assert checkpoint.complete_checkpoints(tmp_path / "checkpoints") == saved
    code, out, err = run_main(capsys, *train, "--train.steps=8", "--train.log_every=4", "--resume",
                              "--optim.sharding=column_wise", "--optim.column_shard_min_dim=8",  # tables cut in two
                              "--data.batch_size=96")  # and another global batch (it was 128)
    assert code == 0, err[-3000:]
    assert "resumed from" in out and "3 (from step 5)" in out
    # The table-wise checkpoint's row-wise Adagrad state split into column shards: said, not hidden.
    assert "table 'item_table': columns cut at [0, 8, 16]" in out, out
    commits = [e for e in read_log(tmp_path) if e["event"] == "commit"]
    assert [e["step"] for e in commits] == list(range(8)) and [len(e["rows"]) for e in commits] == [128] * 5 + [96] * 3
    rows = [r for e in commits for r in e["rows"]]
    assert len(rows) == len(set(rows))  # none twice across the change of shape
    code, out, err = run_main(capsys, *train, "--train.steps=8", "--resume", "--optim.sharding=column_wise",
                              "--optim.column_shard_min_dim=8", "--data.batch_size=96")  # resumed where it ended
    assert code == 0 and "0 (from step 8)" in out and "nan" not in out, out + err[-2000:]

    root = tmp_path / "checkpoints"
    code, out, _ = run_main(capsys, "checkpoint", "inspect", str(root))
    assert code == 0 and "step 8, written by 1 replica group(s) of 1 rank(s); model dlrm" in out, out
    assert "item_table" in out and "column_wise" in out and "user_table" in out
    code, out, _ = run_main(capsys, "checkpoint", "inspect", str(tmp_path))  # the run's output_dir: its checkpoints
    assert code == 0 and "step 8, written by 1 replica group(s)" in out, out
    code, out, _ = run_main(capsys, "checkpoint", "inspect", str(root / "step_000000008"), "--json")
    found = json.loads(out)
    assert {t["table"]: t["row-wise ranges"] for t in found["tables"]} == {"item_table": 2, "user_table": 2}
    assert found["step"] == 8 and found["bytes"]["model"] > 0 and found["global_batch_size"] == 96
    # the loader's position: 3 steps into what was left of the epoch when the shape changed
    assert found["position"]["step"] == 3 and found["position"]["resumed_from_another_shape"]
    code, _, err = run_main(capsys, "train", "--config", str(REPO / "configs" / "tiny_hstu.toml"),
                            f"--data.path={tiny_data}", f"--train.output_dir={tmp_path}", "--resume")
    assert code == 2 and "written by a dlrm model; this run trains hstu" in err, err
    hstu = ["train", "--config", str(REPO / "configs" / "tiny_hstu.toml"), f"--data.path={tiny_data}",
            f"--train.output_dir={tmp_path / 'hstu'}", "--train.steps=2", "--train.eval=false"]
    assert run_main(capsys, *hstu, "--model.hstu.history_cross=false")[0] == 0
    code, _, err = run_main(capsys, *hstu, "--train.steps=3", "--resume")  # the head is wider with the product
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "(the model's config differs from the checkpoint's: model.hstu.history_cross: False -> True)" in err, err
    flipped = tmp_path / "flipped"  # one byte of tensor data changed, the size kept: only --verify sees it
    shutil.copytree(root / "step_000000008", flipped)
    target = max(flipped.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    assert run_main(capsys, "checkpoint", "inspect", str(flipped))[0] == 0
    code, out, _ = run_main(capsys, "checkpoint", "inspect", str(root / "step_000000008"), "--verify")
    assert code == 0 and "verified: every byte" in out, out
    code, _, err = run_main(capsys, "checkpoint", "inspect", str(flipped), "--verify")
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{target}: bytes " in err and "checksum" in err, err
    broken = tmp_path / "broken"
    shutil.copytree(root / "step_000000008", broken)
    victim = next(f for f in broken.iterdir() if f.suffix == ".distcp")
    written = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:10])
    legacy = tmp_path / "legacy"  # the same, as written before checksums: DCP's .metadata names the short file
    shutil.copytree(broken, legacy)
    (legacy / "checksums.json").unlink()
    meta = json.loads((legacy / "freescale.json").read_text())
    (legacy / "freescale.json").write_text(json.dumps({k: v for k, v in meta.items() if k not in ("integrity", "meta_hash")}))
    (tmp_path / "step_000000009.partial").mkdir()
    for path, line in ((broken, f"{victim}: 10 bytes, {written} were written (truncated)"),  # without --verify too
                       (legacy, f"{legacy}: corrupt or partial: {victim.name} holds 10 bytes"),
                       (tmp_path / "step_000000009.partial", "a save in progress, or one killed mid-way"),
                       (tmp_path / "nothing", "no such checkpoint or directory")):
        code, _, err = run_main(capsys, "checkpoint", "inspect", str(path))
        assert code == 2 and len(err.strip().splitlines()) == 1 and line in err, err
    (legacy / ".metadata").write_bytes(b"not a pickle")
    code, _, err = run_main(capsys, "checkpoint", "inspect", str(legacy))
    assert code == 2 and "unreadable checkpoint metadata" in err and len(err.strip().splitlines()) == 1, err


def test_hstu_resumed_under_another_plan_steps_as_if_never_stopped(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The sequence model, in this process: 6 steps with its tables cut in two by columns, against 4 steps
    so, saved, and 2 more resumed table-wise.  The state converts exactly (merging column ranges: row-wise
    Adagrad's value of a union is the width-weighted mean, no note), so the resumed run's first step has
    the uninterrupted run's loss, and both train the same rows.  The steps after it differ: the plan is
    part of the optimizer (row-wise Adagrad keeps one adaptive rate per column shard: a whole row now
    takes one).  The first run's step-4 checkpoint copied its tables to host memory during step 5 (each
    row step 5 looked up kept first); the second's was copied at the step: the same state, bit for bit."""
    monkeypatch.setenv("FREESCALE_AUDIT", "1")
    train = ["train", "--config", str(REPO / "configs" / "tiny_hstu.toml"), f"--data.path={tiny_data}",
             "--train.eval=false", "--data.batch_size=32", "--optim.column_shard_min_dim=16", "--checkpoint.every=4",
             "--model.hstu.dropout=0.1"]  # the resumed step draws the masks the uninterrupted one did
    split = ["--optim.sharding=column_wise"]
    runs = {"through": tmp_path / "through", "stopped": tmp_path / "stopped"}
    for name, steps, extra in (("through", 6, [*split, "--checkpoint.stage_budget=0.5"]),
                               ("stopped", 4, [*split, "--checkpoint.stage_budget=0"]),
                               ("stopped", 6, ["--optim.sharding=table_wise", "--resume"])):
        code, out, err = run_main(capsys, *train, f"--train.output_dir={runs[name]}", f"--train.steps={steps}", *extra)
        assert code == 0, err[-3000:]
    assert "resumed from" in out and "columns cut" not in out  # merging: nothing approximated
    commits = {name: {e["step"]: e for e in read_log(path) if e["event"] == "commit"} for name, path in runs.items()}
    assert sorted(commits["stopped"]) == list(range(6))
    for step in range(6):
        through, stopped = commits["through"][step], commits["stopped"][step]
        assert through["rows"] == stopped["rows"], f"step {step}: other samples"
        if step <= 4:
            assert stopped["loss"] == pytest.approx(through["loss"], rel=1e-6), f"step {step}"
    resumed = [e for e in read_log(runs["stopped"]) if e["event"] == "resume"]
    assert resumed[0]["step"] == 4 and resumed[0]["conversions"] == []
    copied = [e for e in read_log(runs["through"]) if e["event"] == "checkpoint_tables_copied"]
    assert [e["step"] for e in copied] == [4] and copied[0]["table_bytes"] > 0 and copied[0]["rows_kept"] > 0, copied
    ahead, at_step = (checkpoint_tensors(path / "checkpoints" / "step_000000004") for path in runs.values())
    assert sorted(ahead) == sorted(at_step) and any("rowwise" in key for key in ahead)
    for key, tensor in at_step.items():
        assert torch.equal(ahead[key], tensor), key


def test_a_save_due_while_the_previous_one_is_written_is_skipped_and_each_holds_its_step_exactly(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Slow storage (the ``write`` hook: every save's write waits 0.1 s on the writer's thread) and a save every
    2 steps, in this process: a save that comes due while the one before it is written is skipped (none
    waits for it), the next multiple of 2 asks again; the last checkpoint holds the state after its own step: a
    run resumed from it trains the following steps exactly as the uninterrupted run did."""
    monkeypatch.setenv("FREESCALE_AUDIT", "1")
    train = ["train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}",
             "--train.eval=false", "--data.batch_size=64", "--checkpoint.keep=20", "--checkpoint.save_final=false"]
    through = tmp_path / "through"
    monkeypatch.setenv("FREESCALE_FAULTS", "*:*:0:write:100")
    code, _, err = run_main(capsys, *train, f"--train.output_dir={through}", "--train.steps=300",
                            "--checkpoint.every=2")
    assert code == 0, err[-3000:]
    log = read_log(through)
    staged, skipped = events(log, "checkpoint_staged"), events(log, "checkpoint_skipped")
    saved = [e["step"] for e in events(log, "checkpoint")]
    assert len(staged) >= 2 and skipped, (staged, skipped)
    assert saved == [e["step"] for e in staged], "every save taken was written and committed, in order"
    assert sorted(saved + [e["step"] for e in skipped]) == list(range(2, 301, 2)), "each due save taken or skipped"
    for before, later in zip(staged, staged[1:]):  # the next save taken after the one before it was written
        written = next(e for e in log if e["event"] == "checkpoint" and e["step"] == before["step"])
        assert written["time"] <= later["time"], (before, later)
    monkeypatch.delenv("FREESCALE_FAULTS")
    first = {e["step"]: e for e in events(log, "commit")}
    last, resumed = max(s for s in saved if s <= 298), tmp_path / "resumed"  # (300: no step left to compare)
    for later in (s for s in saved if s > last):  # --resume takes the newest: the compared one is kept newest
        shutil.rmtree(through / "checkpoints" / f"step_{later:09d}")
    end = min(last + 3, 300)  # (the last save may be at step 298: the uninterrupted run has steps up to 299)
    code, _, err = run_main(capsys, *train, f"--train.output_dir={resumed}", f"--train.steps={end}",
                            f"--checkpoint.dir={through / 'checkpoints'}", "--resume", "--checkpoint.every=0")
    assert code == 0, err[-3000:]
    again = {e["step"]: e for e in events(read_log(resumed), "commit")}
    assert sorted(again) == list(range(last, end)) and len(again) >= 2
    for step in again:
        assert again[step]["rows"] == first[step]["rows"] and again[step]["digest"] == first[step]["digest"], step


def test_next_item_retrieval_on_a_prepared_log_trains_and_ranks_held_out_items(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``freescale gen-log`` -> ``prepare`` (leave-last-out) -> ``train --model.task=retrieval`` with the time
    bias, a warm-up (then constant: a decay spans train.steps, which the stopped run changes) and clipping,
    in this process: the sampled softmax falls, and the
    evaluation ranks each user's held-out last item among all items (HR@K, NDCG@K, MRR in the log, the
    summary and the table).  Stopped at step 20 and resumed, the last 10 steps' losses are the
    uninterrupted run's (the negatives the loader draws, the schedule and the model state all resume).
    DLRM is refused."""
    monkeypatch.setenv("FREESCALE_AUDIT", "1")  # commit records carry their loss
    log, data, run = tmp_path / "ratings.csv", tmp_path / "ml", tmp_path / "run"
    assert run_main(capsys, "gen-log", "--out", str(log), "--users", "400", "--items", "300", "--seed", "1")[0] == 0
    assert run_main(capsys, "prepare", str(log), "--out", str(data), "--user", "userId", "--item", "movieId",
                    "--time", "timestamp", "--label", "rating", "--rating-threshold", "4")[0] == 0
    train = ["train", "--config", str(REPO / "configs" / "tiny_hstu.toml"), f"--data.path={data}",
             "--data.max_seq_len=32", "--data.batch_size=64", "--train.log_every=10", "--model.task=retrieval",
             "--model.hstu.relative_bias=position_time", "--model.retrieval.uniform_negatives=32",
             "--model.retrieval.positions=last", "--optim.lr_schedule=constant", "--optim.warmup_steps=5",
             "--optim.clip_grad_norm=1.0", "--checkpoint.every=20"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two intra-op threads sum some gradients in either order: last bits differ by run
    from freescale.dataloader.schema import DatasetManifest

    reads: list[str] = []
    read_from = DatasetManifest.read_from.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(DatasetManifest, "read_from", classmethod(lambda cls, *a: reads.append(a[-1]) or read_from(cls, *a)))
    try:
        code, out, err = run_main(capsys, *train, f"--train.output_dir={run}", "--train.steps=30")
        assert code == 0, err[-3000:]
        assert reads == [str(data)]  # the dataset opened once: item counts, the train and the eval loaders share it
        monkeypatch.setattr(DatasetManifest, "read_from", classmethod(read_from))
        stopped = tmp_path / "stopped"
        for extra in (["--train.steps=20", "--train.eval=false"], ["--train.steps=30", "--train.eval=false", "--resume"]):
            assert run_main(capsys, *train, f"--train.output_dir={stopped}", *extra)[0] == 0
    finally:
        torch.set_num_threads(threads)
    through, resumed = ({e["step"]: e["loss"] for e in read_log(path) if e["event"] == "commit"} for path in (run, stopped))
    assert [resumed[s] for s in range(20, 30)] == [through[s] for s in range(20, 30)]
    log_events = read_log(run)
    losses = [e["loss"] for e in log_events if e["event"] == "step"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    (evaluation,) = [e for e in log_events if e["event"] == "eval"]
    assert evaluation["samples"] > 0 and set(evaluation) >= {"hr@1", "hr@10", "hr@50", "ndcg@10", "ndcg@50", "mrr"}
    assert 0 <= evaluation["hr@1"] <= evaluation["hr@10"] <= evaluation["hr@50"] <= 1 and evaluation["mrr"] > 0
    (summary,) = [e for e in log_events if e["event"] == "summary"]
    assert summary["task"] == "retrieval" and summary["eval_metrics"]["hr@10"] == evaluation["hr@10"]
    assert "eval HR@10" in out and "train AUC" not in out
    from freescale.report import write_report

    assert f"HR@10 {evaluation['hr@10']:.4f}" in write_report(run).read_text()  # the run report's headline
    code, _, err = run_main(capsys, "train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={data}",
                            "--model.task=retrieval", f"--train.output_dir={tmp_path / 'dlrm'}")
    assert code == 2 and err.strip().splitlines() == [
        "freescale: error: model.task: 'retrieval' needs kind = 'hstu' or 'sasrec' (dlrm scores a candidate: "
        "ranking only)"], err
    # SASRec, the field's neural reference, trained by the same engine, validated on the split prepare wrote.
    code, out, err = run_main(capsys, "train", "--config", str(REPO / "configs" / "tiny_hstu.toml"),
                              f"--data.path={data}", "--data.max_seq_len=32", "--data.batch_size=64",
                              "--model.kind=sasrec", "--model.task=retrieval", "--model.retrieval.positions=last",
                              "--model.sasrec.embedding_dim=32", "--train.steps=30", "--train.log_every=10",
                              "--eval.every=15", f"--train.output_dir={tmp_path / 'sasrec'}")
    assert code == 0, err[-3000:]
    sasrec = read_log(tmp_path / "sasrec")
    losses = [e["loss"] for e in sasrec if e["event"] == "step"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert [e["step"] for e in sasrec if e["event"] == "validate"] == [15, 30]
    (evaluation,) = [e for e in sasrec if e["event"] == "eval"]
    assert evaluation["best_step"] in (15, 30) and 0 < evaluation["mrr"] and "best ndcg@10 (valid)" in out


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, by flattened key (read without a process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.with_suffix(".pt"))
    found: dict[str, torch.Tensor] = {}

    def walk(obj: object, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            found[key] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
    walk(torch.load(path.with_suffix(".pt"), weights_only=False), "")
    return found


def test_unknown_flag_is_named_wherever_it_sits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Parsed as an override, an unknown flag took the next flag as its value, and the error named 'DIR'.
    data = str(tmp_path / "d")
    for args in (["--bogus-flag", "--data.path", data], ["--data.path", data, "--bogus-flag"], ["--nproc-per-node", "1", "--bogus-flag=3", "--data.path", data]):
        code, _, err = run_main(capsys, "launch", *args)
        assert code == 2, err
        assert err.strip().splitlines() == ["freescale: error: unknown option '--bogus-flag'"], args
    code, _, err = run_main(capsys, "launch", "--nprocs-per-node", "2", "--data.path", data)
    assert code == 2
    assert err.strip().splitlines() == [
        "freescale: error: unknown option '--nprocs-per-node' (did you mean '--nproc-per-node'?)"
    ]


def test_bad_launcher_option_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for args, line in (
        (["--nproc-per-node", "two"], "--nproc-per-node/--ranks-per-replica: expected an integer, got 'two'"),
        (["--replicas", "1.5", "--data.path", "x"], "--replicas: expected an integer, got '1.5'"),
        (["--data.path", "x", "--max-restarts"], "--max-restarts: expected one argument"),
        (["--max-restarts", "-1", "--data.path", "x"], "--max-restarts: expected a whole number >= 0, got '-1'"),
    ):
        code, _, err = run_main(capsys, "launch", *args)
        assert code == 2, err
        assert err.strip().splitlines() == [f"freescale: error: {line}"], args


def test_a_launch_where_an_earlier_runs_checkpoints_lie_is_refused_before_any_rank_starts(
        tiny_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The launcher's own check (the ranks' is in the single-process test above): one line, before the lighthouse,
    the groups or the job summary of the earlier run."""
    earlier = tmp_path / "checkpoints" / "step_000000300"
    earlier.mkdir(parents=True)
    (earlier / "freescale.json").write_text("{}")
    for extra in ([], ["--replicas", "2"]):
        code, out, err = run_main(capsys, "launch", "--config", str(REPO / "configs" / "tiny_dlrm.toml"),
                                  f"--data.path={tiny_data}", f"--train.output_dir={tmp_path}", *extra)
        assert code == 2 and not out and err.strip().splitlines() == [
            f"freescale: error: {tmp_path / 'checkpoints'} holds the checkpoints of an earlier run (newest: "
            "step_000000300); this run would lose its own saves to them: resume that run (--resume), give this one a "
            "train.output_dir of its own (or checkpoint.dir), or remove them"], err
    assert earlier.is_dir()


def test_a_malformed_fault_spec_is_one_line_before_any_rank_starts(
        tiny_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``FREESCALE_FAULTS`` (the README's fault recipes set it) is read by the launcher first: a malformed item is
    one line naming it, for freescale's loop and a user's own, where every rank used to print a traceback."""
    from freescale.testing import parse_faults

    assert parse_faults("1:0:200:forward, *:*:0:slow:20,1:1:8:reduce:0@2,0:1:20:compute:2") == [
        (1, 0, 200, "forward", 0.0, 0), (None, None, 0, "slow", 0.02, None), (1, 1, 8, "reduce", 0.0, 2),
        (0, 1, 20, "compute", 2.0, None)]
    for spec, line in (("1:0:forward", "'1:0:forward' is not <group>:<rank>:<step>:<point>"),
                       ("1:x:5:forward", "'1:x:5:forward' is not"), ("1:0:5:crash", "'1:0:5:crash' is not"),
                       ("1:0:5:forward@one", "'1:0:5:forward@one' is not"),
                       ("0:1:20:compute:0.5", "'0:1:20:compute:0.5': a compute fault's factor must be >= 1")):
        monkeypatch.setenv("FREESCALE_FAULTS", spec)
        for command in (["--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}"],
                        ["--", "python", "examples/deepfm_ft.py"]):
            code, _, err = run_main(capsys, "launch", *command)
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert err.startswith(f"freescale: error: FREESCALE_FAULTS: {line}"), err


def test_a_standby_where_it_could_not_take_over_is_refused_in_one_line(
        tiny_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = ["--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}"]
    for args, line in ((["--replicas", "2", "--nproc-per-node", "2"], "for one-rank replica groups (--nproc-per-node 1)"),
                       (["--nproc-per-node", "1"], "needs --replicas 2 or more")):
        code, _, err = run_main(capsys, "launch", "--standby", *args, *config)
        assert code == 2 and len(err.strip().splitlines()) == 1 and line in err, err
