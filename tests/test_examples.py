"""The examples of a user's own torchrec loop made fault tolerant, each with a real SIGKILL.

``examples/user_loop_ft.py`` (the explicit form, its own launcher) and ``examples/deepfm_ft.py``
(the wrapper form under ``freescale launch -- python ...``, plain ``dist.init_process_group``, torchrec's
planner through ``ft.shard``, an LR scheduler).  Two replica groups of two ranks; rank 1 of group 1
SIGKILLs itself as step 8's gradient exchange begins (``FREESCALE_FAULTS``); its group restarts and
catches up from group 0 while group 0 keeps training.  Checked: the groups' whole states hash the same
at every step both committed (and the schedulers agree), the restarted group caught up and trained
again, and every sample was trained exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.testing import FAULTS_ENV
from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.multiprocess


def test_user_loop_survives_a_sigkill_and_joins_the_step_in_progress(tmp_path: Path) -> None:
    """With ``join = "wait"`` and ``StepSamples``: the restarted group (both ranks, under torchrun) trains its
    share of the step it joins (planned in by the commit before), in step with group 0."""
    steps, batch = 100, 16
    env = {**cli_env(), FAULTS_ENV: "1:1:8:reduce:0,*:*:0:away:300"}
    proc = subprocess.run([sys.executable, "examples/user_loop_ft.py", "--replicas", "2", "--ranks-per-replica", "2",
                           "--steps", str(steps), "--batch", str(batch), "--out", str(tmp_path), "--join", "wait"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "replica1" / "rank1.killed").exists(), "the fault never fired"
    logs = {g: [json.loads(line) for line in (tmp_path / f"replica{g}.jsonl").read_text().splitlines()]
            for g in (0, 1)}
    steps_of = {g: {e["step"]: e for e in log if "step" in e} for g, log in logs.items()}
    assert sorted(steps_of[0]) == list(range(steps)), "the survivor skipped a step"
    # Rank 1 of group 1 dies as step 8's exchange begins (a timer on another thread fires the SIGKILL),
    # so step 8 may still commit with both groups; from step 8 or 9 on, group 0 goes on alone.
    alone = [s for s, e in steps_of[0].items() if e["participants"] == ["replica0"]]
    assert alone and alone[0] in (8, 9), alone[:3]
    caught = [s for s, e in steps_of[1].items() if e["caught_up"]]
    assert len(caught) == 1 and caught[0] > alone[0], "group 1 did not catch up once"
    first_back = min(s for s in steps_of[1] if s > alone[0])
    assert first_back == caught[0] and steps_of[1][caught[0]]["weight"] == 2 * batch, (
        "the restarted group did not train its share of the step it joined")
    assert max(steps_of[1]) == steps - 1 and steps_of[0][steps - 1]["participants"] == ["replica0", "replica1"]
    for step, e in steps_of[1].items():
        assert e["digest"] == steps_of[0][step]["digest"], f"step {step}: the groups differ"
    trained = [i for e in steps_of[0].values() for i in e["trained"]]
    pending = [i for e in logs[0] if "pending" in e for i in e["pending"]]
    assert sorted(trained + pending) == list(range(steps * batch * 4)), "a sample was lost or trained twice"


def test_deepfm_wrapper_form_under_freescale_launch_survives_a_sigkill_on_the_rank_it_has_left(tmp_path: Path) -> None:
    steps, per_step = 80, 16 * 2 * 2
    env = {**cli_env(), FAULTS_ENV: "1:1:8:reduce:0,*:*:0:away:300", "FREESCALE_FAULTS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "freescale.cli", "launch", "--replicas", "2", "--ranks-per-replica",
                           "2", "--on-rank-loss", "shrink", "--", sys.executable, "examples/deepfm_ft.py", "--steps",
                           str(steps), "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "replica1" / "rank1.killed").exists(), "the fault never fired"
    # the dead rank's peer names it in one line, if it sees the failure before its agent stops it (or says a peer
    # failed, if it looked before the kernel had the dead rank gone)
    peer_lines = [line for line in proc.stderr.splitlines() if "collective failed" in line or "a peer failed" in line]
    assert all(line.startswith(("freescale: replica group 1: rank 1 is gone (rank 0's collective failed",
                                "freescale: replica group 1 rank 0: a peer failed")) for line in peer_lines), peer_lines
    assert "Traceback" not in proc.stderr, "a handled fault printed a traceback"
    logs = {g: [json.loads(line) for line in (tmp_path / f"replica{g}.jsonl").read_text().splitlines()]
            for g in (0, 1)}
    steps_of = {g: {e["step"]: e for e in log if "step" in e} for g, log in logs.items()}
    assert sorted(steps_of[0]) == list(range(steps)), "the survivor skipped a step"
    assert "replica group 1: lost rank 1 (signal 9); continues on 1 rank at 0.50 share" in proc.stderr
    rejoined = sorted(s for s in steps_of[1] if s > 9)
    assert rejoined and rejoined[-1] == steps - 1, "group 1 did not train again on the rank it has left"
    for step in rejoined:
        mine, theirs = steps_of[1][step], steps_of[0][step]
        assert mine["participants"] == ["replica0", "replica1"]
        assert [mine[k] for k in ("digest", "scheduler", "lr", "seen")] == [
            theirs[k] for k in ("digest", "scheduler", "lr", "seen")], f"step {step}: the groups differ"
    assert steps_of[0][steps - 1]["scheduler"] == steps, "the scheduler missed a committed step"
    assert steps_of[0][steps - 1]["seen"] == steps * per_step - len(logs[0][-1]["pending"])
    trained = [i for e in steps_of[0].values() for i in e["trained"]]
    pending = [i for e in logs[0] if "pending" in e for i in e["pending"]]
    assert sorted(trained + pending) == list(range(steps * per_step)), "a sample was lost or trained twice"

