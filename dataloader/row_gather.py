"""Format 1's reads: a read's rows gathered from its cached row groups, one call per column per row group.

A read of several steps (their rows back to back, each step's ascending) draws on a few row groups, each step on
most of them (a step's rows come from its shuffle window's row groups).  Gathered step by step, row group by row
group, that was a few numpy calls per column for every (step, row group) piece, ~100 pieces a read of 16 steps.
Here the read's rows are ordered by row group once (a stable sort), each column gathered with one call per row
group into that order and put back in the read's order with one more: a few calls per column for the whole read.
The row groups are asked for (decoded, or taken from the read-ahead) in the order the read first needs them, as
step by step.  A history column may be left in its row groups' buffers (``uncut``): one buffer per piece of
consecutive rows of one row group, for the batches to copy once (``assemble.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Protocol

import numpy as np

from freescale.dataloader.gather import gather_tails


class RowGroupBuffers(Protocol):
    """A decoded row group as the source keeps it (``source._RowGroup``)."""

    arrays: dict[str, np.ndarray]
    """Each column's flat buffer (a list column ``name``: its values, and ``name@`` its offsets)."""
    bad: np.ndarray | None
    """The rows to drop (``skip`` mode), or None."""


def gather_rows(rows: np.ndarray, rg_start: np.ndarray, row_group: Callable[[int], RowGroupBuffers],
                columns: Sequence[str], cap: int, uncut: str = "") -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Columns ``columns`` of ``rows`` (global ids, in the read's order) from their row groups (``row_group(rg)``;
    ``rg_start``: each row group's first row): a list column ``name``'s values cut to the ``cap`` most recent
    (``name@``: the lengths), or, for the list column named ``uncut``, left in place (``name@src``, an object
    array of one buffer per piece of rows, ``name@from`` each piece's first row among the rows kept, ``name@end``
    where each row's values end in its piece's buffer).  Returns the columns of the rows kept and which were (None:
    all; ``skip`` mode drops a row group's bad rows).  Each row group is asked for once a read, at its first use
    (a source's LRU then ranks it by that use, not its last in the read)."""
    if not rows.size:
        return {}, None
    groups = np.searchsorted(rg_start, rows, side="right") - 1
    distinct, first = np.unique(groups, return_index=True)
    entries = {int(rg): row_group(int(rg)) for rg in distinct[np.argsort(first)]}  # (asked in the order needed)
    ok = _kept(rows, groups, rg_start, entries)
    if ok is not None:
        rows, groups = rows[ok], groups[ok]
        if not rows.size:
            return {}, ok
    return _gathered(rows, groups, rg_start, entries, columns, cap, uncut), ok


def _gathered(rows: np.ndarray, groups: np.ndarray, rg_start: np.ndarray, entries: dict[int, RowGroupBuffers],
              columns: Sequence[str], cap: int, uncut: str) -> dict[str, np.ndarray]:
    """``gather_rows``' columns of ``rows`` (every one kept), each in row group ``groups`` (``entries``)."""
    order = np.argsort(groups, kind="stable")
    grouped = groups[order]
    bounds = np.concatenate([[0], np.flatnonzero(grouped[1:] != grouped[:-1]) + 1, [rows.size]]).tolist()
    local = rows[order] - rg_start[grouped]
    spans = [(entries[int(grouped[a])], a, b) for a, b in pairwise(bounds)]
    back = np.empty(rows.size, dtype=np.int64)
    back[order] = np.arange(rows.size)  # (grouped order -> the read's: take ``back``)
    pieces = np.concatenate([[0], np.flatnonzero(groups[1:] != groups[:-1]) + 1]).tolist()
    out: dict[str, np.ndarray] = {}
    first_arrays = spans[0][0].arrays
    for name in columns:
        if name + "@" not in first_arrays:
            like = first_arrays[name]
            column = np.empty((rows.size, *like.shape[1:]), dtype=like.dtype)
            for entry, a, b in spans:
                column[a:b] = entry.arrays[name][local[a:b]]
            out[name] = column[back]
            continue
        ends, starts = np.empty(rows.size, dtype=np.int64), np.empty(rows.size, dtype=np.int64)
        for entry, a, b in spans:
            offsets = entry.arrays[name + "@"]
            starts[a:b], ends[a:b] = offsets[local[a:b]], offsets[local[a:b] + 1]
        ends, starts = ends[back], starts[back]
        lengths = np.minimum(ends - starts, cap)
        out[name + "@"] = lengths
        sources = [entries[int(groups[at])].arrays[name] for at in pieces]
        if name == uncut:
            out[name + "@src"] = np.empty(len(sources), dtype=object)
            for k, source in enumerate(sources):
                out[name + "@src"][k] = source  # (one by one: numpy may try to broadcast equal-length arrays)
            out[name + "@from"], out[name + "@end"] = np.array(pieces, dtype=np.int64), ends
        else:
            cuts = [*pieces, rows.size]
            out[name] = gather_tails([(source, ends[cuts[k]:cuts[k + 1]], lengths[cuts[k]:cuts[k + 1]])
                                      for k, source in enumerate(sources)])
    return out


def _kept(rows: np.ndarray, groups: np.ndarray, rg_start: np.ndarray,
          entries: dict[int, RowGroupBuffers]) -> np.ndarray | None:
    """Which of ``rows`` are kept (their row groups' bad rows dropped), or None when all are."""
    if all(entry.bad is None for entry in entries.values()):
        return None
    ok = np.ones(rows.size, dtype=bool)
    for rg, entry in entries.items():
        if entry.bad is not None:
            mine = np.flatnonzero(groups == rg)
            ok[mine] = ~entry.bad[rows[mine] - rg_start[rg]]
    return None if ok.all() else ok


__all__ = ["RowGroupBuffers", "gather_rows"]
