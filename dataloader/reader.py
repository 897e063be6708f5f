"""A small Parquet reader that turns sequence samples into ``Batch`` es.

This is the foundation's reader: it loads a split into memory as one Arrow
table, validates it once (schema, nulls, id ranges, labels), and then slices
global batches by sample count.  The balanced, streaming loader replaces it
behind the same ``Batch`` output and ``state_dict`` contract.

Batching: step ``s`` of epoch ``e`` takes rows ``perm_e[s*G : (s+1)*G]`` where
``G = batch_size * world_size`` and ``perm_e`` is a seeded permutation (or the
identity without shuffle); rank ``r`` takes the ``r``-th contiguous block of
``batch_size`` rows.  Every rank computes the same permutation, so no sample is
exchanged, and each sample of an epoch lands on exactly one rank.  The partial
last global batch of an epoch is dropped so every rank runs the same number of
steps (collectives must match).

Conversion is vectorized: Arrow list offsets and values become KJT lengths and
values through numpy without a per-sample Python loop; histories longer than
``max_seq_len`` keep their most recent items.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from freescale.config import require
from freescale.dataloader.batch import Batch
from freescale.dataloader.schema import (
    CANDIDATE_ITEM,
    DENSE,
    HISTORY_ITEMS,
    LABEL,
    USER_ID,
    DataError,
    DatasetManifest,
    check_schema,
)

# Sparse feature name -> (column, vocabulary key in the manifest, is a list column).
SPARSE_FEATURES: dict[str, tuple[str, str, bool]] = {
    HISTORY_ITEMS: (HISTORY_ITEMS, "num_items", True),
    CANDIDATE_ITEM: (CANDIDATE_ITEM, "num_items", False),
    USER_ID: (USER_ID, "num_users", False),
}


@dataclass
class DataConfig:
    path: str = "data/demo"
    batch_size: int = 64
    """Samples per rank per step."""
    max_seq_len: int = 64
    """History items kept per sample (the most recent); longer histories are truncated."""
    shuffle: bool = True

    def validate(self) -> None:
        require(bool(self.path), "path", "must name a dataset directory")
        require(self.batch_size > 0, "batch_size", f"must be positive, got {self.batch_size}")
        require(self.max_seq_len > 0, "max_seq_len", f"must be positive, got {self.max_seq_len}")


def _read_file(path: Path, columns: list[str], dense_dim: int) -> pa.Table:
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    check_schema(schema, dense_dim, str(path))
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: corrupt or truncated Parquet data ({exc})") from None


def _check_ids(values: pa.Array, limit: int, where: str, vocab_key: str) -> None:
    if len(values) == 0:
        return
    lo_hi = pc.min_max(values)
    lo, hi = lo_hi["min"].as_py(), lo_hi["max"].as_py()
    if lo is not None and lo < 0:
        raise DataError(f"{where}: negative id {lo}")
    if hi is not None and hi >= limit:
        raise DataError(f"{where}: id {hi} is >= the table size {vocab_key}={limit} from dataset.json")


def validate_table(table: pa.Table, manifest: DatasetManifest, where: str) -> None:
    """Reject nulls, out-of-range ids, mismatched list lengths and bad labels, naming file and column."""
    for name in table.column_names:
        column = table.column(name)
        if column.null_count:
            raise DataError(f"{where}: column '{name}' has {column.null_count} null value(s)")
    for feature, (column, vocab_key, is_list) in SPARSE_FEATURES.items():
        if column not in table.column_names:
            continue
        values = table.column(column).combine_chunks()
        if is_list:
            values = values.flatten()
        _check_ids(values, getattr(manifest, vocab_key), f"{where}: column '{column}'", vocab_key)
    if LABEL in table.column_names:
        labels = table.column(LABEL).to_numpy()
        bad = ~np.isin(labels, (0.0, 1.0))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise DataError(f"{where}: column '{LABEL}' row {row} is {float(labels[row])}; labels must be 0 or 1")


class ParquetSequenceReader:
    """Global-batch slicing over one split held in memory (see module docstring)."""

    def __init__(
        self,
        path: str | Path,
        split: str,
        *,
        batch_size: int,
        max_seq_len: int,
        sparse_features: list[str],
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        unknown = [f for f in sparse_features if f not in SPARSE_FEATURES]
        if unknown:
            raise DataError(f"unknown sparse feature(s) {unknown}; known: {sorted(SPARSE_FEATURES)}")
        self.path = Path(path)
        self.manifest = DatasetManifest.read(self.path)
        self.split = split
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.sparse_features = list(sparse_features)
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        columns = sorted({SPARSE_FEATURES[f][0] for f in sparse_features} | {DENSE, LABEL})
        tables = []
        for file in self.manifest.files(self.path, split):
            table = _read_file(file, columns, self.manifest.dense_dim)
            validate_table(table, self.manifest, str(file))
            tables.append(table)
        self.table = pa.concat_tables(tables).combine_chunks() if tables else None
        self.num_rows = 0 if self.table is None else self.table.num_rows
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = self.num_rows // self.global_batch
        if self.steps_per_epoch == 0:
            raise DataError(
                f"{self.path}: split '{split}' has {self.num_rows} rows, fewer than one global batch "
                f"({batch_size} per rank x {world_size} ranks = {self.global_batch})"
            )
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm_epoch = -1
        self._perm = np.arange(self.num_rows)

    # ----- position ---------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("global_batch", self.global_batch) != self.global_batch:
            raise DataError(
                f"{self.path}: checkpoint was taken with global batch {state['global_batch']}, "
                f"this run uses {self.global_batch}; resuming would skip or repeat samples"
            )
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])

    # ----- batches ----------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            else:
                self._perm = np.arange(self.num_rows)
            self._perm_epoch = epoch
        return self._perm

    def rows_for(self, epoch: int, step: int) -> np.ndarray:
        """Row indices this rank reads for ``(epoch, step)``."""
        start = step * self.global_batch + self.rank * self.batch_size
        return self._permutation(epoch)[start : start + self.batch_size]

    def batch_at(self, epoch: int, step: int) -> Batch:
        assert self.table is not None
        return self._to_batch(self.table.take(pa.array(self.rows_for(epoch, step))))

    def next_batch(self) -> Batch:
        """The batch at the current position; the position then moves one step on."""
        batch = self.batch_at(self.epoch, self.step_in_epoch)
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        return batch

    def one_epoch(self) -> Iterator[Batch]:
        """Each of epoch 0's steps once, without moving the position (for evaluation)."""
        for step in range(self.steps_per_epoch):
            yield self.batch_at(0, step)

    def _to_batch(self, rows: pa.Table) -> Batch:
        lengths: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for feature in self.sparse_features:
            column, _, is_list = SPARSE_FEATURES[feature]
            array = rows.column(column).combine_chunks()
            if is_list:
                flat, lens = _truncate_recent(
                    array.flatten().to_numpy(), pc.list_value_length(array).to_numpy().astype(np.int64),
                    self.max_seq_len,
                )
            else:
                flat, lens = array.to_numpy(), np.ones(len(array), dtype=np.int64)
            values.append(flat.astype(np.int64, copy=False))
            lengths.append(lens)
        sparse = KeyedJaggedTensor(
            keys=self.sparse_features,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )
        dense_flat = rows.column(DENSE).combine_chunks().flatten().to_numpy()
        dense = torch.from_numpy(dense_flat.reshape(rows.num_rows, self.manifest.dense_dim).copy())
        labels = torch.from_numpy(rows.column(LABEL).to_numpy().copy())
        return Batch(sparse=sparse, dense=dense, labels=labels)


def _truncate_recent(values: np.ndarray, lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the last ``max_len`` values of each jagged row (vectorized)."""
    if lengths.size == 0 or lengths.max(initial=0) <= max_len:
        return values, lengths
    kept = np.minimum(lengths, max_len)
    src_start = np.cumsum(lengths) - kept  # first kept value of each row, in ``values``
    dst_offsets = np.concatenate([[0], np.cumsum(kept)])
    within = np.arange(dst_offsets[-1]) - np.repeat(dst_offsets[:-1], kept)
    return values[np.repeat(src_start, kept) + within], kept
