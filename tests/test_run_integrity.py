"""One writer per run directory: the launcher's death ends every process it started, a second job on a live
run directory is refused, a job that lost its directory writes nothing more, a stop leaves no partial save.

Real launches and real signals (SIGKILL of the launcher's process group, of the launcher alone, SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from freescale import checkpoint, run_lease
from freescale.lifetime import alive
from freescale.rank_console import rank_pid
from freescale.testing import FAULTS_ENV
from tests.conftest import REPO, cli_env
from tests.procs import descendants, wait_for

SLOW = {FAULTS_ENV: "*:*:0:slow:40"}  # 40 ms more a step: time to act between checkpoints


def _launch(tiny_data: Path, run: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    args = ["launch", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}",
            f"--train.output_dir={run}", "--train.steps=100000", "--train.eval=false", "--train.progress=false",
            "--checkpoint.every=3", "--checkpoint.keep=50", *extra]
    return subprocess.Popen([sys.executable, "-m", "freescale.cli", *args], cwd=REPO, env={**cli_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _saved(run: Path) -> int:
    return len(checkpoint.complete_checkpoints(run / "checkpoints"))


def _names(run: Path) -> set[str]:
    return {p.name for p in (run / "checkpoints").iterdir()} if (run / "checkpoints").is_dir() else set()


def _commits_after_takeover(group_dir: Path) -> int:
    """Steps the group committed as incarnation 1 or later (its log's records after such a ``start``)."""
    records = [json.loads(line) for line in (group_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    later = [i for i, r in enumerate(records) if r["event"] == "start" and r.get("incarnation", 0) >= 1]
    return sum(r["event"] == "commit" for r in records[later[0]:]) if later else 0


def _all_gone(pids: list[int], within_s: float) -> list[int]:
    wait_for(lambda: not any(alive(p) for p in pids), timeout=within_s)
    return [p for p in pids if alive(p)]


def test_lease_refuses_a_second_holder_and_the_fence_sees_a_takeover(tmp_path: Path) -> None:
    dirs = run_lease.lease_directories(tmp_path / "run", tmp_path / "ckpt")
    assert dirs == [(tmp_path / "run").resolve(), (tmp_path / "ckpt").resolve()]
    assert run_lease.lease_directories(tmp_path / "run", tmp_path / "run" / "checkpoints") == [dirs[0]]
    with run_lease.acquire(dirs) as held:
        with pytest.raises(run_lease.RunDirectoryBusy, match=f"pid {os.getpid()}"):
            run_lease.acquire(dirs[1:])  # a second open file: flock refuses it, in this process too
        run_lease.fence(dirs, held.token)
    with run_lease.acquire(dirs[1:]):  # released with the first; another job takes the checkpoint directory
        with pytest.raises(run_lease.RunDirectoryBusy, match="took this directory over"):
            run_lease.fence(dirs, held.token)
    (tmp_path / "a_file").write_text("")  # a file where the run's directory should be: one line, nothing written
    for where, why in ((tmp_path / "a_file", "a file, not a directory"), (tmp_path / "a_file" / "run", "Not a directory")):
        with pytest.raises(checkpoint.CheckpointError, match=f"^{where}: this run cannot write there \\({why}\\)"):
            run_lease.acquire([dirs[0], where])
    with run_lease.acquire(dirs[:1]):  # the lease taken on the first directory was let go
        pass


@pytest.mark.multiprocess
def test_a_stop_leaves_no_partial_and_a_killed_launcher_no_writer(
        tiny_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 2-rank job; a second launch and a ``freescale train`` on its directory are refused in one line naming
    it; SIGTERM: one line, status 143, every process gone, no ``.partial`` left.  Then the job resumed as two
    replica groups with warm standbys (what a killed save left is removed at its start); SIGKILL of group 1's
    rank: its standby takes over and commits; then SIGKILL of the launcher alone, not its process group: the
    lighthouse in it, the group agents, the clients, the ranks and the standbys are all gone within 2 s (each
    dies with its parent), and nothing is written after."""
    from tests.test_cli import run_main

    run = tmp_path / "run"
    job = _launch(tiny_data, run, "--nproc-per-node=2", env=SLOW)
    try:
        assert wait_for(lambda: _saved(run) >= 2, timeout=180), job.stderr.read() if job.poll() is not None else ""
        for command in ("launch", "train"):  # in this process: refused before any rank starts
            code, _, err = run_main(capsys, command, "--config", str(REPO / "configs" / "tiny_dlrm.toml"),
                                    f"--data.path={tiny_data}", f"--train.output_dir={run}", "--train.steps=5")
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1, err
            assert f"{run.resolve()}: in use by a run that is still writing to it (pid {job.pid}" in lines[0], lines[0]
        tree = descendants(job.pid)
        assert len(tree) >= 3, tree  # the fork server, the rank clients, the ranks
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("freescale:") and " is skipped: " not in line]
    assert said == ["freescale: stopped by SIGTERM; every rank has ended"] and "Traceback" not in err, err[-3000:]
    assert not _all_gone(tree, within_s=2.0)
    assert not [n for n in _names(run) if not (n.startswith("step_") and n[5:].isdigit()) and n != "commits"]

    (run / "checkpoints" / "step_000000999.partial").mkdir()  # as a kill mid-save leaves one
    resumed = _launch(tiny_data, run, "--nproc-per-node=1", "--replicas=2", "--resume", "--standby",
                      "--max-restarts=1", env=SLOW)
    try:
        newest = checkpoint.complete_checkpoints(run / "checkpoints")[-1][0]
        assert wait_for(lambda: checkpoint.complete_checkpoints(run / "checkpoints")[-1][0] > newest, timeout=180)
        assert "step_000000999.partial" not in _names(run)
        # Group 1's rank SIGKILLed: its warm standby (imported, model built, waiting on the group's lock) goes on as
        # incarnation 1 and commits; the group's agent starts the next standby.
        active = rank_pid(run, "replica1", 0)
        assert active is not None
        os.kill(active, signal.SIGKILL)
        assert wait_for(lambda: _commits_after_takeover(run / "replica1") > 0, timeout=120), resumed.stderr.read() \
            if resumed.poll() is not None else "no commit by the standby"
        assert rank_pid(run, "replica1", 0) not in (None, active)
        tree = descendants(resumed.pid)
        assert len(tree) >= 9, tree  # the fork server, two agents, two clients and ranks each, a new standby
        resumed.kill()
        left = _all_gone(tree, within_s=2.0)
        assert not left, left
        before = _names(run)
        time.sleep(1.5)
        assert _names(run) == before, "written after the kill"
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
        resumed.wait()
