"""The LPT partitioner's inner loops, compiled with numba and run without the GIL.

Planning runs on the loader's prefetch thread while the training thread runs the
step.  In Python (a heap step per sample) one 16,384-rank batch of 524,288
samples took ~0.6 s holding the GIL; here it is one compiled call that releases
the GIL (``nogil=True``), so the training thread never waits on planning.
numba rather than a C extension: no compiler at install time, one wheel, and the
code stays next to the algorithm it implements (timed in
``benchmarks/bench_balance.py``).  ``cache=True`` keeps the compiled code beside
this file: only the first process on a machine pays the compile (seconds).

Each stage is linear in the samples (no log factor, few unpredictable branches):

- ``_sort_desc``: descending order up to 2**-16 of the largest cost (one counting
  pass over the costs quantized to 16 bits), stable;
- ``_lpt_sorted``: longest processing time first, the "lightest part" found in a
  bucket queue of width ``resolution * mean part`` instead of a heap (LPT's
  lightest load only grows, so a queue of buckets is exact up to that width);
- ``lpt_counts``' ``negligible_last`` and ``fill_by_count``: samples lighter than the bucket width (a cost of 0, say, where a
  calibrated cost model has no constant term) cannot change which part is lightest, so LPT would pile them all
  onto whichever part that is; they are dealt out by count instead, each to a part holding the fewest samples;
- ``lpt_counts.count_cap``: how many samples a part may take of the tail (2x the mean count unless the costs ask for more:
  the level LPT's water-filling of the parts the head left light reaches; one sort of the parts' loads);
- ``lpt_refine.refine_sorted``: local search that lowers the heaviest part by moving
  one sample to, or swapping one pair with, one of the lightest parts, until no such
  step lowers it (its own module: the rows it keeps, the pair sweeps, the heaps);
- ``lpt_counts.trim_counts``: the parts still past 2x the mean count after all that give their lightest samples
  to the lightest parts under it, as long as none of those passes the heaviest part (balance unchanged);
- ``_members``: the part of each position -> CSR (members of each part, heaviest first).

Determinism: the same costs give the same parts on every process and machine:
plain IEEE arithmetic in a fixed order (no fastmath, no threads, no reordered
reductions), and every order is stable.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from freescale.dataloader.local_plan import local_window_owner
from freescale.dataloader.lpt_counts import count_cap, fill_by_count, negligible_last, trim_counts
from freescale.dataloader.lpt_refine import refine_sorted

_JIT: dict[str, Any] = {"nogil": True, "cache": True}
_KEYS = 1 << 16
_TAIL_SWEEPS = 1  # pair sweeps before the tail's search goes one part at a time (a second costs more than it saves)


@numba.njit(**_JIT)
def _scan(costs: np.ndarray) -> tuple[int, float, float]:
    """``(bad, total, largest)``: ``bad`` is the first cost that is negative, NaN or infinite, or
    whose addition makes the total overflow (-1 when none)."""
    total, largest = 0.0, 0.0
    for i in range(costs.size):
        c = costs[i]
        if not (0.0 <= c < np.inf) or not (total + c < np.inf):
            return i, 0.0, 0.0
        total += c
        largest = max(largest, c)
    return -1, total, largest


@numba.njit(**_JIT)
def _sort_desc(costs: np.ndarray, largest: float) -> tuple[np.ndarray, np.ndarray]:
    """``(order, costs[order])``, ``order`` descending by cost up to ``largest / 2**16`` (a
    counting sort on the costs quantized to 16 bits; stable).  LPT's choices move by at most
    that much per sample, a few millionths of a part: one pass instead of a full sort.  Under 4,096
    costs the 65,536 keys' pass costs more than sorting (key, index) pairs, which gives the same order."""
    n = costs.size
    scale = (_KEYS - 1) / largest if largest > 0.0 else 0.0
    if not scale < np.inf:
        scale = 0.0  # a tiny largest cost: one key for all, index order
    if n < _KEYS // 16:  # few costs: a sort of (key, index) beats a pass over every key (the same order)
        combined = np.empty(n, dtype=np.int64)
        for i in range(n):
            combined[i] = ((_KEYS - 1) - min(int(costs[i] * scale), _KEYS - 1)) * n + i
        combined.sort()
        order = combined % n
        ordered = np.empty(n, dtype=np.float64)
        for j in range(n):
            ordered[j] = costs[order[j]]
        return order, ordered
    keys = np.empty(n, dtype=np.int32)
    starts = np.zeros(_KEYS + 1, dtype=np.int64)
    for i in range(n):
        key = (_KEYS - 1) - min(int(costs[i] * scale), _KEYS - 1)  # heaviest first
        keys[i] = key
        starts[key + 1] += 1
    for d in range(_KEYS):
        starts[d + 1] += starts[d]
    order = np.empty(n, dtype=np.int64)
    ordered = np.empty(n, dtype=np.float64)
    for i in range(n):
        j = starts[keys[i]]
        starts[keys[i]] = j + 1
        order[j] = i
        ordered[j] = costs[i]
    return order, ordered


@numba.njit(**_JIT)
def _bucket(load: float, base: float, per_width: float, buckets: int) -> int:
    """The bucket of ``load`` (``per_width``: one over the buckets' width); ``buckets`` (the overflow) when past
    the last one."""
    offset = (load - base) * per_width
    return int(offset) if offset < buckets else buckets


@numba.njit(**_JIT)
def _enqueue(head: np.ndarray, tail: np.ndarray, link: np.ndarray, bucket: int, part: int) -> None:
    """Append ``part`` to ``bucket`` (first in, first out: equal loads take turns)."""
    link[part] = -1
    if head[bucket] < 0:
        head[bucket] = part
    else:
        link[tail[bucket]] = part
    tail[bucket] = part


@numba.njit(**_JIT)
def _lpt_sorted(ordered: np.ndarray, part_of: np.ndarray, start: int, stop: int, loads: np.ndarray,
                counts: np.ndarray, full: int, extra: int, width: float, speeds: np.ndarray) -> int:
    """Place positions ``start:stop`` of ``ordered`` (costs, heaviest first) into ``part_of``:
    each to the lightest open part (within ``width``), updating ``loads`` and ``counts``.  A part's
    load is its time, cost / ``speeds[p]`` (LPT for uniform machines, keyed by the normalised load;
    all speeds 1: plain LPT, the same arithmetic).
    A part is open below ``full`` samples, and at ``full`` while fewer than ``extra`` parts
    have gone past it (equal counts: ``full = n // k``, ``extra = n % k``).  Returns ``extra``
    left.

    Parts wait in buckets of that width by load; ``current`` walks the buckets upwards (a
    part's load only grows, so the lightest never lies behind it).  Parts beyond the last
    bucket wait in an overflow list (index ``buckets``), re-bucketed when the buckets run out."""
    k = loads.size
    buckets = 4 * k + 64
    head = np.full(buckets + 1, -1, dtype=np.int32)
    tail = np.full(buckets + 1, -1, dtype=np.int32)
    link = np.full(k, -1, dtype=np.int32)
    per_width = 1.0 / width  # the caller keeps it finite
    base, current, alike = np.inf, 0, True
    for p in range(k):
        base = min(base, loads[p])
        alike = alike and speeds[p] == 1.0  # then no division per sample (x / 1.0 is x: the same sums)
    for p in range(k):
        if counts[p] < full or (counts[p] == full and extra > 0):
            _enqueue(head, tail, link, _bucket(loads[p], base, per_width, buckets), p)
    for i in range(start, stop):
        while True:
            while current < buckets and head[current] < 0:
                current += 1
            if current == buckets:  # re-bucket the overflow from its lightest load
                if head[buckets] < 0:
                    raise RuntimeError("LPT: no open part left")  # unreachable with finite costs: no hang
                q, base, current = head[buckets], np.inf, 0
                head[buckets] = -1
                r = q
                while r >= 0:
                    base = min(base, loads[r])
                    r = link[r]
                while q >= 0:
                    after = link[q]
                    _enqueue(head, tail, link, _bucket(loads[q], base, per_width, buckets), q)
                    q = after
                continue
            p = head[current]
            head[current] = link[p]
            if counts[p] < full or extra > 0:
                break  # else: closed since it was queued (the extra slots ran out)
        part_of[i] = p
        counts[p] += 1
        loads[p] += ordered[i] if alike else ordered[i] / speeds[p]
        if counts[p] == full + 1:
            extra -= 1
        if counts[p] < full or (counts[p] == full and extra > 0):
            _enqueue(head, tail, link, _bucket(loads[p], base, per_width, buckets), p)
    return extra


@numba.njit(**_JIT)
def _members(part_of: np.ndarray, order: np.ndarray, num_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index, offsets)``: part p holds samples ``index[offsets[p]:offsets[p+1]]``, where sample
    ``order[i]`` is in part ``part_of[i]`` (kept in the order of ``i``)."""
    offsets = np.zeros(num_parts + 1, dtype=np.int64)
    for i in range(part_of.size):
        offsets[part_of[i] + 1] += 1
    for p in range(num_parts):
        offsets[p + 1] += offsets[p]
    fill = offsets[:-1].copy()
    index = np.empty(part_of.size, dtype=np.int64)
    for i in range(part_of.size):
        index[fill[part_of[i]]] = order[i]
        fill[part_of[i]] += 1
    return index, offsets


@numba.njit(**_JIT)
def lpt_refined_steps(costs: np.ndarray, steps: int, num_parts: int, equal_count: bool, refine_steps: int,
                      partners: int, resolution: float, tolerance: float, head_share: float, tail_tolerance: float,
                      max_count: int, count_ceiling: int, speeds: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``lpt_refined`` of each of ``steps`` equal slices of ``costs`` (one step's samples each), in one call: every
    step's parts as CSR of positions in its own slice (``index``, back to back) and its offsets (row ``j`` of a
    ``steps x (num_parts + 1)`` array); ``bad`` the first bad sample (in ``costs``) or -1, as ``lpt_refined``."""
    n = costs.size // steps
    index = np.empty(costs.size, dtype=np.int64)
    offsets = np.zeros((steps, num_parts + 1), dtype=np.int64)
    for j in range(steps):
        step_index, step_offsets, bad = lpt_refined(
            costs[j * n:(j + 1) * n], num_parts, equal_count, refine_steps, partners, resolution, tolerance,
            head_share, tail_tolerance, max_count, count_ceiling, speeds)
        if bad >= 0:
            return index, offsets, j * n + bad
        index[j * n:(j + 1) * n] = step_index
        offsets[j] = step_offsets
    return index, offsets, -1


@numba.njit(**_JIT)
def members_of(owner: np.ndarray, num_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of an owner-per-sample array, members ascending (see ``_members``)."""
    return _members(owner, np.arange(owner.size), num_parts)


@numba.njit(**_JIT)
def lpt_refined(costs: np.ndarray, num_parts: int, equal_count: bool, refine_steps: int, partners: int,
                resolution: float, tolerance: float, head_share: float, tail_tolerance: float, max_count: int,
                count_ceiling: int, speeds: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """LPT with local search over ``costs``: ``(index, offsets, bad)``, the parts as CSR (each
    part's samples heaviest first; one part: in their order); ``bad``
    is the first sample whose cost is negative or not finite (then nothing is planned), else -1.

    In two rounds.  The head (samples of at least ``head_share`` of a mean part) is placed by
    LPT and refined while the parts still have room: that is where LPT loses on bimodal
    lengths (the parts that must hold one long sample more get LPT's larger ones), and later
    the light samples fill every part to the brim, leaving no room to swap.  Then the tail is
    placed by LPT on top, and the whole refined once more, until the heaviest part is within
    ``tail_tolerance`` of the mean (the tail's samples are light: LPT alone leaves the parts within
    about one light sample of each other, and chasing the last few 1e-4 there is what costs time).
    Without ``equal_count`` no part takes more than ``count_ceiling`` samples, and of the tail a part takes at
    most ``max_count`` samples in all (at least ``ceil(n / k)``) unless the costs ask for more (``count_cap``, once
    the head is placed: the tail's light samples filling the parts the head left light); the final local search
    may then add up to 4 samples past the fullest part (its member table), within the ceiling, where that lowers
    the heaviest part.  Samples lighter than LPT's bucket width (cost 0, say) are dealt
    out by count after the others (``fill_by_count``: they would otherwise all go to whichever part is lightest).

    ``speeds`` (one per part, positive; all 1: every part alike) makes every load a time, cost / speed:
    the parts' times are balanced, so a part twice as fast takes about twice the cost (uniform machines).
    ``mean`` is then the time of a perfectly proportional split, total / sum(speeds)."""
    n, k = costs.size, num_parts
    bad, total, largest = _scan(costs)
    if bad >= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(k + 1, dtype=np.int64), bad
    if k == 1:  # one part holds every sample, in their order: nothing to sort, place or refine (a one-rank run)
        offsets = np.zeros(2, dtype=np.int64)
        offsets[1] = n
        return np.arange(n), offsets, -1
    order, ordered = _sort_desc(costs, largest)
    mean = total / speeds.sum()
    full, extra = (n // k, n % k) if equal_count else (max(max_count, -(-n // k)), 0)
    loose = full if equal_count else max(count_ceiling, full)
    part_of = np.empty(n, dtype=np.int64)
    loads, counts = np.zeros(k, dtype=np.float64), np.zeros(k, dtype=np.int64)
    width = resolution * mean
    if not (width > 0.0 and 1.0 / width < np.inf):  # no cost at all, or a mean so small the width underflows
        width = mean if mean > 0.0 and 1.0 / mean < np.inf else 1.0
    head = 0
    while head < n and ordered[head] >= head_share * (total / k):
        head += 1
    light = n if equal_count else negligible_last(order, ordered, head, width)
    # The head under the ceiling alone: its samples are heavy (a part needs at most ~1 / head_share of them, a fast
    # part that times its speed), so a count cap there would only cost balance.
    extra = _lpt_sorted(ordered, part_of, 0, head, loads, counts, loose, extra, width, speeds)
    allow_moves = not equal_count
    if refine_steps > 0 and head > k and loads.max() > mean * (1.0 + tolerance):
        refine_sorted(ordered, part_of, head, k, allow_moves, partners, refine_steps, mean * (1.0 + tolerance), loose,
                      speeds, 0)
        loads[:], counts[:] = 0.0, 0
        for i in range(head):
            loads[part_of[i]] += ordered[i] / speeds[part_of[i]]
            counts[part_of[i]] += 1
    if not equal_count:
        full = count_cap(ordered, head, light, loads, counts, speeds, full, loose)
    _lpt_sorted(ordered, part_of, head, light, loads, counts, full, extra, width, speeds)
    fill_by_count(ordered, part_of, light, loads, counts, speeds)
    if refine_steps > 0 and n > k and loads.max() > mean * (1.0 + tail_tolerance):
        # The tail's samples are light: moving one to the lightest couple of parts does as well as trying more
        # (swaps, for equal counts, want four).  A step costs ~1-2 us here (heap updates, a merge per partner):
        # where thousands of parts are over, pair sweeps first do most of it at a third of that.
        refine_sorted(ordered, part_of, n, k, allow_moves, min(partners, 2) if allow_moves else min(partners, 4),
                      min(refine_steps, k + 64), mean * (1.0 + tail_tolerance), loose, speeds, _TAIL_SWEEPS)
    if not equal_count:
        trim_counts(ordered, part_of, speeds, max(max_count, -(-n // k)))
    index, offsets = _members(part_of, order, k)
    return index, offsets, -1


@numba.njit(**_JIT)
def refined_owner(costs: np.ndarray, owner: np.ndarray, num_parts: int, allow_moves: bool, partners: int,
                  max_steps: int) -> np.ndarray:
    """Any partition (``owner``: part per sample) improved by the local search, aiming at the mean
    part: with many partners and steps, a reference for what a partition of ``costs`` can reach."""
    n = costs.size
    _, total, largest = _scan(costs)
    order, ordered = _sort_desc(costs, largest)
    part_of = np.empty(n, dtype=np.int64)
    for i in range(n):
        part_of[i] = owner[order[i]]
    refine_sorted(ordered, part_of, n, num_parts, allow_moves, min(partners, num_parts), max_steps,
                  total / num_parts, n, np.ones(num_parts), 0)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        out[order[i]] = part_of[i]
    return out


@numba.njit(**_JIT)
def take(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values[index]`` without the GIL (numpy's gather holds it: ~1-3 ms at 524,288 samples)."""
    out = np.empty(index.size, dtype=values.dtype)
    for i in range(index.size):
        out[i] = values[index[i]]
    return out


@numba.njit(**_JIT)
def lookup(table: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``table[keys[rows]]`` without the GIL (the planner's costs: a per-model table by length)."""
    out = np.empty(rows.size, dtype=table.dtype)
    for i in range(rows.size):
        out[i] = table[keys[rows[i]]]
    return out


@numba.njit(**_JIT)
def part_balance(costs: np.ndarray, offsets: np.ndarray) -> tuple[float, float]:
    """A plan's imbalance and lower bound in one pass over ``costs`` split into parts at ``offsets`` (``Parts``):
    ``max part / mean part`` and ``max(1, heaviest sample / mean part)``; (1.0, 1.0) when they cost nothing.  The
    loader asks it of every step it builds (``partition.load_imbalance`` and ``lower_bound`` take a dozen numpy
    calls for it)."""
    parts = offsets.size - 1
    total, heaviest_part, heaviest = 0.0, 0.0, 0.0
    for p in range(parts):
        load = 0.0
        for i in range(offsets[p], offsets[p + 1]):
            load += costs[i]
            heaviest = max(heaviest, costs[i])
        total += load
        heaviest_part = max(heaviest_part, load)
    if total <= 0.0:
        return 1.0, 1.0
    return heaviest_part / total * parts, max(1.0, heaviest / total * parts)


def warm_up() -> None:
    """Compile every entry point, ``local_plan``'s too (or load it from the cache): set-up calls it once, so no
    training's prefetch thread waits seconds for the compiler."""
    costs = np.array([3.0, 1.0, 2.0, 2.0, 5.0, 0.5])
    for equal_count in (False, True):
        lpt_refined(costs, 2, equal_count, 8, 2, 1e-5, 1e-3, 0.25, 1e-3, 6, 6, np.ones(2))
        lpt_refined_steps(costs, 2, 2, equal_count, 8, 2, 1e-5, 1e-3, 0.25, 1e-3, 6, 6, np.ones(2))
    members_of(np.array([1, 0, 1], dtype=np.int64), 2)
    index = np.array([1, 0], dtype=np.int64)
    take(costs, index)
    take(index, index)
    part_balance(costs, np.array([0, 2, 6], dtype=np.int64))
    lookup(costs, np.array([0, 1], dtype=np.int32), index)
    lookup(costs, np.array([0, 1], dtype=np.uint16), index)
    local_window_owner(np.arange(6, dtype=np.int64), costs, np.array([0, 3, 6], dtype=np.int64), 2, 2)
