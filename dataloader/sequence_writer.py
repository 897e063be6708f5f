"""Sorted interactions in, format-2 Parquet out: one row per user, row groups of bounded size.

``SequenceWriter.add`` takes record batches ``(user_id, item_id, ts, label,
d0, ...)`` sorted by user (``prepare_sql.sequences_query``), in any batch
sizes; a user may span batches.  Complete users accumulate until a row group
holds ``row_group_interactions`` interactions, which is then written (one
``write_table`` call = one row group) and forgotten: memory stays at about one
row group plus one input batch, whatever the log's size.  Files roll over every
``file_interactions``.  All of it is numpy on whole arrays; no per-user Python.

The split is decided per user here (``SplitRule``): the test part starts at
``length - 1`` for leave-last-out, or at the count of interactions before the time
cut; validation (``valid_end`` is where the test part starts) is the interaction
before it (``last``), those after an earlier time cut (``time``), or none.
Training samples are positions ``[1, train_end)``, validation samples
``[max(1, train_end), valid_end)``, test samples ``[max(1, valid_end), length)``;
position 0 has no history and is never a target.  No held-out interaction is in
a training sample's history: a sample's history is the positions before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from freescale.dataloader.schema import sequence_schema


@dataclass(frozen=True)
class SplitRule:
    """The test part: ``leave-last-out`` or a global time cut (seconds: training is ``ts < cut``); the validation
    part before it: ``last`` (each user's interaction just before the test part, when it has one with a history),
    ``time`` (interactions at or after ``valid_cut``, before the test part) or ``none``."""

    kind: str
    cut: int | None = None
    valid: str = "last"
    valid_cut: int | None = None

    def bounds(self, lengths: np.ndarray, starts: np.ndarray, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each user's ``train_end`` and ``valid_end``."""
        test = lengths - 1 if self.kind == "leave-last-out" else self._before(self.cut, starts, ts)
        if self.valid == "none":
            return test, test
        if self.valid == "last":
            return np.where(test >= 2, test - 1, test), test
        return np.minimum(self._before(self.valid_cut, starts, ts), test), test

    @staticmethod
    def _before(cut: int | None, starts: np.ndarray, ts: np.ndarray) -> np.ndarray:
        before = (ts < cut).astype(np.int64)
        return np.add.reduceat(before, starts) if starts.size else np.zeros(0, dtype=np.int64)


@dataclass
class WriteResult:
    files: list[str] = field(default_factory=list)
    users: int = 0
    interactions: int = 0
    max_length: int = 0
    train_samples: int = 0
    valid_samples: int = 0
    eval_samples: int = 0
    bytes_written: int = 0
    row_groups: int = 0


class SequenceWriter:
    def __init__(
        self, fs: pafs.FileSystem, base: str, *, dense_dim: int, rule: SplitRule,
        row_group_interactions: int = 4_096, file_interactions: int = 16_777_216, file_prefix: str = "users",
    ) -> None:
        self.file_prefix = file_prefix
        """Files are ``{file_prefix}-{n:05d}.parquet`` (writers of one dataset in parallel: one prefix each)."""
        self.fs, self.base, self.dense_dim, self.rule = fs, base.rstrip("/"), dense_dim, rule
        self.row_group_interactions = row_group_interactions
        self.file_interactions = file_interactions
        self.schema = sequence_schema(dense_dim)
        self.result = WriteResult()
        self._pending: list[np.ndarray] | None = None  # columns of complete + the last (open) user
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0

    def add(self, batch: pa.RecordBatch) -> None:
        cols = [batch.column(i).to_numpy(zero_copy_only=False) for i in range(batch.num_columns)]
        if self._pending is not None:
            cols = [np.concatenate([p, c]) for p, c in zip(self._pending, cols)]
        self._pending = cols
        starts = np.flatnonzero(np.diff(cols[0])) + 1  # where each user begins: once per batch
        begin = 0
        while cols[0].size - begin >= self.row_group_interactions:
            cut = self._cut_point(starts, begin)
            if cut == begin:
                break  # one user larger than a row group, still open: wait for its end
            self._emit([c[begin:cut] for c in cols])
            begin = cut
        self._pending = [c[begin:] for c in cols]

    def close(self) -> WriteResult:
        if self._pending is not None and self._pending[0].size:
            self._emit(self._pending)
        self._pending = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for name in self.result.files:
            self.result.bytes_written += self.fs.get_file_info(f"{self.base}/{name}").size or 0
        return self.result

    def discard(self) -> None:
        """Close the open file after a failure (its rows are not a dataset: no manifest lists them)."""
        self._pending = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _cut_point(self, starts: np.ndarray, begin: int) -> int:
        """The last user boundary at most ``row_group_interactions`` after ``begin`` (or the first one
        after it, for a user longer than a row group); ``begin`` when no user is complete yet."""
        last = int(np.searchsorted(starts, begin + self.row_group_interactions, side="right"))
        first = int(np.searchsorted(starts, begin, side="right"))
        if last > first:
            return int(starts[last - 1])
        return int(starts[first]) if first < starts.size else begin

    def _emit(self, cols: list[np.ndarray]) -> None:
        user, item, ts, label = cols[:4]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(user)) + 1]).astype(np.int64)
        lengths = np.diff(np.append(starts, user.size)).astype(np.int64)
        train_end, valid_end = self.rule.bounds(lengths, starts, ts)
        offsets = pa.array(np.append(starts, user.size).astype(np.int32))
        arrays = [
            pa.array(user[starts]),
            pa.ListArray.from_arrays(offsets, pa.array(item, pa.int64())),
            pa.ListArray.from_arrays(offsets, pa.array(ts, pa.int64())),
            pa.ListArray.from_arrays(offsets, pa.array(label, pa.float32())),
        ]
        if self.dense_dim:
            dense = np.stack(cols[4:4 + self.dense_dim], axis=1).astype(np.float32).reshape(-1)
            per_row = pa.FixedSizeListArray.from_arrays(pa.array(dense), self.dense_dim)
            arrays.append(pa.ListArray.from_arrays(offsets, per_row))
        arrays += [pa.array(lengths.astype(np.int32)), pa.array(train_end.astype(np.int32)),
                   pa.array(valid_end.astype(np.int32))]
        self._write(pa.Table.from_arrays(arrays, schema=self.schema))
        r = self.result
        r.users += int(lengths.size)
        r.interactions += int(user.size)
        r.max_length = max(r.max_length, int(lengths.max(initial=0)))
        r.train_samples += int(np.maximum(train_end - 1, 0).sum())
        r.valid_samples += int((valid_end - np.maximum(train_end, 1)).clip(min=0).sum())
        r.eval_samples += int((lengths - np.maximum(valid_end, 1)).clip(min=0).sum())

    def _write(self, table: pa.Table) -> None:
        if self._writer is None or self._in_file >= self.file_interactions:
            if self._writer is not None:
                self._writer.close()
            name = f"{self.file_prefix}-{len(self.result.files):05d}.parquet"
            self.result.files.append(name)
            self._writer = pq.ParquetWriter(f"{self.base}/{name}", self.schema, filesystem=self.fs)
            self._in_file = 0
        self._writer.write_table(table, row_group_size=table.num_rows)
        self._in_file += int(table.column("length").to_numpy().sum())
        self.result.row_groups += 1
