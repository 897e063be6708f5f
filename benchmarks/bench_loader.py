"""Loader throughput against the physical limit and against the loader a user would write.

One synthetic MovieLens-shaped log (ml-20m-like users) is prepared (format 2, one row per user),
and the same training samples are written one per row (format 1, histories cut at 200).  Single
thread, samples per second:

- ``bare decode``: pyarrow reading and decoding every row group of the columns the loader decodes
  (the model's and what its row checks read), to numpy, nothing else: the ceiling on this machine;
- ``decode + history cut``: the bare decode plus the one copy any loader of the layout makes, each
  sample's most recent ``max_len`` history items, with the loader's kernel: the floor of the work
  (format 2's bare decode builds no history at all, so it is no ceiling for a loader);
- ``freescale``: ``BalancedLoader`` for one rank over one epoch as training runs it (planning, row checks,
  row-group reads, the history cut, numpy -> KJT, on its prefetch thread: several steps a read; the consumer
  only takes the batches; the row groups read and decoded to Arrow ahead on a thread of their own,
  ``read_ahead``), target >= 70% of the bare decode of its layout; its second epoch (the same loader after an
  untimed first: its memory touched once, as the bare decode's is when it runs); and with ``read_ahead = 0``
  (every row group decoded on the prefetch thread, one thread at work);
- ``torch DataLoader, batched``: what a user would write: an ``IterableDataset`` over pyarrow row
  groups (shuffled), rows permuted inside each, batches built from Arrow offsets (format 1);
- ``torch DataLoader, row by row``: ``__getitem__`` per row and a Python collate (for reference).

Each is run ``--repeats`` times, interleaved, and the median kept; beside each freescale row, its wait for its first
batch (a fresh loader's start-up: the epoch's order, its first row groups, its first read).  Then bytes on disk of each
layout, an epoch order of 20M rows (its first step's rows against the whole order: what a start or a restart waits for
at scale), and a short 2-rank training run's wait for data per step.

    python benchmarks/bench_loader.py [--quick] [--json benchmarks/results/loader_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import torch
from bench_data import format1_twin, prepared
from common import write_json
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from freescale.dataloader.cost import CostModel
from freescale.dataloader.gather import gather_tails
from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.epoch_order import EpochOrder
from freescale.dataloader.schema import CANDIDATE_ITEM, DENSE, HISTORY_ITEMS, LABEL, DatasetManifest
from freescale.tables import print_table

REPO = Path(__file__).resolve().parents[1]
FEATURES = [HISTORY_ITEMS, CANDIDATE_ITEM]
FORMAT1_COLUMNS = [HISTORY_ITEMS, CANDIDATE_ITEM, DENSE, LABEL]
# What the loader decodes of each layout: the model's columns and what its row checks read (format 1:
# the user and timestamps too; format 2: the whole user row).
FORMAT1_DECODED = ["user_id", HISTORY_ITEMS, "history_timestamps", CANDIDATE_ITEM, DENSE, LABEL, "history_length"]
FORMAT2_COLUMNS = ["user_id", "item_ids", "timestamps", "labels", "length", "train_end"]


def files(path: Path) -> list[Path]:
    manifest = DatasetManifest.read(path)
    return [path / name for name in manifest.splits["train"]]


def bare_decode(path: Path, columns: list[str], samples: int) -> float:
    """Every row group of ``columns`` read and decoded to numpy buffers; samples served per second."""
    start = time.perf_counter()
    for f in files(path):
        pf = pq.ParquetFile(f)
        for rg in range(pf.num_row_groups):
            table = pf.read_row_group(rg, columns=columns)
            for column in table.columns:
                array = column.combine_chunks()
                while hasattr(array, "values"):
                    array = array.values
                array.to_numpy()
    return samples / (time.perf_counter() - start)


def decode_and_cut(path: Path, columns: list[str], samples: int, max_len: int, per_user: bool) -> float:
    """``bare_decode`` plus the one copy every loader of this layout must make: each training sample's
    history, its ``max_len`` most recent items, cut out with the loader's own kernel (``gather_tails``),
    in storage order, nothing else (no plan, no checks, no batches): the floor of a loader's work."""
    start = time.perf_counter()
    for f in files(path):
        pf = pq.ParquetFile(f)
        for rg in range(pf.num_row_groups):
            table = pf.read_row_group(rg, columns=columns)
            arrays = {}
            for name in table.column_names:
                array = table.column(name).combine_chunks()
                if pa.types.is_list(array.type):
                    arrays[name + "@"] = array.offsets.to_numpy().astype(np.int64)
                while hasattr(array, "values"):
                    array = array.values
                arrays[name] = array.to_numpy()
            if per_user:  # training samples: positions [1, train_end) of each user
                offsets, train_end = arrays["item_ids@"], arrays["train_end"].astype(np.int64)
                count = np.maximum(train_end - 1, 0)
                first = np.repeat(np.cumsum(count) - count, count)
                position = np.arange(int(count.sum())) - first + 1
                ends = np.repeat(offsets[:-1], count) + position
                gather_tails([(arrays["item_ids"], ends, np.minimum(position, max_len))])
            else:
                offsets = arrays[HISTORY_ITEMS + "@"]
                gather_tails([(arrays[HISTORY_ITEMS], offsets[1:], np.minimum(np.diff(offsets), max_len))])
    return samples / (time.perf_counter() - start)


FIRST_BATCH_MS: dict[tuple[Path, int, bool], list[float]] = {}
"""``ours``'s wait for its first batch, by (input, read_ahead, after_one): a fresh loader's start-up."""


def ours(path: Path, batch: int, max_len: int, read_ahead: int = 8, after_one: bool = False) -> float:
    """One epoch (every row group decoded once, like the bare decode), opening excluded; ``read_ahead`` as
    ``[data] read_ahead`` (8, the default: row groups decoded on a thread of their own).  ``after_one``: the
    loader's second epoch, timed after an untimed first one and everything it held let go of (its threads
    stopped, its decoded row groups and what it planned ahead forgotten: the second plans every step and decodes
    every row group again, as the first): only its memory (the batches' buffers, format 2's slots) is touched
    already, as the bare decode's is by the time it runs; a fresh loader's first epoch pays those first touches."""
    cfg = DataConfig(path=str(path), batch_size=batch, max_seq_len=max_len, partitioner="lpt", read_ahead=read_ahead)
    loader = build_loader(cfg, "train", rank=0, world_size=1, sparse_features=FEATURES,
                          derived_cost=CostModel(1e-3, 1.0, 1.0), seed=0)
    if after_one:  # (then everything a first epoch does: the threads started, every step planned, every row group
        for _ in range(loader.steps_per_epoch):  # decoded)
            loader.next_batch()
        loader.close()
        loader.source.forget_decoded()
        loader.planner.forget_planned()
    start = time.perf_counter()
    n = loader.next_batch().size
    FIRST_BATCH_MS.setdefault((path, read_ahead, after_one), []).append(1e3 * (time.perf_counter() - start))
    n += sum(loader.next_batch().size for _ in range(loader.steps_per_epoch - 1))
    elapsed = time.perf_counter() - start
    loader.close()
    return n / elapsed


def order_start(rows: int, repeats: int) -> dict[str, float]:
    """An epoch order of ``rows`` rows in row groups of 4,096 (windows of 8, the default), made fresh each time:
    the first step's rows (256) usable, against the whole order made, and a step's rows halfway through the epoch
    for an order resumed there (``EpochOrder.restore``: from its window's saved draws; before, the windows before it
    were made first: half the whole order), each the median of ``repeats``: how long a fresh loader (a start, a
    restart, a resume) waits for its epoch's order before its first batch."""
    groups = np.full(rows // 4096, 4096)
    first, whole, resumed = [], [], []
    middle = int(groups.sum()) // 2
    for repeat in range(repeats):
        order = EpochOrder(groups, seed=repeat, shuffle=True, window_row_groups=8)
        start = time.perf_counter()
        order.rows_until(0, 256)
        first.append(1e3 * (time.perf_counter() - start))
        order = EpochOrder(groups, seed=repeat, shuffle=True, window_row_groups=8)
        start = time.perf_counter()
        order(0)
        whole.append(1e3 * (time.perf_counter() - start))
        saved = order.state_at(0, middle)  # (a position saved halfway: a loader resumed there)
        assert saved is not None
        order = EpochOrder(groups, seed=repeat, shuffle=True, window_row_groups=8)
        start = time.perf_counter()
        order.restore(saved)
        order.rows_until(0, middle + 256, middle)
        resumed.append(1e3 * (time.perf_counter() - start))
    return {"rows": float(groups.sum()), "first_step_ms": float(np.median(first)), "whole_ms": float(np.median(whole)),
            "resumed_halfway_ms": float(np.median(resumed))}


class RowGroupBatches(IterableDataset):  # type: ignore[type-arg]
    """A user's batched reader: row groups in a shuffled order, rows permuted inside each, batches from offsets."""

    def __init__(self, path: Path, batch: int, max_len: int) -> None:
        self.pf = pq.ParquetFile(files(path)[0])
        self.batch, self.max_len = batch, max_len

    def __iter__(self) -> Iterator[tuple[KeyedJaggedTensor, torch.Tensor, torch.Tensor]]:
        rng = np.random.default_rng(0)
        for rg in rng.permutation(self.pf.num_row_groups):
            table = self.pf.read_row_group(int(rg), columns=FORMAT1_COLUMNS)
            table = table.take(rng.permutation(table.num_rows))
            for start in range(0, table.num_rows - self.batch + 1, self.batch):
                part = table.slice(start, self.batch)
                history = part.column(HISTORY_ITEMS).combine_chunks()
                lengths = np.minimum(pc.list_value_length(history).to_numpy(), self.max_len)
                values = np.concatenate([history.flatten().to_numpy(), part.column(CANDIDATE_ITEM).to_numpy()])
                kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.from_numpy(values),
                                        lengths=torch.from_numpy(np.concatenate([lengths, np.ones(self.batch, np.int64)])))
                dense = part.column(DENSE).combine_chunks().flatten().to_numpy().reshape(self.batch, -1)
                labels = part.column(LABEL).to_numpy().copy()
                yield kjt, torch.from_numpy(dense.copy()), torch.from_numpy(labels)


def torch_batched(path: Path, batch: int, max_len: int) -> float:
    """One epoch, like ``ours``."""
    start = time.perf_counter()
    n = sum(b[2].numel() for b in DataLoader(RowGroupBatches(path, batch, max_len), batch_size=None, num_workers=0))
    return n / (time.perf_counter() - start)


class RowDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, path: Path) -> None:
        self.table = ds.dataset([str(f) for f in files(path)], format="parquet").to_table(columns=FORMAT1_COLUMNS)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict[str, object]:
        return self.table.slice(i, 1).to_pylist()[0]


def collate(rows: list[dict[str, object]]) -> tuple[KeyedJaggedTensor, torch.Tensor, torch.Tensor]:
    histories = [r[HISTORY_ITEMS] for r in rows]
    values = [v for h in histories for v in h] + [r[CANDIDATE_ITEM] for r in rows]  # type: ignore[attr-defined]
    lengths = [len(h) for h in histories] + [1] * len(rows)  # type: ignore[arg-type]
    kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.tensor(values), lengths=torch.tensor(lengths))
    return kjt, torch.tensor([r[DENSE] for r in rows]), torch.tensor([r[LABEL] for r in rows])


def torch_rows(path: Path, batch: int, steps: int) -> float:
    it = iter(DataLoader(RowDataset(path), batch_size=batch, shuffle=True, num_workers=0, collate_fn=collate))
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
    parser.add_argument("--repeats", type=int, default=0, help="interleaved rounds, median taken (default 1 quick, 3)")
    parser.add_argument("--lengths", default="ml-20m", choices=["ml-20m", "ml-1m"],
                        help="the synthetic log's user lengths (another input than the default's)")
    parser.add_argument("--samples", type=int, default=0, help="training samples (default 40,000 quick, 300,000)")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    samples, steps, batch, max_len = (40_000, 30, 256, 200) if args.quick else (300_000, 300, 256, 200)
    samples = args.samples or samples
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        format2 = prepared(Path(tmp), samples, lengths=args.lengths)
        format1 = format1_twin(format2, Path(tmp) / "format1", max_len)
        n = DatasetManifest.read(format2).samples["train"]
        f1, f2 = "format 1 (per sample)", "format 2 (per user)"
        measures = [
            (f1, "bare pyarrow decode", lambda: bare_decode(format1, FORMAT1_DECODED, n)),
            (f1, "decode + history cut", lambda: decode_and_cut(format1, FORMAT1_DECODED, n, max_len, False)),
            (f1, "freescale BalancedLoader", lambda: ours(format1, batch, max_len)),
            (f1, "freescale, its second epoch", lambda: ours(format1, batch, max_len, after_one=True)),
            (f1, "freescale, read_ahead = 0", lambda: ours(format1, batch, max_len, read_ahead=0)),
            (f1, "torch DataLoader, batched over pyarrow", lambda: torch_batched(format1, batch, max_len)),
            (f1, "torch DataLoader, row by row", lambda: torch_rows(format1, batch, max(5, steps // 30))),
            (f2, "bare pyarrow decode", lambda: bare_decode(format2, FORMAT2_COLUMNS, n)),
            (f2, "decode + history cut", lambda: decode_and_cut(format2, FORMAT2_COLUMNS, n, max_len, True)),
            (f2, "freescale BalancedLoader", lambda: ours(format2, batch, max_len)),
            (f2, "freescale, its second epoch", lambda: ours(format2, batch, max_len, after_one=True)),
            (f2, "freescale, read_ahead = 0", lambda: ours(format2, batch, max_len, read_ahead=0)),
        ]
        runs: list[list[float]] = [[] for _ in measures]
        for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every variant alike
            for i, (_, _, measure) in enumerate(measures):
                runs[i].append(measure())
        rows = [{"layout": layout, "loader": name, "samples_per_s": float(np.median(r)), "runs": r}
                for (layout, name, _), r in zip(measures, runs)]
        starts = {(layout, name): (path, ahead, second) for layout, path in ((f1, format1), (f2, format2))
                  for name, ahead, second in (("freescale BalancedLoader", 8, False),
                                              ("freescale, its second epoch", 8, True),
                                              ("freescale, read_ahead = 0", 0, False))}
        for row in rows:
            key = starts.get((row["layout"], row["loader"]))
            row["first_batch_ms"] = float(np.median(FIRST_BATCH_MS[key])) if key else float("nan")
        by = {(row["layout"], row["loader"]): row["samples_per_s"] for row in rows}
        for row in rows:
            row["vs_bare_decode"] = row["samples_per_s"] / by[(row["layout"], "bare pyarrow decode")]
            row["vs_decode_and_cut"] = row["samples_per_s"] / by[(row["layout"], "decode + history cut")]
        disk = {"format 1 (per sample)": sum(f.stat().st_size for f in files(format1)),
                "format 2 (per user)": sum(f.stat().st_size for f in files(format2))}
        for row in rows:
            row["bytes_on_disk"] = disk[row["layout"]]
        print(f"{n:,} training samples, histories up to {max_len}")
        print_table(rows, ["layout", "loader", "samples_per_s", "vs_bare_decode", "vs_decode_and_cut", "first_batch_ms",
                           "bytes_on_disk"])
        order = order_start(2_000_000 if args.quick else 20_000_000, args.repeats)
        print(f"\nan epoch order of {order['rows']:,.0f} rows: its first step's rows made in {order['first_step_ms']:.2f} ms, "
              f"the whole order in {order['whole_ms']:.1f} ms; resumed halfway (its saved window's draws), that "
              f"step's rows in {order['resumed_halfway_ms']:.2f} ms")
        wait = training_wait(format2, Path(tmp) / "run", 40 if args.quick else 100)
        print(f"\n2-rank tiny HSTU training on format 2: step {wait['step_ms']:.1f} ms, waited for data "
              f"{wait['loader_wait_ms']:.3f} ms per step ({100 * wait['wait_share']:.2f}% of the step)")
    if args.json:
        write_json(args.json, "bench_loader", {"quick": args.quick, "samples": n, "batch": batch,
                                               "max_len": max_len, "lengths": args.lengths,
                                               "repeats": args.repeats},
                   rows + [{"training": wait}, {"epoch_order": order}])


if __name__ == "__main__":
    main()
