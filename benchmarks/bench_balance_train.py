"""Measured, not modeled: 2-rank CPU training of the sequence model, round robin vs balanced.

Generates ml-20m-like histories clipped to ``--max-len``, then trains the tiny
HSTU model on 2 local ranks (gloo) with each partitioner for the same steps
and seed, and reads from each run's log (docs/design.md "Measures"):

- step_ms: mean wall time of a step;
- bubble: 1 - busy / step time, averaged over ranks and steps, where busy is the
  rank's main-thread CPU time in forward, backward and optimizer (one compute
  thread per rank, so time blocked at a collective is not busy);
- imbalance: the planner's max/mean rank cost of the step (in its own cost model).

Variants: round robin; LPT with the FLOP-derived cost model; LPT re-fitting the
cost model to measured per-rank compute times every 20 steps; LPT planning 8
global batches together.

The first log window (warm-up) is dropped.  Ratios in one run on one machine.

    python benchmarks/bench_balance_train.py [--quick] [--json benchmarks/results/balance_train_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import write_json

from freescale.tables import print_table

from freescale.dataloader import SyntheticSpec, generate

REPO = Path(__file__).resolve().parents[1]


def train(
    data: Path, out: Path, partitioner: str, steps: int, max_len: int, batch: int, window: int, calibrate: int
) -> dict[str, object]:
    cmd = [sys.executable, "-m", "freescale.cli", "launch", "--nproc-per-node=2", "--config",
           str(REPO / "configs" / "tiny_hstu.toml"), f"--data.path={data}", f"--train.output_dir={out}",
           f"--train.steps={steps}", "--train.log_every=10", "--train.eval=false", "--checkpoint.every=0",
           "--checkpoint.save_final=false", f"--data.partitioner={partitioner}", f"--data.max_seq_len={max_len}",
           f"--data.batch_size={batch}", f"--data.window={window}", f"--data.calibrate_every={calibrate}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench_balance_train: {partitioner} failed:\n{proc.stderr[-3000:]}")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    windows = [e for e in log if e["event"] == "step"][1:]
    return {
        "partitioner": partitioner, "window": window, "calibrate_every": calibrate, "steps": steps,
        "step_ms": float(np.mean([w["step_ms"] for w in windows])),
        "bubble": float(np.mean([w["bubble"] for w in windows])),
        "imbalance": float(np.mean([w["imbalance"] for w in windows])),
        "loader_wait_ms": float(np.mean([w["loader_wait_ms"] for w in windows])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--json")
    args = parser.parse_args()
    steps = 40 if args.quick else 120
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate(data, SyntheticSpec(rows=20_000, eval_rows=0, max_len=args.max_len, lengths="ml-20m", seed=0))
        variants = (("round_robin", 1, 0), ("lpt", 1, 0), ("lpt", 1, 20), ("lpt", 8, 0))
        rows = [train(data, Path(tmp) / f"run-{p}-{w}-{c}", p, steps, args.max_len, args.batch, w, c)
                for p, w, c in variants]
    base = rows[0]
    for r in rows:
        r["step_speedup"] = base["step_ms"] / r["step_ms"]  # type: ignore[operator]
        r["bubble_cut"] = 1 - r["bubble"] / base["bubble"] if base["bubble"] else 0.0  # type: ignore[operator]
    print_table(rows, ["partitioner", "window", "calibrate_every", "steps", "step_ms", "step_speedup", "bubble", "bubble_cut",
                       "imbalance", "loader_wait_ms"])
    if args.json:
        write_json(args.json, "bench_balance_train", {"quick": args.quick, "max_len": args.max_len,
                                                      "batch_per_rank": args.batch, "ranks": 2, "lengths": "ml-20m",
                                                      "model": "configs/tiny_hstu.toml"}, rows)


if __name__ == "__main__":
    main()
