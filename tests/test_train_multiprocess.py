"""Real 2-rank training through `freescale launch` (torchrun, gloo on loopback)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from freescale import checkpoint
from freescale.rank_console import rank_pid
from freescale.testing import FAULTS_ENV
from tests.conftest import REPO, cli_env, events, read_log, run_cli
from tests.procs import cmdline, descendants, kill_tree, wait_for

pytestmark = pytest.mark.multiprocess


def launch_args(config: str, data: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        "launch", "--nproc-per-node=2", "--config", str(REPO / "configs" / config),
        f"--data.path={data}", f"--train.output_dir={run_dir}", *overrides,
    ]


def step_losses(log: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(log, "step")}


SHORT = ["--train.steps=40", "--train.log_every=1", "--train.eval=false", "--checkpoint.every=0"]


@pytest.fixture(scope="module")
def demo_hstu(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The demo's sequence model trained as configured (150 steps, 2 ranks, evaluated), each step's loss
    logged: the planted-signal test checks it learned; its first 40 steps are the fault tests' reference
    (nothing in a step depends on the number of steps planned)."""
    run = tmp_path_factory.mktemp("demo_hstu") / "run"
    proc = run_cli(*launch_args("tiny_hstu.toml", tiny_data, run, "--checkpoint.every=0", "--train.log_every=1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run, proc


def test_two_ranks_learn_the_planted_signal(demo_hstu: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """Through ``freescale launch`` (torchrun, 2 ranks); DLRM learns it in ``test_pipeline`` (rank processes
    reused, no launcher)."""
    run, proc = demo_hstu
    log = read_log(run)
    start, steps, (evaluation,), (summary,) = events(log, "start")[0], events(log, "step"), events(log, "eval"), events(log, "summary")
    assert start["world_size"] == 2 and start["backend"] == "gloo"
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05
    assert evaluation["auc"] > 0.7, evaluation
    assert evaluation["ne"] < 0.95
    assert summary["steps"] == 150 and summary["samples"] == 150 * 2 * 128
    assert "eval AUC" in proc.stdout
    assert checkpoint.latest(run / "checkpoints") == run / "checkpoints" / "step_000000150"


@pytest.fixture(scope="module")
def reference_losses(demo_hstu: tuple[Path, Any]) -> dict[int, float]:
    losses = {step: loss for step, loss in step_losses(read_log(demo_hstu[0])).items() if step <= 40}
    assert sorted(losses) == list(range(1, 41))
    return losses


def test_rank_killed_restarts_by_itself_then_the_killed_job_resumes_equal_to_uninterrupted(
    reference_losses: dict[int, float], tiny_data: Path, tmp_path: Path
) -> None:
    """One run, two faults, the same seed as the reference: SIGKILL one rank, and ``--max-restarts 1``
    restarts the group, which resumes by itself from its last checkpoint; then SIGKILL the whole
    job (launcher, torchrun, both ranks) mid-training, damage the newest checkpoint's tensor data, and
    ``--resume`` says so in one line and finishes the run from the one before it.  Every step's
    loss equals the uninterrupted reference's bit for bit: before the first kill (the same seed
    gives the same run), after the restart, and after the resume.  (30 ms more "compute" per
    step, ``FREESCALE_FAULTS`` slow, leaves room for the second kill before the end.)"""
    args = launch_args("tiny_hstu.toml", tiny_data, tmp_path, *SHORT, "--checkpoint.every=10", "--checkpoint.keep=5")
    proc = subprocess.Popen([sys.executable, "-m", "freescale.cli", *args, "--max-restarts=1"], cwd=REPO,
                            env={**cli_env(), FAULTS_ENV: "*:*:0:slow:30"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    def resumed_and_saved_since() -> bool:
        resumes = events(read_log(tmp_path), "resume") if (tmp_path / "train_log.jsonl").exists() else []
        latest = checkpoint.latest(tmp_path / "checkpoints")
        return bool(resumes) and latest is not None and int(latest.name.rsplit("_", 1)[1]) > resumes[0]["step"]

    try:
        assert wait_for(lambda: checkpoint.latest(tmp_path / "checkpoints") is not None, timeout=180)
        ranks = [rank_pid(tmp_path, None, rank) for rank in (0, 1)]
        assert None not in ranks, [cmdline(p) for p in descendants(proc.pid)]
        kill_tree(ranks[1], signal.SIGKILL)  # type: ignore[arg-type]  # checked above  # one rank: the group restarts and resumes by itself
        assert wait_for(resumed_and_saved_since, timeout=180)
    finally:
        kill_tree(proc.pid, signal.SIGKILL)  # the launcher, torchrun and both ranks, mid-training
        proc.wait()
    killed_log = read_log(tmp_path)
    assert not events(killed_log, "summary"), "the run finished before the second kill; the test proved nothing"
    restart_at = killed_log.index(events(killed_log, "resume")[0])
    before, restarted = step_losses(killed_log[:restart_at]), step_losses(killed_log[restart_at:])
    assert len(before) >= 10 and before == {s: reference_losses[s] for s in before}  # same seed, same run
    assert restarted and restarted == {s: reference_losses[s] for s in restarted}
    found = checkpoint.complete_checkpoints(tmp_path / "checkpoints")
    assert len(found) >= 2, found
    damaged = found[-1][1]  # 64 bytes flipped inside its largest tensor file: it must not be loaded
    data_file = max(damaged.glob("*.distcp"), key=lambda f: f.stat().st_size)
    flipped = bytearray(data_file.read_bytes())
    flipped[len(flipped) // 2:len(flipped) // 2 + 64] = bytes(b ^ 0xFF for b in flipped[len(flipped) // 2:][:64])
    data_file.write_bytes(bytes(flipped))
    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    said = [line for line in resumed.stdout.splitlines() if "damaged" in line]
    assert len(said) == 1 and damaged.name in said[0] and data_file.name in said[0], resumed.stdout[-3000:]
    log = read_log(tmp_path)
    resume_at = log.index(events(log, "resume")[-1])
    resume_step = log[resume_at]["step"]
    assert log[resume_at]["path"] == str(found[-2][1]) and resume_step == found[-2][0]
    assert resume_step >= 10 and resume_step % 10 == 0
    after = step_losses(log[resume_at:])
    assert sorted(after) == list(range(resume_step + 1, 41))
    assert after == {s: reference_losses[s] for s in after}  # bit-identical, not close
    assert len(events(log, "summary")) == 1


def test_crash_without_restarts_names_the_rank(tiny_data: Path, tmp_path: Path) -> None:
    args = launch_args("tiny_hstu.toml", tiny_data, tmp_path, *SHORT, "--train.steps=400")
    proc = subprocess.Popen([sys.executable, "-m", "freescale.cli", *args], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (tmp_path / "train_log.jsonl").exists() and
                        '"step"' in (tmp_path / "train_log.jsonl").read_text(), timeout=180)
        rank0 = rank_pid(tmp_path, None, 0)
        assert rank0 is not None, [cmdline(p) for p in descendants(proc.pid)]
        kill_tree(rank0, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].endswith("failed with signal 9; see its output above")


def test_nonfinite_loss_stops_at_that_step_naming_the_ranks(tiny_data: Path, tmp_path: Path) -> None:
    """A learning rate that blows the model up: the run stops at the first step whose reduced gradients
    are not finite, in one line naming the step and the ranks whose loss was not finite, before that
    step's update; the last checkpoint (taken after the previous step) stays the one to resume from.
    No restart is spent on it (every incarnation would stop there again)."""
    run = tmp_path / "run"
    proc = run_cli(*launch_args("tiny_dlrm.toml", tiny_data, run, "--optim.dense_lr=1e25", "--train.steps=30",
                                "--checkpoint.every=1", "--checkpoint.skip_while_busy=false", "--train.eval=false",
                                "--max-restarts=2"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(events(read_log(run), "start")) == 1, "the group was restarted after a non-finite loss"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("freescale: error")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    step = int(lines[0].split("step ", 1)[1].split(":", 1)[0])
    assert "rank 0" in lines[0] and "rank 1" in lines[0], lines[0]
    assert checkpoint.latest(run / "checkpoints") == run / "checkpoints" / f"step_{step:09d}"
