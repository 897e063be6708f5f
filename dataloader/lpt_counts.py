"""How many samples each part of LPT's partition takes (``balance_kernels.lpt_refined``), compiled with numba.

LPT balances cost, not count: left alone it gives samples that cost (almost) nothing to whichever part is lightest,
and fills the parts that long histories left light with many short ones.  A rank's batch is bounded here where
that costs no balance:

- ``negligible_last`` and ``fill_by_count``: samples lighter than LPT's bucket width cannot change which part is
  lightest, so they are set apart and dealt out by count, each to a part holding the fewest samples;
- ``count_cap``: the most samples a part may take of the tail, 2x the mean count unless the costs ask for more.

Deterministic as ``balance_kernels`` is: fixed-order arithmetic, stable sorts.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_JIT: dict[str, Any] = {"nogil": True, "cache": True}


@numba.njit(**_JIT)
def negligible_last(order: np.ndarray, ordered: np.ndarray, start: int, below: float) -> int:
    """Move the positions ``start:`` of ``order``/``ordered`` whose cost is under ``below`` to the end, each group
    in its order (stable); returns where they begin."""
    n, first = ordered.size, start
    while first < n and not ordered[first] < below:
        first += 1
    if first == n:  # none (the common case: one pass, nothing copied)
        return n
    # Everything before ``first`` stays where it is; from there on, the kept ones move up, the light ones after.
    kept_order, kept = np.empty(n - first, dtype=np.int64), np.empty(n - first, dtype=np.float64)
    light_order, light = np.empty(n - first, dtype=np.int64), np.empty(n - first, dtype=np.float64)
    nk = nl = 0
    for i in range(first, n):
        if ordered[i] < below:
            light_order[nl], light[nl] = order[i], ordered[i]
            nl += 1
        else:
            kept_order[nk], kept[nk] = order[i], ordered[i]
            nk += 1
    order[first:first + nk], ordered[first:first + nk] = kept_order[:nk], kept[:nk]
    order[first + nk:], ordered[first + nk:] = light_order[:nl], light[:nl]
    return first + nk


@numba.njit(**_JIT)
def fill_by_count(ordered: np.ndarray, part_of: np.ndarray, start: int, loads: np.ndarray, counts: np.ndarray,
                   speeds: np.ndarray) -> None:
    """Deal positions ``start:`` out by count: each to a part holding the fewest samples (the parts ordered by
    count, stably; equal counts take turns), updating ``counts`` and ``loads``."""
    k, n = counts.size, part_of.size
    if start >= n:
        return
    by_count = np.argsort(counts, kind="mergesort")
    level, active, i = counts[by_count[0]], 0, start
    while i < n:
        while active < k and counts[by_count[active]] == level:
            active += 1
        for a in range(active):
            if i == n:
                break
            p = by_count[a]
            part_of[i] = p
            counts[p] += 1
            loads[p] += ordered[i] / speeds[p]
            i += 1
        level += 1


@numba.njit(**_JIT)
def count_cap(ordered: np.ndarray, start: int, stop: int, loads: np.ndarray, counts: np.ndarray,
               speeds: np.ndarray, floor: int, ceiling: int) -> int:
    """The most samples a part may take, between ``floor`` and ``ceiling``: what LPT will want for the positions
    ``start:stop`` still to place, with room to spare.  LPT raises the lightest parts together, like water
    (the level where the parts' room below it holds the samples' cost); the lightest part's count at that level,
    at the samples' mean cost, with a quarter more.  Where the heavy samples already set the heaviest part above
    that level (a long history on one rank), the light ones are spread and no part needs many."""
    k, remaining = loads.size, stop - start
    if remaining <= 0:
        return floor
    total = 0.0
    for i in range(start, stop):
        total += ordered[i]
    if total <= 0.0:
        return floor
    by_load = np.argsort(loads, kind="mergesort")
    level, held, weight = loads[by_load[0]], 0.0, 0.0
    for j in range(k):  # the level rises past part by_load[j] once the parts below it hold less than ``total``
        p = by_load[j]
        held += loads[p] * speeds[p]
        weight += speeds[p]
        level = (total + held) / weight
        if j + 1 == k or level <= loads[by_load[j + 1]]:
            break
    needed = 0.0
    for p in range(k):
        if level > loads[p]:
            needed = max(needed, counts[p] + (level - loads[p]) * speeds[p] * remaining / total)
    return min(ceiling, max(floor, int(1.25 * needed) + 1))
