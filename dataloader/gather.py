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
after Parquet decoding (``benchmarks/bench_loader.py``).  The loader's batches go one
step further: ``copy_tails`` writes each step's histories straight into the step's
KJT values (``assemble.py``), from the source's buffers, with no gathered copy between.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def copy_tails(src: np.ndarray, ends: np.ndarray, lengths: np.ndarray, out: np.ndarray, start: int) -> int:
    """``src[ends[i] - lengths[i] : ends[i]]`` for each i, back to back into ``out`` from ``start``;
    returns where the next run goes."""
    pos = start
    for i in range(ends.size):
        n, end = lengths[i], ends[i]
        out[pos:pos + n] = src[end - n:end]
        pos += n
    return pos


def gather_tails(runs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """One flat array of every run of ``runs``: ``(src, ends, lengths)`` per row group (int64 ``ends``
    and ``lengths``, ``lengths[i] <= ends[i]``; ``src`` of one dtype across the row groups)."""
    total = sum(int(lengths.sum()) for _, _, lengths in runs)
    out = np.empty(total, dtype=runs[0][0].dtype if runs else np.int64)
    pos = 0
    for src, ends, lengths in runs:
        pos = copy_tails(src, ends, lengths, out, pos)
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the copies of the dtypes lists hold, before any prefetch thread."""
    index = np.array([2], dtype=np.int64)
    for dtype in (np.int64, np.int32, np.float32, np.float64):
        gather_tails([(np.zeros(2, dtype=dtype), index, index)])


__all__ = ["copy_tails", "gather_tails", "warm_up"]
