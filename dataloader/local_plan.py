"""The read-local plan of one window (``data.locality``): compiled with numba, run without the GIL.

The LPT of ``balance_kernels`` spreads each rank's samples over the whole window, so at R
ranks a rank decodes about R times the bytes it trains on.  Here each rank's share is one
contiguous run of the window's samples in row-group order, cut at equal cost, and LPT (a
plain one: a rank holds a few hundred samples) splits the run into the window's steps.
Deterministic like ``balance_kernels``: the same inputs give the same plan on every rank.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_JIT: dict[str, Any] = {"nogil": True, "cache": True}


@numba.njit(**_JIT)
def _equal_cost_cuts(ordered_costs: np.ndarray, num_parts: int, max_count: int) -> np.ndarray:
    """Boundaries that cut a sequence into ``num_parts`` contiguous runs of nearly equal cost: each
    cut is the one whose running sum is nearest its share (off by at most half a sample), and no
    run longer than ``max_count`` (samples that cost nothing must not all fall to one run)."""
    n = ordered_costs.size
    total = 0.0
    for i in range(n):
        total += ordered_costs[i]
    bounds = np.empty(num_parts + 1, dtype=np.int64)
    bounds[0], bounds[num_parts] = 0, n
    acc, i = 0.0, 0
    for r in range(1, num_parts):
        target = total * r / num_parts
        limit = min(n, bounds[r - 1] + max_count)
        while i < limit and acc + ordered_costs[i] <= target:
            acc += ordered_costs[i]
            i += 1
        if i < limit and acc + ordered_costs[i] - target < target - acc:
            acc += ordered_costs[i]
            i += 1
        bounds[r] = i
    return bounds


@numba.njit(**_JIT)
def local_window_owner(rows: np.ndarray, costs: np.ndarray, row_group_starts: np.ndarray, num_ranks: int,
                       num_steps: int) -> np.ndarray:
    """Read-local plan of one window: the part (``step * num_ranks + rank``) of each sample.

    Each rank's share of the window is one contiguous run of the samples in row-group order (a
    counting sort by the row group each row lies in, ``row_group_starts``; the window's own order
    kept within a row group), cut at equal cost, so it lies in one or two row groups; then LPT
    splits the run into ``num_steps`` steps of equal cost, and the rank's steps are ordered by their
    heaviest sample (every rank's heaviest samples land in the same early steps)."""
    n = rows.size
    groups = row_group_starts.size - 1
    first = np.zeros(groups + 1, dtype=np.int64)
    group_of = np.searchsorted(row_group_starts, rows, side="right") - 1
    for i in range(n):
        first[group_of[i] + 1] += 1
    for g in range(groups):
        first[g + 1] += first[g]
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        order[first[group_of[i]]] = i
        first[group_of[i]] += 1
    ordered = np.empty(n, dtype=np.float64)
    for i in range(n):
        ordered[i] = costs[order[i]]
    bounds = _equal_cost_cuts(ordered, num_ranks, 8 * (n // num_ranks + 1))
    part_of = np.empty(n, dtype=np.int64)
    loads = np.empty(num_steps, dtype=np.float64)
    counts = np.empty(num_steps, dtype=np.int64)
    heaviest = np.empty(num_steps, dtype=np.float64)
    slot = np.empty(num_steps, dtype=np.int64)
    for r in range(num_ranks):
        a, b = bounds[r], bounds[r + 1]
        by_cost = np.argsort(-ordered[a:b], kind="mergesort")
        step_of = np.empty(b - a, dtype=np.int64)
        loads[:] = 0.0
        counts[:] = 0
        heaviest[:] = -1.0
        for k in range(b - a):
            j = 0  # the lightest step; of equally light ones, the one with fewest samples
            for s in range(1, num_steps):
                if loads[s] < loads[j] or (loads[s] == loads[j] and counts[s] < counts[j]):
                    j = s
            c = ordered[a + by_cost[k]]
            step_of[by_cost[k]] = j
            counts[j] += 1
            loads[j] += c
            if c > heaviest[j]:
                heaviest[j] = c
        ranked = np.argsort(-heaviest, kind="mergesort")
        for s in range(num_steps):
            slot[ranked[s]] = s
        for k in range(b - a):
            part_of[order[a + k]] = slot[step_of[k]] * num_ranks + r
    return part_of
