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


@numba.njit(nogil=True, cache=True)
def copy_tails_steps(src: np.ndarray, ends: np.ndarray, lengths: np.ndarray, out: np.ndarray, bounds: np.ndarray,
                     starts: np.ndarray) -> None:
    """``copy_tails`` of several steps' samples in one call: step ``j``'s (``bounds[j]`` to ``bounds[j + 1]``) back
    to back into ``out`` from ``starts[j]`` (a read's KJT values: each step's features lie one after the other)."""
    for j in range(bounds.size - 1):
        pos = starts[j]
        for i in range(bounds[j], bounds[j + 1]):
            n, end = lengths[i], ends[i]
            out[pos:pos + n] = src[end - n:end]
            pos += n


@numba.njit(nogil=True, cache=True)
def copy_runs(src: np.ndarray, src_at: np.ndarray, out: np.ndarray, starts: np.ndarray) -> None:
    """``src[src_at[j]:src_at[j + 1]]`` into ``out`` from ``starts[j]``, for each ``j``."""
    for j in range(starts.size):
        n = src_at[j + 1] - src_at[j]
        out[starts[j]:starts[j] + n] = src[src_at[j]:src_at[j + 1]]


@numba.njit(nogil=True, cache=True)
def interleave_steps(by_feature: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Rows of ``by_feature`` (one a feature, a value a sample) laid out step by step, then feature by feature (step
    ``j``: samples ``bounds[j]`` to ``bounds[j + 1]``): a read's KJT lengths."""
    features = by_feature.shape[0]
    out = np.empty(by_feature.size, dtype=np.int64)
    pos = 0
    for j in range(bounds.size - 1):
        for f in range(features):
            for i in range(bounds[j], bounds[j + 1]):
                out[pos] = by_feature[f, i]
                pos += 1
    return out


STEP_COPY_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))
"""The source dtypes ``copy_tails_steps`` and ``copy_runs`` are compiled for (``warm_up``): ids."""


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
    for list_dtype in (np.int64, np.int32, np.float32, np.float64):
        gather_tails([(np.zeros(2, dtype=list_dtype), index, index)])
    bounds, out = np.array([0, 1], dtype=np.int64), np.zeros(2, dtype=np.int64)
    for id_dtype in STEP_COPY_DTYPES:
        for src in (np.zeros(2, dtype=id_dtype), _read_only(np.zeros(2, dtype=id_dtype))):  # (Arrow's buffers: read-only)
            copy_tails(src, index, index, out, 0)
            copy_tails_steps(src, index, index, out, bounds, bounds[:1])
            copy_runs(src, bounds, out, bounds[:1])
    interleave_steps(np.zeros((2, 1), dtype=np.int64), bounds)


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


__all__ = ["STEP_COPY_DTYPES", "copy_runs", "copy_tails", "copy_tails_steps", "gather_tails", "interleave_steps", "warm_up"]
