"""FTAR across replica processes with real faults (SIGKILL, SIGSTOP) on 127.0.0.1.

Each replica is ``benchmarks/mlp_replica.py`` (a user's own loop over ``freescale.ft.FaultTolerance``)
in its own process; faults come from ``FREESCALE_FAULTS``; the lighthouse runs in this process.  In every case the survivors finish, commit every step, and
are bit-identical at every committed step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from freescale.ft.lighthouse import Lighthouse, LighthouseConfig
from benchmarks.mlp_replica import batch, build_model, group_of
from freescale.testing import FAULTS_ENV
from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.multiprocess
WORKER = REPO / "benchmarks" / "mlp_replica.py"


def start(lh: Lighthouse, replica: str, out: Path, steps: int, *extra: str, group: int = 3,
          fault: str = "", away_ms: int = 0) -> subprocess.Popen[str]:
    """A replica process that starts training once ``group`` replicas are up; ``fault``:
    ``<step>:<point>[:<ms>]`` of ``FREESCALE_FAULTS`` for this replica; ``away_ms``: its steps
    last that much longer while a replica is away (``away`` of ``FREESCALE_FAULTS``)."""
    env = cli_env()
    faults = [f"{group_of(replica)}:0:{fault}"] * bool(fault) + [f"*:*:0:away:{away_ms}"] * bool(away_ms)
    if faults:
        env[FAULTS_ENV] = ",".join(faults)
    return subprocess.Popen(
        [sys.executable, str(WORKER), "--lighthouse", lh.url, "--replica-id", replica, "--steps", str(steps),
         "--out", str(out), "--wait-for", str(group), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def read(out: Path, replica: str) -> list[dict[str, Any]]:
    path = out / f"{replica}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def lighthouse(**overrides: Any) -> Lighthouse:
    cfg = LighthouseConfig(**{"min_replicas": 1, "join_timeout_s": 0.5, "heartbeat_timeout_s": 0.3, **overrides})
    lh = Lighthouse(cfg)
    lh.start_in_thread()
    return lh


def finish(procs: dict[str, subprocess.Popen[str]], survivors: list[str], timeout: float = 120) -> None:
    for name in survivors:
        rc = procs[name].wait(timeout=timeout)
        assert rc == 0, f"{name} exited {rc}:\n{procs[name].stderr.read()[-3000:] if procs[name].stderr else ''}"


def assert_identical_every_step(out: Path, survivors: list[str], steps: int) -> list[list[dict[str, Any]]]:
    logs = [read(out, r) for r in survivors]
    for log in logs:
        assert [e["step"] for e in log] == list(range(steps)), "a step was skipped or repeated"
    for per_step in zip(*logs):
        assert len({e["digest"] for e in per_step}) == 1, per_step
        assert len({e["quorum_id"] for e in per_step}) == 1
    return logs


def test_weighted_average_is_the_mean_over_samples(tmp_path: Path) -> None:
    """Replicas with 8, 24 and 64 samples: the update equals one model trained on all 96."""
    lh = lighthouse(min_replicas=3)
    sizes = {"a": 8, "b": 24, "c": 64}
    procs = {r: start(lh, r, tmp_path, 3, "--batch", str(n), "--save-params", "--hidden", "128")
             for r, n in sizes.items()}
    finish(procs, list(sizes))
    logs = assert_identical_every_step(tmp_path, list(sizes), 3)
    assert all(e["participants"] == ["a", "b", "c"] for e in logs[0])
    # Reference: one model, the same three batches, gradient = mean over all 96 samples.
    model = build_model(128, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r, n in sizes.items():
            x, y = batch(step, r, n)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            for acc, p in zip(grads, model.parameters()):
                acc += p.grad * n
        for p, acc in zip(model.parameters(), grads):
            p.grad = acc / sum(sizes.values())
        optimizer.step()
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    for mine, want in zip(got, model.parameters()):  # summation order differs from gloo's: values, not bits
        torch.testing.assert_close(mine, want.detach(), rtol=1e-5, atol=1e-6)
    # A participant-count average (torchft's) would differ by far more than that tolerance.
    lh.stop_thread()


@pytest.mark.parametrize("phase", ["forward", "reduce:0", "reduce:3"])
def test_sigkill_one_replica_survivors_commit_every_step(phase: str, tmp_path: Path) -> None:
    """c dies in step 5; a and b commit every step without it.  With ``forward``, the lighthouse is
    also stopped just after it hands out the smaller quorum and restarted on its state file: the
    survivors' next commit comes within the restart + 1 s, and quorum ids keep growing."""
    restart = phase == "forward"
    # A join timeout of 2 s: on a loaded machine a survivor slow to send its first request would otherwise be
    # left out of step 0's quorum and start behind (the kill of c is seen by the heartbeats, not by this wait).
    lh = lighthouse(min_replicas=1, join_timeout_s=2.0, **({"state_path": str(tmp_path / "lh.json")} if restart else {}))
    steps = 40 if restart else 12
    extra = ("--step-sleep", "0.05") if restart else ()
    procs = {r: start(lh, r, tmp_path, steps, *extra, fault=f"5:{phase}" if r == "c" else "") for r in ("a", "b", "c")}
    assert procs["c"].wait(timeout=120) == -signal.SIGKILL
    if restart:
        deadline = time.monotonic() + 30
        while (lh.quorum is None or len(lh.quorum["participants"]) != 2) and time.monotonic() < deadline:
            time.sleep(0.001)
        handed_out, port = lh.quorum_id, lh.url.rsplit(":", 1)[1]
        stopped = time.time()
        lh.stop_thread()
        lh = Lighthouse(dataclasses.replace(lh.cfg, bind=f"127.0.0.1:{port}"))
        lh.start_in_thread()
        restarted = time.time()
    finish(procs, ["a", "b"])
    logs = assert_identical_every_step(tmp_path, ["a", "b"], steps)
    with_c = [e["step"] for e in logs[0] if e["participants"] == ["a", "b", "c"]]
    without_c = [e["step"] for e in logs[0] if e["participants"] == ["a", "b"]]
    # c took part in steps 0..k (k >= 4: it died during step 5, possibly after step 5's vote), then never again.
    assert with_c == list(range(len(with_c))) and len(with_c) in (5, 6)
    assert without_c == list(range(len(with_c), steps))
    # c logged steps 0..4 and died in 5; or (the kill comes from a timer, ``reduce:3`` is 3 ms into the
    # exchange) step 5 committed with c first, and c may have logged it before the signal landed.
    assert [e["step"] for e in read(tmp_path, "c")] in (list(range(5)), list(range(len(with_c))))
    if restart:
        after = [e for e in logs[0] if e["time"] > stopped]
        assert after and after[0]["time"] - restarted < 1.0, "the survivors' first commit after the restart was late"
        assert all(e["quorum_id"] >= handed_out for e in after) and after[-1]["quorum_id"] > handed_out
    lh.stop_thread()


def test_sigstopped_replica_is_evicted_by_timeout(tmp_path: Path) -> None:
    lh = lighthouse(min_replicas=1)
    steps = 10
    procs = {r: start(lh, r, tmp_path, steps, "--timeout", "2") for r in ("a", "b", "c")}
    deadline = time.monotonic() + 60
    while len(read(tmp_path, "c")) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(procs["c"].pid, signal.SIGSTOP)
    try:
        finish(procs, ["a", "b"])
    finally:
        os.kill(procs["c"].pid, signal.SIGKILL)
        procs["c"].wait(timeout=30)
    logs = assert_identical_every_step(tmp_path, ["a", "b"], steps)
    assert logs[0][-1]["participants"] == ["a", "b"]
    lh.stop_thread()


def test_killed_replica_restarts_and_catches_up_recording_then_waiting(tmp_path: Path) -> None:
    """c is SIGKILLed mid-reduce at step 5 and its warm standby (a second process, model built, waiting on c's
    lock: ``ft/standby.py``) takes over as incarnation 1 with ``join = "record"``: it joins with weight 0, copies a
    peer's snapshot while a and b keep committing and replays the steps it missed.  It is SIGKILLed at step 25 and
    a second standby takes over as incarnation 2 with ``join = "wait"``: it loads the snapshot of the step before
    the one it joined (staged by a and b once they read that step's quorum: it came up during their redo of step
    25, after the vote that would have had them stage it at its commit) and trains the step it joined, a and b
    waiting for its gradients, and replays nothing.  All are bit-identical at every step.  (A cold restart: the examples' and the torchrec groups' tests.)"""
    lh = lighthouse(min_replicas=1)
    steps = 60
    # A 64 KiB first bucket: several buckets, so a replica sitting a step out (zeros, weight 0) must
    # reduce in the others' bucket layout, or the collectives mismatch.
    common = ["--snapshots", "--step-sleep", "0.02", "--hidden", "256", "--first-bucket-kb", "64"]
    lock = ["--standby-lock", str(tmp_path / "c.lock")]
    procs = {r: start(lh, r, tmp_path, steps, *common, *(lock + ["--log-name", "c_first_life"]) * (r == "c"),
                      fault="5:reduce:0" if r == "c" else "", away_ms=300) for r in ("a", "b", "c")}
    deadline = time.monotonic() + 60
    while not (tmp_path / "c_first_life.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # c holds its lock: the standby may start
    recording = start(lh, "c", tmp_path, steps, *common, *lock, "--incarnation", "1", "--log-name", "c_second_life",
                      "--join", "record", group=1, fault="25:reduce:0@1", away_ms=300)
    assert procs["c"].wait(timeout=120) == -signal.SIGKILL
    first_life = [json.loads(line) for line in (tmp_path / "c_first_life.jsonl").read_text().splitlines()]
    assert float((tmp_path / "c.took_over").read_text()) - float((tmp_path / "c" / "rank0.killed").read_text()) < 5
    waiting = start(lh, "c", tmp_path, steps, *common, *lock, "--incarnation", "2", "--join", "wait", group=1,
                    away_ms=300)  # the first standby holds the lock now
    assert recording.wait(timeout=120) == -signal.SIGKILL
    procs["c"] = waiting
    finish(procs, ["a", "b", "c"])
    logs = assert_identical_every_step(tmp_path, ["a", "b"], steps)
    a_by_step = {e["step"]: e for e in logs[0]}
    second_life, third_life = read(tmp_path, "c_second_life"), read(tmp_path, "c")
    assert second_life and third_life, "a restarted replica never caught up"
    for life, last in ((second_life, second_life[-1]["step"]), (third_life, steps - 1)):
        assert [e["step"] for e in life] == list(range(life[0]["step"], last + 1))
        for e in life:  # identical to the survivors at every step after the catch-up
            assert e["digest"] == a_by_step[e["step"]]["digest"], e["step"]
            assert e["participants"] == ["a", "b", "c"]
    recorded = second_life[0]["catch_up"]
    assert recorded["snapshot_step"] >= recorded["joined_step"] - 1 >= len(first_life)
    assert 24 <= second_life[-1]["step"] <= 25 and not second_life[0]["contributing"]
    caught, info = third_life[0], third_life[0]["catch_up"]  # it trained the step it joined
    assert caught["contributing"] and info["join"] == "wait" and info["replayed"] == 0
    assert caught["step"] == info["joined_step"] == info["snapshot_step"] + 1 > second_life[-1]["step"]
    # The survivors staged one snapshot per catch-up and never waited for the transfer in staging.
    assert sum(1 for e in logs[0] if e["stage_s"] > 0) == 2
    lh.stop_thread()
