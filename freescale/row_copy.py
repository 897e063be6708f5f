"""The copy-on-write keep of ``staging.LazySnapshot`` on CPU tables, one pass per tensor (numba, no GIL).

At each lookup while a save's tables are copied, the rows about to be read (then updated) whose save-step
values are not on the host yet are copied there first.  In torch that is five passes over the rows (range
mask, saved mask, filter, ``index_select``, ``index_copy_``); the step after a save keeps every row it reads, on
the training's critical path.  Here one pass
marks and collects the new rows (``fresh_rows``: a row read twice is kept once) and one pass per tensor
copies them as whole words (``copy_rows``: any dtype).  The kernels are compiled when the job starts
(``warm_up``), not at the first save.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

_JIT: dict[str, Any] = {"nogil": True, "cache": True}


@numba.njit(**_JIT)
def _fresh(rows: np.ndarray, first: int, cursor: int, limit: int, saved: np.ndarray) -> np.ndarray:
    out = np.empty(rows.size, np.int64)
    n = 0
    for flat in rows:
        r = flat - first
        if cursor <= r < limit and not saved[r]:
            saved[r] = True
            out[n] = r
            n += 1
    return out[:n]


@numba.njit(**_JIT)
def _copy(rows: np.ndarray, source: np.ndarray, target: np.ndarray) -> None:
    width = source.shape[1]
    for r in rows:
        for j in range(width):
            target[r, j] = source[r, j]


def fresh_rows(flat_rows: torch.Tensor, first: int, cursor: int, limit: int, saved: torch.Tensor) -> np.ndarray:
    """The rows of a table (``flat_rows - first`` within ``cursor .. limit``) not ``saved`` yet, each once;
    marks them saved.  CPU tensors: ``flat_rows`` int64, ``saved`` bool."""
    return _fresh(flat_rows.numpy(), first, cursor, limit, saved.numpy())


def copy_rows(rows: np.ndarray, source: torch.Tensor, target: torch.Tensor) -> None:
    """``target[rows] = source[rows]`` for two contiguous CPU tensors of one shape and dtype."""
    _copy(rows, _as_words(source), _as_words(target))


def _as_words(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor as rows of its widest whole words (numpy has no bfloat16)."""
    rows = tensor.detach().reshape(tensor.shape[0], -1).view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if rows.shape[1] % word.itemsize == 0:
            return rows.view(word).numpy()
    return rows.numpy()


def usable(flat_rows: torch.Tensor, saved: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """The kernels apply (as compiled by ``warm_up``): int64 rows, a bool mask, every tensor on the CPU,
    contiguous, with rows."""
    return (flat_rows.dtype == torch.int64 and saved.dtype == torch.bool
            and all(t.device.type == "cpu" and t.is_contiguous() and t.dim() >= 1
                    for t in (flat_rows, saved, *tensors)))


def warm_up(tensors: list[torch.Tensor]) -> None:
    """Compile (or load from numba's cache) the kernels ``tensors`` need now: the row pass, and the copy for each
    word width among them (a compile takes about a second; at a lookup it would stall that step)."""
    saved = torch.zeros(4, dtype=torch.bool)
    rows = fresh_rows(torch.tensor([1, 2, 2], dtype=torch.int64), 0, 0, 4, saved)
    widths = {_as_words(t[:1]).dtype for t in tensors if t.device.type == "cpu" and t.dim() >= 1 and len(t)}
    for width in sorted(widths, key=str):
        words = torch.from_numpy(np.ones((4, 1), dtype=width))
        copy_rows(rows, words, torch.zeros_like(words))
