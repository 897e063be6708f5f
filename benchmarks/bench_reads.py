"""Reads at a simulated 1,024 ranks: does a step wait for its batch, and how much is decoded per byte trained?

Rank 0 of 1,024 simulated ranks trains with a planning window of 16 (32 samples per rank, a
30 ms step of matmuls on the training thread, the loader prefetching 2 batches on its thread),
reading from disk as it goes: nothing is decoded ahead of the run.  Per variant, on the same
samples (ml-20m-like per-user sequences, histories clipped to 16):

- ``format1``: one row per sample (``gen-data``'s layout, 8,192 rows per row group), LPT plan;
- ``format2``: one row per user (``freescale prepare``), LPT plan;
- ``+locality``: the same with ``data.locality``: each rank's share of a window is one run of
  storage, cut at equal cost (``planner.py``).

Reported: the loader's wait per step (P50, P99, max; the target is P99 <= 1 ms), the bytes
rank 0 decoded (Arrow bytes of the row groups it decoded) over the bytes of the samples it trained
on (the arrays its source handed the loader: histories, candidates, labels, ...; target <= 2x), and the plan's imbalance (max/mean rank cost, mean over steps).

    python benchmarks/bench_reads.py [--quick] [--json benchmarks/results/reads_cpu.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402
from bench_data import format1_twin, prepared  # noqa: E402

from freescale.dataloader.build import DataConfig, build_loader  # noqa: E402
from freescale.models import ModelConfig, cost_model_for  # noqa: E402
from freescale.tables import print_table  # noqa: E402

RANKS, WINDOW, STEP_S, MAX_LEN = 1024, 16, 0.030, 16
FEATURES = ["history_item_ids", "candidate_item_id", "user_id"]


def run(path: Path, per_rank: int, steps: int, locality: bool) -> dict[str, Any]:
    cfg = DataConfig(path=str(path), batch_size=per_rank, window=WINDOW, prefetch=2, max_seq_len=MAX_LEN,
                     locality=locality, read_ahead=0)  # (decoded_bytes counts the row groups the reads use)
    loader = build_loader(cfg, "train", rank=0, world_size=RANKS, sparse_features=FEATURES,
                          derived_cost=cost_model_for(ModelConfig(kind="hstu"), 0), seed=0)
    source = loader.source
    trained = [0]
    read_arrays = source.read_arrays

    def counting_read(rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        arrays, kept = read_arrays(rows)
        trained[0] += sum(a.nbytes for a in arrays.values())
        return arrays, kept

    source.read_arrays = counting_read  # type: ignore[method-assign]
    x = torch.randn(256, 256)
    waits, imbalance = [], []
    loader.next_batch()  # the first window is planned and its first batch read before training starts
    for _ in range(steps):
        end = time.perf_counter() + STEP_S
        while time.perf_counter() < end:
            x @ x
        loader.next_batch()
        assert loader.last is not None
        waits.append(1e3 * loader.last.wait_s)
        imbalance.append(loader.last.imbalance)
    loader.close()
    w = np.array(waits)
    return {"wait_ms_p50": float(np.median(w)), "wait_ms_p99": float(np.percentile(w, 99)),
            "wait_ms_max": float(w.max()), "late_steps": int((w > 1.0).sum()),
            "decoded_over_trained": source.decoded_bytes / max(trained[0], 1),
            "decoded_mb": source.decoded_bytes / 2**20, "trained_mb": trained[0] / 2**20,
            "imbalance": float(np.mean(imbalance))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 samples per rank, 2 windows")
    parser.add_argument("--row-group-interactions", type=int, default=4_096)
    parser.add_argument("--json")
    args = parser.parse_args()
    per_rank = 8 if args.quick else 32
    steps = 2 * WINDOW if args.quick else 3 * WINDOW
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-reads-") as tmp:
        format2 = prepared(Path(tmp), RANKS * per_rank * (steps + WINDOW + 2), args.row_group_interactions)
        format1 = format1_twin(format2, Path(tmp) / "format1", MAX_LEN)
        for name, path, locality in (("format1", format1, False), ("format1+locality", format1, True),
                                     ("format2", format2, False), ("format2+locality", format2, True)):
            rows.append({"variant": name, "ranks": RANKS, "per_rank": per_rank, "window": WINDOW, "steps": steps,
                         **run(path, per_rank, steps, locality)})
    print_table(rows, ["variant", "per_rank", "steps", "wait_ms_p50", "wait_ms_p99", "wait_ms_max", "late_steps",
                       "decoded_over_trained", "decoded_mb", "trained_mb", "imbalance"])
    if args.json:
        write_json(args.json, "bench_reads", {"ranks": RANKS, "window": WINDOW, "step_s": STEP_S, "max_len": MAX_LEN,
                                              "row_group_interactions": args.row_group_interactions,
                                              "quick": args.quick}, rows)


if __name__ == "__main__":
    main()
