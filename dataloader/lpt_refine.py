"""The local search behind LPT (``balance_kernels.lpt_refined``): lower the heaviest part by moving one sample to,
or swapping one pair with, one of the lightest parts, compiled with numba and run without the GIL.

LPT leaves its excess in a few parts holding one long sample too many (bimodal lengths) and, where the lightest
samples are a sizeable share of a part (a cost model with a large constant term), in every part within one light
sample of the others; one swap each fixes them.  The search works on each part's members kept ascending by cost:

- ``_rows``: the members as rows of one flat array (a row per part, room for a few more), filled in one pass; a
  row that runs out of room moves once to the end, as wide as any part may grow (``_make_room``; the array grows
  when it must), so memory follows the rows that grow, not parts x the widest part (that dense table, or spare
  room reserved up front, cost more in page faults than the whole search on 16,384 parts; the worst case is
  still bounded by ``_REFINE_MAX_CELLS``);
- ``_best_exchange``: the move (a binary search) or swap (one merge of the two rows) whose cost shift lands the
  pair nearest their meeting point;
- ``_pair_sweep`` (the tail's search only): the parts over the target, heaviest first, each paired with one of the
  lightest, lightest first, in one sorted pass: where thousands of parts are a light sample over (a large
  constant term, 16,384 ranks), this does most of the work at a third of a heap step's cost;
- ``refine_sorted``: the search itself, the heaviest part from a heap and its partners from another.

Determinism as in ``balance_kernels``: plain IEEE arithmetic in a fixed order, stable sorts, ties broken by part.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_JIT: dict[str, Any] = {"nogil": True, "cache": True}
_WIDE_PARTNERS = 32  # partners tried before the local search gives up on the heaviest part
_REFINE_MAX_CELLS = 1 << 25  # parts x the widest a part may grow: what rows that grow may take (12 bytes a cell)
_SLACK = 4  # room for moves into a part beyond its count before its row moves to a spare one
_PROBE_STEPS = 64  # steps of the search before pair sweeps are tried (``refine_sorted``)


@numba.njit(**_JIT)
def _less(load_a: float, part_a: int, load_b: float, part_b: int) -> bool:
    return load_a < load_b or (load_a == load_b and part_a < part_b)


@numba.njit(**_JIT)
def _sift_down(loads: np.ndarray, parts: np.ndarray, size: int, i: int) -> None:
    """Restore the min-heap ``(loads, parts)[:size]`` below position ``i``."""
    load, part = loads[i], parts[i]
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _less(loads[child + 1], parts[child + 1], loads[child], parts[child]):
            child += 1
        if not _less(loads[child], parts[child], load, part):
            break
        loads[i], parts[i] = loads[child], parts[child]
        i = child
    loads[i], parts[i] = load, part


@numba.njit(**_JIT)
def _push(loads: np.ndarray, parts: np.ndarray, size: int, load: float, part: int) -> int:
    """Push onto the min-heap ``(loads, parts)[:size]``; returns the new size."""
    i = size
    while i > 0:
        parent = (i - 1) // 2
        if not _less(load, part, loads[parent], parts[parent]):
            break
        loads[i], parts[i] = loads[parent], parts[parent]
        i = parent
    loads[i], parts[i] = load, part
    return size + 1


@numba.njit(**_JIT)
def _pop(loads: np.ndarray, parts: np.ndarray, size: int) -> int:
    size -= 1
    loads[0], parts[0] = loads[size], parts[size]
    _sift_down(loads, parts, size, 0)
    return size


@numba.njit(**_JIT)
def _heap(keys: np.ndarray, room: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A min-heap of ``(keys[p], p)`` with ``room`` for pushes (lazy deletion adds entries)."""
    k = keys.size
    loads = np.empty(k + room, dtype=np.float64)
    parts = np.empty(k + room, dtype=np.int64)
    loads[:k] = keys
    parts[:k] = np.arange(k)
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(loads, parts, k, i)
    return loads, parts, k


@numba.njit(**_JIT)
def _closest(vals: np.ndarray, target: float) -> int:
    """Position in the ascending ``vals`` of the value nearest ``target`` (-1 if empty; the lower on a tie)."""
    count = vals.size
    j = int(np.searchsorted(vals, target))
    if j >= count:
        return count - 1
    if j > 0 and target - vals[j - 1] <= vals[j] - target:
        return j - 1
    return j


@numba.njit(**_JIT)
def _best_exchange(vh: np.ndarray, vp: np.ndarray, half: float, limit: float, move: bool,
                   swaps: bool) -> tuple[float, int, int]:
    """The move (``y == -1``; only if ``move``) of member ``x`` of the heavier part (costs ``vh``, ascending) to
    the lighter one (``vp``), or swap of ``x`` with member ``y`` of the lighter, whose cost shift ``d`` in
    ``(0, limit)`` (it lowers the pair's maximum) is nearest ``half`` (where the pair's times meet: equal speeds,
    half the gap).  ``(d, x, y)``; ``d = 0``: none.  For each ``x``, the ``y`` nearest ``vh[x] - half`` (as a
    binary search would find it, the lower on a tie): one merge of the two rows, as the targets rise with ``x``."""
    best_d, best_x, best_y, best_miss = 0.0, -1, -1, np.inf
    if move:
        x = _closest(vh, half)
        if 0.0 < vh[x] < limit:
            best_d, best_x, best_miss = vh[x], x, abs(vh[x] - half)
    count = vp.size
    if not swaps or count == 0:
        return best_d, best_x, best_y
    j = 0
    for x in range(vh.size):
        target = vh[x] - half
        while j < count and vp[j] < target:
            j += 1
        if j >= count:
            y = count - 1
        elif j > 0 and target - vp[j - 1] <= vp[j] - target:
            y = j - 1
        else:
            y = j
        d = vh[x] - vp[y]
        if 0.0 < d < limit and abs(d - half) < best_miss:
            best_d, best_x, best_y, best_miss = d, x, y, abs(d - half)
    return best_d, best_x, best_y


@numba.njit(**_JIT)
def _insert(ids: np.ndarray, vals: np.ndarray, count: int, sample: int, cost: float) -> None:
    """Insert into the ascending ``vals[:count]`` (after equal values)."""
    j = count
    while j > 0 and vals[j - 1] > cost:
        ids[j], vals[j] = ids[j - 1], vals[j - 1]
        j -= 1
    ids[j], vals[j] = sample, cost


@numba.njit(**_JIT)
def _remove(ids: np.ndarray, vals: np.ndarray, count: int, j: int) -> int:
    """Remove position ``j`` of ``ids/vals[:count]``; returns the removed id."""
    sample = ids[j]
    for i in range(j, count - 1):
        ids[i], vals[i] = ids[i + 1], vals[i + 1]
    return sample


@numba.njit(**_JIT)
def _rows(ordered: np.ndarray, part_of: np.ndarray, stop: int, counts: np.ndarray,
          slack: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Each part's members (positions of ``ordered[:stop]``, ascending by cost) as a row of one flat array:
    ``(start, room, ids, vals, loads, free)``; row ``p`` is ``[start[p], start[p] + room[p])`` with ``counts[p]``
    (each part's count on entry, kept) filled, ``room = count + slack``; ``free``: the first cell past the rows.
    ``loads`` sums each part's costs, lightest first."""
    k = counts.size
    start, room = np.empty(k, dtype=np.int64), counts + slack
    free = 0
    for p in range(k):
        start[p] = free
        free += room[p]
    ids = np.empty(free, dtype=np.int32)  # positions: a batch is far below 2**31 samples (the caller checks)
    vals = np.empty(free, dtype=np.float64)
    loads = np.zeros(k, dtype=np.float64)
    counts[:] = 0
    for i in range(stop - 1, -1, -1):  # lightest first: each row ascending by cost
        p = part_of[i]
        at = start[p] + counts[p]
        ids[at], vals[at] = i, ordered[i]
        counts[p] += 1
        loads[p] += ordered[i]
    return start, room, ids, vals, loads, free


@numba.njit(**_JIT)
def _make_room(start: np.ndarray, room: np.ndarray, counts: np.ndarray, ids: np.ndarray, vals: np.ndarray,
               p: int, free: int, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Move row ``p`` to ``width`` cells at ``free`` (once per part: ``width`` is the most it may hold), growing
    the arrays by an eighth (at least 64 such rows) when they are full: ``(ids, vals, free)`` after it."""
    if free + width > ids.size:  # (never more than a row per part: each moves once)
        size = ids.size + max(ids.size // 8, min(64, start.size) * width)
        grown_ids, grown_vals = np.empty(size, dtype=ids.dtype), np.empty(size, dtype=vals.dtype)
        grown_ids[:free], grown_vals[:free] = ids[:free], vals[:free]
        ids, vals = grown_ids, grown_vals
    a, c = start[p], counts[p]
    ids[free:free + c], vals[free:free + c] = ids[a:a + c], vals[a:a + c]
    start[p], room[p] = free, width
    return ids, vals, free + width


@numba.njit(**_JIT)
def _apply(ordered: np.ndarray, part_of: np.ndarray, start: np.ndarray, room: np.ndarray, counts: np.ndarray,
           ids: np.ndarray, vals: np.ndarray, loads: np.ndarray, speeds: np.ndarray, h: int, p: int, x: int, y: int,
           free: int, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Move member ``x`` of part ``h`` to part ``p`` (``y == -1``) or swap it with member ``y`` of ``p``;
    ``part_of`` and both loads follow (summed afresh, lightest first: no drift).  ``(ids, vals, free)`` after it
    (``_make_room``)."""
    if y < 0 and counts[p] == room[p]:
        ids, vals, free = _make_room(start, room, counts, ids, vals, p, free, width)
    a, b = start[h], start[p]
    row_h, val_h = ids[a:a + room[h]], vals[a:a + room[h]]
    row_p, val_p = ids[b:b + room[p]], vals[b:b + room[p]]
    moved = _remove(row_h, val_h, counts[h], x)
    counts[h] -= 1
    if y >= 0:
        back = _remove(row_p, val_p, counts[p], y)
        counts[p] -= 1
        _insert(row_h, val_h, counts[h], back, ordered[back])
        counts[h] += 1
        part_of[back] = h
    _insert(row_p, val_p, counts[p], moved, ordered[moved])
    counts[p] += 1
    part_of[moved] = p
    for q in (h, p):
        total = 0.0
        for j in range(start[q], start[q] + counts[q]):
            total += vals[j]
        loads[q] = total / speeds[q]
    return ids, vals, free


@numba.njit(**_JIT)
def _exchange(start: np.ndarray, counts: np.ndarray, vals: np.ndarray, loads: np.ndarray, speeds: np.ndarray,
              h: int, p: int, allow_moves: bool, swaps: bool, width: int) -> tuple[float, int, int, float]:
    """``_best_exchange`` between parts ``h`` and ``p`` (loads are times: the shift that levels them is the gap
    over the sum of their inverse speeds): ``(d, x, y, max of the pair after it)``."""
    nh, np_ = counts[h], counts[p]
    gap = loads[h] - loads[p]
    d, x, y = _best_exchange(vals[start[h]:start[h] + nh], vals[start[p]:start[p] + np_],
                             gap / (1.0 / speeds[h] + 1.0 / speeds[p]), gap * speeds[p],
                             allow_moves and nh > 1 and np_ < width, swaps)
    return d, x, y, max(loads[h] - d / speeds[h], loads[p] + d / speeds[p])


@numba.njit(**_JIT)
def _pair_sweep(ordered: np.ndarray, part_of: np.ndarray, start: np.ndarray, room: np.ndarray, counts: np.ndarray,
                ids: np.ndarray, vals: np.ndarray, loads: np.ndarray, speeds: np.ndarray, allow_moves: bool,
                target: float, free: int, width: int) -> tuple[int, np.ndarray, np.ndarray, int]:
    """One sorted pass: the parts over ``target``, heaviest first, each exchanging with the lightest part not yet
    paired (a move first, else a swap) where that lowers the pair's maximum.  ``(exchanges made, ids, vals,
    free)``."""
    by_load = np.argsort(loads, kind="mergesort")
    lo, hi, changed = 0, loads.size - 1, 0
    while lo < hi and loads[by_load[hi]] > target:
        h, p = by_load[hi], by_load[lo]
        for swaps in (not allow_moves, True):
            d, x, y, shifted = _exchange(start, counts, vals, loads, speeds, h, p, allow_moves, swaps, width)
            if d > 0.0 and shifted < loads[h]:
                ids, vals, free = _apply(ordered, part_of, start, room, counts, ids, vals, loads, speeds, h, p, x,
                                         y, free, width)
                changed += 1
                break
        lo, hi = lo + 1, hi - 1
    return changed, ids, vals, free


@numba.njit(**_JIT)
def _heap_steps(ordered: np.ndarray, part_of: np.ndarray, start: np.ndarray, room: np.ndarray, counts: np.ndarray,
                ids: np.ndarray, vals: np.ndarray, loads: np.ndarray, speeds: np.ndarray, allow_moves: bool,
                partners: int, max_steps: int, target: float, free: int,
                width: int) -> tuple[int, bool, np.ndarray, np.ndarray, int]:
    """Up to ``max_steps`` steps of the search (``refine_sorted``): ``(steps taken, finished, ids, vals, free)``,
    finished when the heaviest part is at most ``target`` or no single exchange lowers it."""
    k = loads.size
    heavy_loads, heavy_parts, heavy = _heap(-loads, 2 * max_steps + 64)
    wide = max(partners, _WIDE_PARTNERS)
    light_loads, light_parts, light = _heap(loads.copy(), 2 * max_steps + wide + 64)
    picked = np.empty(wide, dtype=np.int64)
    picked_at = np.full(k, -1, dtype=np.int64)
    stamp = 0
    for step in range(max_steps):
        while -heavy_loads[0] != loads[heavy_parts[0]]:
            heavy = _pop(heavy_loads, heavy_parts, heavy)  # stale entry of a part that changed
        h = heavy_parts[0]
        if loads[h] <= target:
            return step, True, ids, vals, free
        best_max, best_x, best_y, best_p = loads[h], -1, -1, -1
        for want in (partners, wide):  # the few lightest parts; when stuck, once more with more of them
            stamp += 1
            found = 0
            while found < want and light > 0:
                load, p = light_loads[0], light_parts[0]
                light = _pop(light_loads, light_parts, light)
                if load == loads[p] and picked_at[p] != stamp and p != h:
                    picked_at[p] = stamp
                    picked[found] = p
                    found += 1
            # Moves first (a binary search in H), swaps only when no move helps (one merge per partner).
            for swaps in (not allow_moves, True):
                for i in range(found):
                    d, x, y, shifted = _exchange(start, counts, vals, loads, speeds, h, picked[i], allow_moves,
                                                 swaps, width)
                    if d > 0.0 and shifted < best_max:
                        best_max, best_x, best_y, best_p = shifted, x, y, picked[i]
                if best_p >= 0:
                    break
            for i in range(found):
                light = _push(light_loads, light_parts, light, loads[picked[i]], picked[i])
            if best_p >= 0 or want == wide:
                break
        if best_p < 0:
            return step, True, ids, vals, free  # no single move or swap lowers the heaviest part
        ids, vals, free = _apply(ordered, part_of, start, room, counts, ids, vals, loads, speeds, h, best_p, best_x,
                                 best_y, free, width)
        for q in (h, best_p):
            heavy = _push(heavy_loads, heavy_parts, heavy, -loads[q], q)
            light = _push(light_loads, light_parts, light, loads[q], q)
    return max_steps, False, ids, vals, free


@numba.njit(**_JIT)
def refine_sorted(ordered: np.ndarray, part_of: np.ndarray, stop: int, num_parts: int, allow_moves: bool,
                  partners: int, max_steps: int, target: float, max_count: int, speeds: np.ndarray,
                  sweeps: int) -> None:
    """Lower the heaviest part by local search, in place on ``part_of[:stop]`` (positions of ``ordered``, heaviest
    first).  Loads are times (cost / ``speeds[p]``; ``target`` too).

    Each step takes the heaviest part H and, among the ``partners`` lightest parts, the one move of a sample of H
    (``allow_moves``; off for equal counts) or swap of one pair that lowers ``max(H, P)`` the most; a move never
    fills a part past ``max_count`` samples, nor past the fullest part's count + 4.  Stops when H is at most
    ``target``, when no such step lowers H (a local optimum), or after ``max_steps``.  With ``sweeps``, where the
    first ``_PROBE_STEPS`` steps neither reach the target nor get stuck (many parts a little over: the steps would
    go on for thousands), up to ``sweeps`` pair sweeps (``_pair_sweep``) do most of the rest first; where the
    heaviest part cannot come down, no sweep is paid for."""
    k, n = num_parts, stop
    counts = np.zeros(k, dtype=np.int64)
    for i in range(n):
        counts[part_of[i]] += 1
    slack = _SLACK if allow_moves else 0
    cap = counts.max() + slack
    if n == 0 or n >= 1 << 31 or k * cap > _REFINE_MAX_CELLS:
        return  # too uneven a partition to search here (rows that grow), or positions past int32
    width = min(cap, max_count)
    start, room, ids, vals, loads, free = _rows(ordered, part_of, n, counts, slack)
    for p in range(k):
        loads[p] /= speeds[p]
    if loads.sum() <= 0.0:
        return
    probe = min(max_steps, _PROBE_STEPS) if sweeps > 0 else max_steps
    taken, finished, ids, vals, free = _heap_steps(ordered, part_of, start, room, counts, ids, vals, loads, speeds,
                                                   allow_moves, partners, probe, target, free, width)
    if finished or taken == max_steps:
        return
    for _ in range(sweeps):
        changed, ids, vals, free = _pair_sweep(ordered, part_of, start, room, counts, ids, vals, loads, speeds,
                                               allow_moves, target, free, width)
        if changed == 0:
            break
    _heap_steps(ordered, part_of, start, room, counts, ids, vals, loads, speeds, allow_moves, partners,
                max_steps - taken, target, free, width)
