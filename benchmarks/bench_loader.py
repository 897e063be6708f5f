"""Loader throughput: Parquet -> Batch, per core, against a row-by-row torch DataLoader.

Both read the same Parquet files.  Ours: ``BalancedLoader`` for one rank with
prefetch off (everything on the calling thread: planning, row-group reads,
vectorized Arrow -> KJT).  Baseline: a ``torch.utils.data.Dataset`` over the
same table (already in memory, to its advantage) whose ``__getitem__`` returns
one row as Python values, batched by ``DataLoader`` (num_workers=0) with a
collate function that builds the same KJT, dense and label tensors.

Then a short 2-rank CPU training run reports, from its log, the time a step
waited for its batch beside the step time (target: loading never on the
critical path).

    python benchmarks/bench_loader.py [--quick] [--json benchmarks/results/loader.json]
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

import numpy as np
import pyarrow.dataset as ds
import torch
from common import write_json

from freescale.tables import print_table
from torch.utils.data import DataLoader, Dataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from freescale.dataloader import SyntheticSpec, generate
from freescale.dataloader.cost import CostModel
from freescale.dataloader.loader import DataConfig, build_loader
from freescale.dataloader.schema import CANDIDATE_ITEM, DENSE, HISTORY_ITEMS, LABEL

REPO = Path(__file__).resolve().parents[1]
FEATURES = [HISTORY_ITEMS, CANDIDATE_ITEM]


class RowDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, path: Path, max_len: int) -> None:
        files = sorted(str(p) for p in path.glob("train-*.parquet"))
        self.table = ds.dataset(files, format="parquet").to_table(columns=[HISTORY_ITEMS, CANDIDATE_ITEM, DENSE, LABEL])
        self.max_len = max_len

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict[str, object]:
        return self.table.slice(i, 1).to_pylist()[0]


def collate(rows: list[dict[str, object]], max_len: int = 200) -> tuple[KeyedJaggedTensor, torch.Tensor, torch.Tensor]:
    histories = [r[HISTORY_ITEMS][-max_len:] for r in rows]  # type: ignore[index]
    values = [v for h in histories for v in h] + [r[CANDIDATE_ITEM] for r in rows]
    lengths = [len(h) for h in histories] + [1] * len(rows)
    kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.tensor(values), lengths=torch.tensor(lengths))
    return kjt, torch.tensor([r[DENSE] for r in rows]), torch.tensor([r[LABEL] for r in rows])


def time_ours(path: Path, batch: int, steps: int, max_len: int) -> float:
    cfg = DataConfig(path=str(path), batch_size=batch, max_seq_len=max_len, prefetch=0, partitioner="lpt")
    loader = build_loader(cfg, "train", rank=0, world_size=1, sparse_features=FEATURES,
                          derived_cost=CostModel(1e-3, 1.0, 1.0), seed=0)
    loader.next_batch()  # opening and the first row groups are not per-sample work
    start = time.perf_counter()
    n = sum(loader.next_batch().size for _ in range(steps))
    return n / (time.perf_counter() - start)


def time_baseline(path: Path, batch: int, steps: int, max_len: int) -> float:
    dataset = RowDataset(path, max_len)
    it = iter(DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=0, collate_fn=collate))
    next(it)
    start = time.perf_counter()
    n = sum(next(it)[2].numel() for _ in range(steps))
    return n / (time.perf_counter() - start)


def training_wait(data: Path, out: Path, steps: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "freescale.cli", "launch", "--nproc-per-node=2", "--config",
           str(REPO / "configs" / "tiny_hstu.toml"), f"--data.path={data}", f"--train.output_dir={out}",
           f"--train.steps={steps}", f"--train.log_every={steps // 2}", "--train.eval=false",
           "--checkpoint.every=0", "--checkpoint.save_final=false"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    step = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()
            if '"event": "step"' in line][-1]
    return {"step_ms": step["step_ms"], "loader_wait_ms": step["loader_wait_ms"],
            "wait_share": step["loader_wait_ms"] / step["step_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows_n, steps, batch, max_len = (40_000, 30, 256, 200) if args.quick else (200_000, 150, 256, 200)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        generate(data, SyntheticSpec(rows=rows_n, eval_rows=0, max_len=max_len, lengths="ml-20m", seed=0))
        ours = time_ours(data, batch, steps, max_len)
        base = time_baseline(data, batch, max(5, steps // 10), max_len)
        rows = [
            {"loader": "freescale BalancedLoader (lpt, 1 thread)", "samples_per_s": ours, "ratio": ours / base},
            {"loader": "torch Dataset + DataLoader, row by row", "samples_per_s": base, "ratio": 1.0},
        ]
        print_table(rows, ["loader", "samples_per_s", "ratio"])
        demo = Path(tmp) / "demo"
        generate(demo, SyntheticSpec(rows=20_000, eval_rows=0, seed=0))
        wait = training_wait(demo, Path(tmp) / "run", 40 if args.quick else 100)
        print(f"\n2-rank tiny HSTU training: step {wait['step_ms']:.1f} ms, waited for data "
              f"{wait['loader_wait_ms']:.3f} ms per step ({100 * wait['wait_share']:.2f}% of the step)")
    if args.json:
        write_json(args.json, "bench_loader", {"quick": args.quick, "rows": rows_n, "batch": batch,
                                               "max_len": max_len, "lengths": "ml-20m"},
                   rows + [{"training": wait}])


if __name__ == "__main__":
    main()
