"""The training runs ``bench_ft_torchrec.py`` starts (``freescale launch`` of the tiny models, with or without replica
groups and faults) and the records it reads from their logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WARMUP = 10
"""FT steps left out of the step time (first quorum, lazy initialisation)."""
LOG_EVERY = 10
"""The trainer's metric window (steps per "step" event)."""
FAULT_ENV = "FREESCALE_FAULTS"
PIPELINES = ("plain", "torchrec", "prioritized")


def launch(out: Path, data: Path, model: str, batch: int, steps: int, nproc: int, replicas: int = 1,
           max_restarts: int = 0, fault: str = "", timeout: float = 900, pipeline: str = "plain",
           forkserver: bool = True, extra: tuple[str, ...] = ()) -> float:
    """``freescale launch`` to completion (output in ``<out>.log``); returns its wall time."""
    cmd = [sys.executable, "-m", "freescale.cli", "launch", "--nproc-per-node", str(nproc),
           *(["--replicas", str(replicas)] if replicas > 1 else []), "--max-restarts", str(max_restarts),
           "--config", str(REPO / "configs" / f"tiny_{model}.toml"), "--data.path", str(data),
           "--data.batch_size", str(batch), "--train.steps", str(steps), "--train.output_dir", str(out),
           "--train.eval", "false", "--train.progress", "false", "--train.log_every", str(LOG_EVERY),
           "--checkpoint.every", "0", "--checkpoint.save_final", "false", "--pipeline.kind", pipeline, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(FAULT_ENV, None)
    if not forkserver:
        env["FREESCALE_FORKSERVER"] = "off"  # every rank its own interpreter (imports included)
    if fault:
        env[FAULT_ENV] = fault
    log_path = out.with_name(out.name + ".log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # Own session: on a timeout or ^C the whole tree (launcher, agents, ranks) goes with it.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench_ft_torchrec: `{' '.join(cmd[1:])}` exited with {proc.returncode}:\n"
                         f"{log_path.read_text()[-3000:]}")
    return wall


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def committed(path: Path) -> list[dict[str, Any]]:
    """A group's committed steps (``commit`` events of its log), each with the seconds it spent staging a
    snapshot after that step (``stage`` events), if it staged one, and its catch-up record on the step that
    finished it (a ``catch_up`` event goes with the next commit of the log: the step whose replay ended it, or the
    step a waiting join trains after loading the snapshot of the one before)."""
    lines = jsonl(path)
    staged = {e["step"]: e["stage_s"] for e in lines if e.get("event") == "stage"}
    out: list[dict[str, Any]] = []
    caught: dict[str, Any] | None = None
    for e in lines:
        if e.get("event") == "catch_up":
            caught = e["catch_up"]
        elif e.get("event") == "commit":
            out.append({**e, **({"stage_s": staged[e["step"]]} if e["step"] in staged else {}),
                        **({"catch_up": caught} if caught is not None else {})})
            caught = None
    return out


def median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def mean_gap(times: dict[int, float], first: int, last: int) -> float:
    """Mean step time over steps ``first..last``: (t[last] - t[first-1]) / steps; NaN if one is missing."""
    if last < first or first - 1 not in times or last not in times:
        return float("nan")
    return (times[last] - times[first - 1]) / (last - first + 1)
