"""Histories out of cached row groups: each sample's most recent ``max_seq_len`` values, one copy.

Both layouts end a read the same way: per row group a sample draws from, the
flat buffer of a list column, where each sample's history *ends* in it, and how
many values it keeps (format 1: the end of its own list, its length clipped to
``max_seq_len``; format 2: its position in its user's sequence, the position
clipped).  ``gather_tails`` writes those runs back to back into one output,
sized once: a compiled loop of slice copies (``nogil``, so it overlaps the
training thread), instead of numpy's index arithmetic (repeat + arange + fancy
index: three temporaries the size of the output, then a concatenate and a
second pass to truncate).  That index arithmetic was most of the loader's time
after Parquet decoding (``benchmarks/bench_loader.py``).

``Tails`` is such a column not yet copied (format 2's reads for the loader): the batch builder copies each
step's samples straight to where they go in the step's KJT values (``Tails.place``), so the histories, by far
the largest thing a read moves, are copied once, not cut into one buffer and then concatenated into another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def _copy_tails(src: np.ndarray, ends: np.ndarray, lengths: np.ndarray, out: np.ndarray, start: int) -> int:
    """``src[ends[i] - lengths[i] : ends[i]]`` for each i, back to back into ``out`` from ``start``;
    returns where the next run goes."""
    pos = start
    for i in range(ends.size):
        n, end = lengths[i], ends[i]
        out[pos:pos + n] = src[end - n:end]
        pos += n
    return pos


@numba.njit(nogil=True, cache=True)
def _place_runs(src: np.ndarray, ends: np.ndarray, lengths: np.ndarray, cuts: np.ndarray, starts: np.ndarray,
                out: np.ndarray) -> None:
    """For each j, samples ``cuts[j] .. cuts[j + 1] - 1``'s tails back to back into ``out`` from ``starts[j]``."""
    for j in range(cuts.size - 1):
        pos = starts[j]
        for i in range(cuts[j], cuts[j + 1]):
            n, end = lengths[i], ends[i]
            out[pos:pos + n] = src[end - n:end]
            pos += n


def gather_tails(runs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """One flat array of every run of ``runs``: ``(src, ends, lengths)`` per row group (int64 ``ends``
    and ``lengths``, ``lengths[i] <= ends[i]``; ``src`` of one dtype across the row groups)."""
    total = sum(int(lengths.sum()) for _, _, lengths in runs)
    out = np.empty(total, dtype=runs[0][0].dtype if runs else np.int64)
    pos = 0
    for src, ends, lengths in runs:
        pos = _copy_tails(src, ends, lengths, out, pos)
    return out


@dataclass(frozen=True)
class Tails:
    """A list column of a read, not yet copied: sample ``i`` holds ``src[ends[i] - lengths[i] : ends[i]]``
    (int64 ``ends`` and ``lengths``, ``lengths`` also the column's ``name@``).  ``src`` may be a buffer the source
    reuses (format 2's slots): copy out while the read's lock is held (``RowGroupFiles.reading``)."""

    src: np.ndarray
    ends: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of_flat(cls, values: np.ndarray, lengths: np.ndarray) -> Tails:
        """A column already cut: ``values`` each sample's back to back, ``lengths`` per sample."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return cls(np.ascontiguousarray(values), np.cumsum(lengths), lengths)

    def values(self) -> np.ndarray:
        """Every sample's values back to back (one copy)."""
        return gather_tails([(self.src, self.ends, self.lengths)])

    def place(self, out: np.ndarray, cuts: np.ndarray, starts: np.ndarray) -> None:
        """Samples ``cuts[j] .. cuts[j + 1] - 1`` back to back into ``out`` from ``starts[j]``, for every j (int64
        ``cuts`` and ``starts``; ``out`` of the dtype the values are converted to)."""
        _place_runs(self.src, self.ends, self.lengths, cuts, starts, out)


Columns = Mapping[str, "np.ndarray | Tails"]
"""A read's columns (``read_arrays``, ``read_runs``): numpy arrays, a list column's lengths as ``name@``, and (format
2's loader reads) list columns as ``Tails``."""


def as_array(column: np.ndarray | Tails) -> np.ndarray:
    """A column's values as one array (a ``Tails`` copied out)."""
    return column.values() if isinstance(column, Tails) else column


def materialized(columns: Columns) -> dict[str, np.ndarray]:
    """``columns`` with every ``Tails`` copied out."""
    return {name: as_array(column) for name, column in columns.items()}


def warm_up() -> None:
    """Compile (or load from numba's cache) the copies of the dtypes lists hold, before any prefetch thread."""
    index = np.array([2], dtype=np.int64)
    cuts, starts = np.array([0, 1], dtype=np.int64), np.zeros(1, dtype=np.int64)
    for dtype in (np.int64, np.int32, np.float32, np.float64):
        tails = Tails(np.zeros(2, dtype=dtype), index, index)
        gather_tails([(tails.src, index, index)])
        if np.issubdtype(dtype, np.integer):  # (into a KJT's int64 values)
            tails.place(np.zeros(2, dtype=np.int64), cuts, starts)


__all__ = ["Columns", "Tails", "as_array", "gather_tails", "materialized", "warm_up"]
