"""How many samples each part of LPT's partition takes (``balance_kernels.lpt_refined``), compiled with numba.

LPT balances cost, not count: left alone it gives samples that cost (almost) nothing to whichever part is lightest,
and fills the parts that long histories left light with many short ones.  A rank's batch is bounded here where
that costs no balance:

- ``negligible_last`` and ``fill_by_count``: samples lighter than LPT's bucket width cannot change which part is
  lightest, so they are set apart and dealt out by count, each to a part holding the fewest samples;
- ``count_cap``: the most samples a part may take of the tail, 2x the mean count unless the costs ask for more;
- ``trim_counts``: once everything is placed, the parts still past 2x the mean count are brought down to it
  wherever that leaves the heaviest part as it is.

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


@numba.njit(**_JIT)
def _sift_down(keys: np.ndarray, parts: np.ndarray, size: int, at: int) -> None:
    while True:
        low, left, right = at, 2 * at + 1, 2 * at + 2
        if left < size and (keys[left] < keys[low] or (keys[left] == keys[low] and parts[left] < parts[low])):
            low = left
        if right < size and (keys[right] < keys[low] or (keys[right] == keys[low] and parts[right] < parts[low])):
            low = right
        if low == at:
            return
        keys[at], keys[low] = keys[low], keys[at]
        parts[at], parts[low] = parts[low], parts[at]
        at = low


@numba.njit(**_JIT)
def trim_counts(ordered: np.ndarray, part_of: np.ndarray, speeds: np.ndarray, cap: int) -> int:
    """Bring every part down to ``cap`` samples where that costs no balance; returns how many samples moved.

    LPT's count cap (``count_cap``) lets a part take what the costs seem to ask for, judged before the tail is
    placed; the finished partition often needs far less (the parts a long history left light end up no heavier
    than the heaviest part, which is set by the long histories).  Each sample past ``cap`` on a part, its
    lightest first, moves to the lightest part still under ``cap`` if it lands there without that part's time
    passing the heaviest part's: the heaviest part never grows, so the plan's balance is unchanged, and the
    trim stops at the first sample that cannot move so (``ordered`` is sorted to within 2**-16 of the largest
    cost: "lightest first" to that grain).  ``ordered`` lists the costs lightest last (as
    ``lpt_refined`` leaves them), ``part_of`` each one's part (updated)."""
    n, k = part_of.size, speeds.size
    counts = np.zeros(k, dtype=np.int64)
    for i in range(n):
        counts[part_of[i]] += 1
    over = 0
    for p in range(k):
        over += max(0, counts[p] - cap)
    if over == 0:
        return 0
    loads = np.zeros(k, dtype=np.float64)
    for i in range(n):
        loads[part_of[i]] += ordered[i] / speeds[part_of[i]]
    limit = loads.max()
    keys, parts, size = np.empty(k, dtype=np.float64), np.empty(k, dtype=np.int64), 0
    for p in range(k):  # the parts that may take more, lightest on top
        if counts[p] < cap:
            keys[size], parts[size] = loads[p], p
            size += 1
    for at in range(size // 2 - 1, -1, -1):
        _sift_down(keys, parts, size, at)
    moved = 0
    for i in range(n - 1, -1, -1):
        if over == 0 or size == 0:
            break
        p = part_of[i]
        if counts[p] <= cap:
            continue
        q = parts[0]
        time_there = ordered[i] / speeds[q]
        if loads[q] + time_there > limit:
            break  # the lightest part would pass the heaviest: the samples left are heavier (with unequal speeds
            # a faster part further down might still take one: left as it is, the trim only does less)
        part_of[i] = q
        counts[p] -= 1
        counts[q] += 1
        loads[p] -= ordered[i] / speeds[p]
        loads[q] += time_there
        over -= 1
        moved += 1
        if counts[q] < cap:
            keys[0] = loads[q]
        else:
            size -= 1
            keys[0], parts[0] = keys[size], parts[size]
        _sift_down(keys, parts, size, 0)
    return moved
