"""Several trainings back to back in one set of rank processes (tests).

``freescale launch`` starts fresh rank processes for every training, and each
pays for importing torch and torchrec and for the elastic agent (about 7 s of
a 2-core machine).  Tests that compare many short trainings (the pipelines
against each other, references for fault tolerance) run them here instead:
``world`` processes, each calling ``Trainer(cfg).fit()`` for every item in
order, on a fresh port each time (the trainer creates and destroys the
process group itself, exactly as under torchrun).

    python -m tests.trainings SCHEDULE.json      # one rank (RANK, WORLD_SIZE, ... in the environment)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import REPO, cli_env
from tests.procs import free_port


Item = tuple[str, list[str]] | tuple[str, list[str], dict[str, str]]


def run_trainings(items: list[Item], world: int, tmp: Path, timeout_s: float = 300,
                  env: dict[str, str] | None = None) -> None:
    """Train each ``(config file, overrides[, environment])`` of ``items`` in order on ``world`` local ranks (an
    item's environment is set for it alone: fault injection, the audit)."""
    schedule = tmp / "schedule.json"
    schedule.write_text(json.dumps([{"config": item[0], "overrides": item[1], "env": item[2] if len(item) > 2 else {},
                                     "port": free_port()} for item in items]))
    procs, logs = [], []
    for rank in range(world):
        rank_env = {**cli_env(), **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
        logs.append((tmp / f"trainings_rank{rank}.log").open("w"))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.trainings", str(schedule)], env=rank_env,
                                      cwd=REPO, stdout=logs[-1], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if codes != [0] * world:
        tails = "\n".join((tmp / f"trainings_rank{r}.log").read_text()[-3000:] for r in range(world))
        raise AssertionError(f"trainings exited {codes}:\n{tails}")


def _worker(schedule: str) -> None:
    from freescale.config import load_config
    from freescale.trainer import Trainer, TrainerConfig

    items: list[dict[str, Any]] = json.loads(Path(schedule).read_text())
    for item in items:
        os.environ["MASTER_PORT"] = str(item["port"])
        saved = {name: os.environ.get(name) for name in item.get("env", {})}
        os.environ.update(item.get("env", {}))
        Trainer(load_config(TrainerConfig, item["config"], item["overrides"])).fit()
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


if __name__ == "__main__":
    _worker(sys.argv[1])
