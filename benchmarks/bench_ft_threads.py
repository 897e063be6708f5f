"""Replica groups sharing one machine's cores: step time with the launcher's thread split vs without it.

``freescale launch --replicas R --ranks-per-replica G`` starts one elastic agent per group; torchrun
sets ``OMP_NUM_THREADS=1`` only for a group of several ranks, so R one-rank groups each ran torch at
every core (R times as many compute threads as cores).  The launcher now gives each rank
``cores // (R * G)`` threads (``freescale.launch.threads_per_rank``).  Three runs of the tiny DLRM on
the same data, interleaved ``--repeats`` times:

- ``plain``:   one job of R*G ranks without fault tolerance (``--nproc-per-node R*G``);
- ``ft``:      R groups of G ranks, the launcher's split (no ``OMP_NUM_THREADS`` set by the caller);
- ``ft_oversubscribed``: the same with ``OMP_NUM_THREADS`` = the machine's cores (what a one-rank
  group got before the split).

Step time: wall time between committed steps in group 0's (or the job's) log, median after
``--warmup`` steps.  Ratios are against ``plain`` within each repeat.

    python benchmarks/bench_ft_threads.py [--quick] [--steps 80] [--repeats 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import write_json

from freescale.tables import print_table

REPO = Path(__file__).resolve().parents[1]


def step_ms(log: Path, warmup: int) -> float:
    commits = [e for e in map(json.loads, log.read_text().splitlines()) if e.get("event") == "commit"]
    times = [e["time"] for e in commits[warmup:]]
    return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:]))


def run(kind: str, data: Path, out: Path, replicas: int, ranks: int, steps: int, warmup: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    shape = ["--nproc-per-node", str(replicas * ranks)]
    if kind != "plain":
        shape = ["--replicas", str(replicas), "--nproc-per-node", str(ranks)]
    if kind == "ft_oversubscribed":
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    cmd = [sys.executable, "-m", "freescale.cli", "launch", *shape, "--config", "configs/tiny_dlrm.toml",
           "--data.path", str(data), "--train.output_dir", str(out), "--train.steps", str(steps),
           "--train.log_every", str(steps), "--checkpoint.every", "0"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench_ft_threads: {kind} failed:\n{done.stderr[-2000:]}")
    return step_ms(out / ("train_log.jsonl" if kind == "plain" else "replica0/train_log.jsonl"), warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 steps, one repeat")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ranks-per-replica", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    steps, repeats = (40, 1) if args.quick else (args.steps, args.repeats)
    warmup = 10
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run([sys.executable, "-m", "freescale.cli", "gen-data", "--out", str(data), "--rows", "40000",
                        "--eval-rows", "4096", "--max-len", "64", "--seed", "0"], cwd=REPO, check=True,
                       capture_output=True)
        for repeat in range(repeats):
            times = {kind: run(kind, data, Path(tmp) / f"{kind}{repeat}", args.replicas, args.ranks_per_replica,
                               steps, warmup) for kind in ("plain", "ft", "ft_oversubscribed")}
            rows += [{"repeat": repeat, "kind": kind, "step_ms": ms, "vs_plain": ms / times["plain"]}
                     for kind, ms in times.items()]
    print_table(rows, ["repeat", "kind", "step_ms", "vs_plain"])
    if args.json:
        write_json(args.json, "bench_ft_threads", {"steps": steps, "repeats": repeats, "warmup": warmup,
                                                   "replicas": args.replicas, "ranks_per_replica":
                                                   args.ranks_per_replica, "model": "tiny_dlrm"}, rows)


if __name__ == "__main__":
    main()
