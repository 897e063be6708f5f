"""End-to-end training of the tiny models on local ranks: time to result and throughput.

Claim checked: a tiny model reaches eval AUC > 0.7 in under a minute on CPU
(2 ranks, gloo), measured from `freescale launch` to its exit, imports and
torchrun start-up included.

    python benchmarks/bench_train.py [--quick] [--nproc 2] [--json benchmarks/results/train_cpu.json]

Columns: wall_s (launch to exit), train_s (timed steps, first step excluded),
samples_per_s (global, over the timed steps), step_ms (mean, timed steps),
eval_auc / eval_ne on the held-out split.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_json

from freescale.tables import print_table

REPO = Path(__file__).resolve().parents[1]


def run(kind: str, data: Path, out: Path, nproc: int, steps: int) -> dict[str, object]:
    cmd = [sys.executable, "-m", "freescale.cli", "launch", f"--nproc-per-node={nproc}",
           "--config", str(REPO / "configs" / f"tiny_{kind}.toml"), f"--data.path={data}",
           f"--train.output_dir={out}", f"--train.steps={steps}", "--checkpoint.every=0",
           "--checkpoint.save_final=false"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench_train: {kind} run failed:\n{proc.stderr[-3000:]}")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    summary = next(e for e in log if e["event"] == "summary")
    timed_steps = summary["steps"] - 1
    return {
        "model": kind, "ranks": nproc, "steps": summary["steps"], "wall_s": wall, "train_s": summary["seconds"],
        "samples_per_s": summary["samples_per_s"], "step_ms": 1000 * summary["seconds"] / max(timed_steps, 1),
        "eval_auc": summary["eval_auc"], "eval_ne": summary["eval_ne"],
        "auc_over_0.7_under_60s": bool(summary["eval_auc"] > 0.7 and wall < 60),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and rows (CI-sized, < 60 s)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", help="write rows, machine and parameters to this path")
    args = parser.parse_args()
    steps, rows_n = (100, 20_000) if args.quick else (300, 80_000)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        from freescale.dataloader import SyntheticSpec, generate

        generate(data, SyntheticSpec(rows=rows_n, eval_rows=8_192, seed=0))
        rows = [run(kind, data, Path(tmp) / kind, args.nproc, steps) for kind in ("hstu", "dlrm")]
    print_table(rows, ["model", "ranks", "steps", "wall_s", "train_s", "samples_per_s", "step_ms", "eval_auc",
                       "eval_ne", "auc_over_0.7_under_60s"])
    if args.json:
        write_json(args.json, "bench_train", {"quick": args.quick, "steps": steps, "rows": rows_n,
                                              "nproc": args.nproc, "batch_size_per_rank": 128}, rows)


if __name__ == "__main__":
    main()
