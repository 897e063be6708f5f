"""Split one batch of per-sample costs into per-rank parts (FreeScale technique 1).

Every partitioner has the signature ``(costs, num_parts, equal_count) -> parts``:
``costs`` is a float64 array with one entry per sample, ``parts`` a ``Parts``
(CSR: ``num_parts`` int64 index arrays into ``costs`` that together are a
permutation of ``range(len(costs))``; ``lpt`` lists each part heaviest first (one part: ascending),
the others ascending).  Every rank calls the same function
on the same costs and gets the same answer, so no sample ever crosses the network.

- ``round_robin``: sample i to part i mod k; what "split by sample count" does.
- ``lpt``: longest-processing-time first (heaviest sample to the lightest part),
  then a local search that lowers the heaviest part by single moves and swaps
  (``balance_kernels``: compiled, linear time, runs without the GIL).
- ``kk``: Karmarkar-Karp largest differencing, k-way: repeatedly merge the two
  partial solutions whose spread (max - min part) is largest, pairing the
  heaviest part of one with the lightest of the other.  Its memory is one
  k-vector per sample: it refuses batches over ``KK_MAX_CELLS`` samples x parts.
- ``token_kk``: ``kk`` on token counts instead of costs (what a balancer that
  models cost as linear in length does; the baseline used elsewhere).

``equal_count`` additionally gives every part the same number of samples (+-1):
LPT closes a part when it is full; KK starts from groups of k consecutive
sorted samples (balanced largest differencing), so each part takes one per group.

No per-step partition can beat ``max(1, max_sample / mean_part)``: the part
holding the heaviest sample costs at least that much (``lower_bound``).  When
many samples are nearly as heavy as a part's share (histories clipped at
max_len), whole samples cannot be split, and ``granular_lower_bound`` says how
far that alone keeps any partition from 1.0.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from freescale.dataloader import balance_kernels

Partitioner = Callable[[np.ndarray, int, bool], "Parts"]
KK_MAX_CELLS = 1 << 24
"""``kk`` keeps one k-vector per sample (n x k cells, ~32 bytes each): beyond this it refuses."""
LPT_REFINE_PARTNERS = 8
"""Lightest parts the local search tries against the heaviest one at each step (2 once the light samples are placed)."""
LPT_RESOLUTION = 1e-5
"""LPT's "lightest part" is exact up to this share of a mean part (the bucket queue's width)."""
LPT_TOLERANCE = 1e-4
"""The local search stops once the heaviest part is within this share of the mean part."""
LPT_HEAD_SHARE = 1 / 16
"""Samples of at least this share of a mean part are placed and refined first."""
LPT_MAX_COUNT_SHARE = 2
"""A part takes at most this many times the mean samples per part, unless the costs ask for more: a bound on a
rank's batch (memory, padding) where it costs no balance.  Where the long histories leave some parts light, LPT
fills them with many short ones (3x the mean on bimodal lengths under the tiny HSTU's cost model); the cap then
rises to what that takes (``lpt_counts.count_cap``), up to ``LPT_COUNT_CEILING_SHARE``."""
LPT_COUNT_CEILING_SHARE = 8
"""No part ever takes more than this many times the mean samples per part."""
LPT_TAIL_TOLERANCE = 3e-4
LPT_TAIL_TOLERANCE_FROM_PARTS = 4096
"""Beyond 4,096 parts the search stops at 3e-4 of the mean part once the light samples are placed (below
that, at ``LPT_TOLERANCE``): its steps grow with the parts, and at 16,384 parts going on to 1e-4 cost 20 ms
more per plan with the tiny HSTU's cost model (whose constant term makes the light samples many and alike)
for 2e-4 of balance (``bench_balance.py``).  No peer partitioner runs at that size."""


@dataclass(frozen=True, eq=False)
class Parts:
    """Members of each part, CSR: part ``p`` is ``index[offsets[p]:offsets[p + 1]]``.

    A sequence of index arrays (``len``, ``parts[p]``, iteration) for callers that look at a
    few parts; the vectorised methods for those that look at all of them (16,384 ranks)."""

    index: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of_owner(cls, owner: np.ndarray, num_parts: int) -> Parts:
        """From the part of each sample (members ascending)."""
        owner = np.ascontiguousarray(owner, dtype=np.int64)
        if owner.size and not (0 <= owner.min() and owner.max() < num_parts):
            raise ValueError(f"owners must lie in [0, {num_parts}), got {owner.min()}..{owner.max()}")
        index, offsets = balance_kernels.members_of(owner, num_parts)
        return cls(index, offsets)

    @classmethod
    def of_list(cls, parts: list[np.ndarray]) -> Parts:
        sizes = np.array([p.size for p in parts], dtype=np.int64)
        index = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        return cls(index, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, part: int) -> np.ndarray:
        return self.index[self.offsets[part] : self.offsets[part + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[p] for p in range(len(self)))

    _sizes: np.ndarray | None = field(default=None, init=False, repr=False)

    @property
    def sizes(self) -> np.ndarray:
        """Members per part (read-only: computed once, shared by every caller; kept by hand: on Python 3.11
        ``cached_property`` takes a lock shared by every instance at each instance's first access, and the
        planner makes several ``Parts`` a step)."""
        sizes = self._sizes
        if sizes is None:
            sizes = self.offsets[1:] - self.offsets[:-1]
            sizes.flags.writeable = False
            object.__setattr__(self, "_sizes", sizes)
        return sizes

    def owner(self) -> np.ndarray:
        """Part of each entry of ``index``."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.sizes)

    def sums(self, values: np.ndarray) -> np.ndarray:
        """Per part, the sum of ``values`` over its members (0.0 for an empty part)."""
        return self.map(values).totals()

    def totals(self) -> np.ndarray:
        """Per part, the sum of its entries (for parts of values, e.g. costs; 0.0 when empty)."""
        out = np.zeros(len(self), dtype=np.float64)
        full = self.sizes > 0
        if full.any():
            out[full] = np.add.reduceat(self.index.astype(np.float64, copy=False), self.offsets[:-1][full])
        return out

    def maxima(self, values: np.ndarray) -> np.ndarray:
        """Per part, the largest of ``values`` over its members (0.0 for an empty part)."""
        out = np.zeros(len(self), dtype=np.float64)
        full = self.sizes > 0
        if full.any():
            out[full] = np.maximum.reduceat(values[self.index], self.offsets[:-1][full])
        return out

    def sums_of(self, values_of: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Per part, the sum of ``values_of(entries)`` (one vectorised call over every entry)."""
        return Parts(values_of(self.index), self.offsets).totals()

    def map(self, values: np.ndarray) -> Parts:
        """The same parts over ``values[index]`` (e.g. positions -> row ids)."""
        if values.dtype in (np.float64, np.int64) and values.ndim == 1 and values.flags.c_contiguous:
            return Parts(balance_kernels.take(values, self.index), self.offsets)  # no GIL held
        return Parts(values[self.index], self.offsets)

    def select(self, parts: np.ndarray) -> Parts:
        """Parts ``parts`` (in that order) as a new ``Parts``."""
        sizes = self.sizes[parts]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        shift = np.repeat(self.offsets[:-1][parts] - offsets[:-1], sizes)
        return Parts(self.index[np.arange(offsets[-1], dtype=np.int64) + shift], offsets)


def imbalance(costs: np.ndarray, parts: Parts | list[np.ndarray]) -> float:
    """``max_part(cost) / mean_part(cost)``; 1.0 is perfect (docs/design.md "Measures": imbalance)."""
    return load_imbalance((parts if isinstance(parts, Parts) else Parts.of_list(parts)).sums(costs))


def load_imbalance(loads: np.ndarray) -> float:
    """``max(loads) / mean(loads)``, computed as max / total * k: a tiny mean would underflow."""
    total = loads.sum()
    return float(loads.max() / total * loads.size) if total > 0 else 1.0


def lower_bound(costs: np.ndarray, num_parts: int) -> float:
    """``max(1, max_sample / mean_part)``: no partition of this batch does better."""
    total = costs.sum()
    if total <= 0 or costs.size == 0:
        return 1.0
    return max(1.0, float(costs.max()) / total * num_parts)


def granular_lower_bound(costs: np.ndarray, num_parts: int) -> float:
    """A tighter bound that also counts sample granularity (pigeonhole).

    Among the ``j*k + 1`` heaviest samples some part holds ``j + 1``, so some
    part costs at least the ``j + 1`` lightest of them.  The maximum over j (j =
    0 is the heaviest sample alone) over the mean part, and at least 1.
    """
    n, k = costs.size, num_parts
    total = costs.sum()
    if total <= 0 or n == 0:
        return 1.0
    top = np.sort(costs)[::-1]
    csum = np.concatenate([[0.0], np.cumsum(top)])
    j = np.arange(0, (n - 1) // k + 1)
    loads = csum[j * k + 1] - csum[j * k - j]
    return max(1.0, float(loads.max()) / total * k)


def round_robin(costs: np.ndarray, num_parts: int, equal_count: bool = False) -> Parts:
    return Parts.of_owner(np.arange(costs.size, dtype=np.int64) % num_parts, num_parts)


def lpt(costs: np.ndarray, num_parts: int, equal_count: bool = False, capacities: np.ndarray | None = None) -> Parts:
    """LPT plus local search (module docstring; the algorithm is in ``balance_kernels``).  ``capacities``: each
    part's speed (cost per second, relative), so the parts' times (cost / capacity) are balanced instead of
    their costs; None: every part alike."""
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    speeds = np.ones(num_parts) if capacities is None else checked_capacities(capacities, num_parts)
    index, offsets, bad = balance_kernels.lpt_refined(costs, num_parts, equal_count, *_lpt_settings(costs.size, num_parts),
                                                      speeds)
    _raise_if_bad(costs, bad)
    return Parts(index, offsets)


def lpt_steps(costs: np.ndarray, steps: int, num_parts: int, equal_count: bool = False) -> list[Parts]:
    """``partition("lpt", ...)`` of each of ``steps`` equal slices of ``costs`` (a step's samples each), the same
    parts, in one compiled call: several steps planned at once pay no Python call a step (``BatchPlanner``)."""
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    n = costs.size // steps
    if n * steps != costs.size:
        raise ValueError(f"{costs.size} costs are not {steps} steps of equal size")
    index, offsets, bad = balance_kernels.lpt_refined_steps(
        costs, steps, num_parts, equal_count, *_lpt_settings(n, num_parts), np.ones(num_parts))
    if bad >= 0:  # (named within its step, as a plan of that step alone names it)
        _raise_if_bad(costs[bad - bad % n:], bad % n)
    parts = [Parts(index[j * n:(j + 1) * n], offsets[j]) for j in range(steps)]
    if n >= num_parts and (offsets[:, 1:] > offsets[:, :-1]).all():  # (every part of every step holds a sample)
        return parts
    return [fill_empty(costs[j * n:(j + 1) * n], part) for j, part in enumerate(parts)]


def _lpt_settings(samples: int, num_parts: int) -> tuple[int, int, float, float, float, float, int, int]:
    """``lpt_refined``'s arguments between ``equal_count`` and ``speeds`` for ``samples`` over ``num_parts``."""
    return (4 * num_parts + 64, LPT_REFINE_PARTNERS, LPT_RESOLUTION, LPT_TOLERANCE, LPT_HEAD_SHARE,
            LPT_TAIL_TOLERANCE if num_parts > LPT_TAIL_TOLERANCE_FROM_PARTS else LPT_TOLERANCE,
            -(-LPT_MAX_COUNT_SHARE * samples // max(num_parts, 1)), -(-LPT_COUNT_CEILING_SHARE * samples // max(num_parts, 1)))


def _raise_if_bad(costs: np.ndarray, bad: int) -> None:
    if bad >= 0:
        raise ValueError(f"sample {bad} has cost {float(costs[bad])}: costs must be finite and >= 0, with a "
                         f"finite sum")


def checked_capacities(capacities: np.ndarray | list[float], num_parts: int) -> np.ndarray:
    """``capacities`` as speeds for ``num_parts`` parts, scaled to a mean of 1 (float64); one line naming the
    first bad entry if any is not finite and positive, or if there are not ``num_parts`` of them."""
    speeds = np.asarray(capacities, dtype=np.float64).ravel()
    if speeds.size != num_parts:
        raise ValueError(f"capacities: {speeds.size} given for {num_parts} parts (one per rank, in the live ranks' order)")
    bad = np.flatnonzero(~(np.isfinite(speeds) & (speeds > 0)))
    if bad.size:
        raise ValueError(f"capacities: entry {int(bad[0])} is {float(speeds[bad[0]])}: each must be finite and > 0")
    return np.ascontiguousarray(speeds / speeds.mean())


def time_imbalance(costs: np.ndarray, parts: Parts, capacities: np.ndarray | None) -> float:
    """``max_part(time) / proportional time``, time = cost / capacity: 1.0 is a split in proportion to the
    parts' speeds (``imbalance`` when every capacity is equal)."""
    return load_time_imbalance(parts.sums(costs), capacities)


def load_time_imbalance(loads: np.ndarray, capacities: np.ndarray | None) -> float:
    """``time_imbalance`` of the parts' cost ``loads``."""
    if capacities is None:
        return load_imbalance(loads)
    speeds = checked_capacities(capacities, loads.size)
    total = loads.sum()
    return float((loads / speeds).max() / total * speeds.sum()) if total > 0 else 1.0


def time_lower_bound(costs: np.ndarray, num_parts: int, capacities: np.ndarray | None) -> float:
    """``lower_bound`` in time: the heaviest sample on the fastest part, over the proportional time."""
    if capacities is None:
        return lower_bound(costs, num_parts)
    speeds = checked_capacities(capacities, num_parts)
    total = costs.sum()
    if total <= 0 or costs.size == 0:
        return 1.0
    return max(1.0, float(costs.max()) / float(speeds.max()) / total * float(speeds.sum()))


def check_size(name: str, samples: int, num_parts: int, equal_count: bool) -> None:
    """Refuse, in one line, a batch partitioner ``name`` cannot hold (``kk``: one k-vector per sample)."""
    if name not in ("kk", "token_kk"):
        return
    cells = (-(-samples // num_parts) if equal_count else samples) * num_parts
    if cells > KK_MAX_CELLS:
        raise ValueError(f"partitioner '{name}' would keep {cells:,} cells ({samples:,} samples x {num_parts:,} "
                         f"parts) over its limit of {KK_MAX_CELLS:,}: use 'lpt' (as balanced, and fast at any size)")


def kk(costs: np.ndarray, num_parts: int, equal_count: bool = False) -> Parts:
    n, k = costs.size, num_parts
    check_size("kk", n, k, equal_count)
    if n == 0:
        return Parts.of_owner(np.zeros(0, dtype=np.int64), k)
    order = np.argsort(-costs, kind="stable")
    # Each partial solution: k subsets as linked lists (head, tail, sum).
    # ``nxt`` links samples; -1 ends a list; an empty subset has head -1.
    nxt = np.full(n, -1, dtype=np.int64)
    partials: list[tuple[float, int, np.ndarray, np.ndarray, np.ndarray]] = []
    if equal_count:
        padded = -(-n // k) * k
        for g, start in enumerate(range(0, padded, k)):
            members = order[start : start + k]
            heads = np.full(k, -1, dtype=np.int64)
            heads[: members.size] = members
            sums = np.zeros(k)
            sums[: members.size] = costs[members]
            partials.append((-(sums.max() - sums.min()), g, heads, heads.copy(), sums))
    else:
        for g, i in enumerate(order):
            heads = np.full(k, -1, dtype=np.int64)
            heads[0] = i
            sums = np.zeros(k)
            sums[0] = costs[i]
            partials.append((-float(costs[i]), g, heads, heads.copy(), sums))
    heapq.heapify(partials)
    tiebreak = len(partials)
    while len(partials) > 1:
        _, _, heads_a, tails_a, sums_a = heapq.heappop(partials)
        _, _, heads_b, tails_b, sums_b = heapq.heappop(partials)
        desc, asc = np.argsort(-sums_a, kind="stable"), np.argsort(sums_b, kind="stable")
        ha, ta, hb, tb = heads_a[desc], tails_a[desc], heads_b[asc], tails_b[asc]
        link = (ta >= 0) & (hb >= 0)
        nxt[ta[link]] = hb[link]
        heads = np.where(ha >= 0, ha, hb)
        tails = np.where(tb >= 0, tb, ta)
        sums = sums_a[desc] + sums_b[asc]
        heapq.heappush(partials, (-(sums.max() - sums.min()), tiebreak, heads, tails, sums))
        tiebreak += 1
    _, _, heads, _, _ = partials[0]
    owner = np.empty(n, dtype=np.int64)
    for part, head in enumerate(heads.tolist()):
        while head >= 0:
            owner[head] = part
            head = int(nxt[head])
    return Parts.of_owner(owner, k)


def fill_empty(costs: np.ndarray, parts: Parts) -> Parts:
    """Give every part at least one sample (when there are enough): a rank with an
    empty batch would still have to join every collective, for nothing."""
    if parts.sizes.min(initial=1) > 0 or costs.size < len(parts):
        return parts
    moved = list(parts)
    while True:
        empty = [i for i, p in enumerate(moved) if p.size == 0]
        donor = max(range(len(moved)), key=lambda i: moved[i].size)
        if not empty or moved[donor].size < 2:
            return Parts.of_list(moved)
        lightest = int(np.argmin(costs[moved[donor]]))
        moved[empty[0]] = moved[donor][lightest : lightest + 1]
        moved[donor] = np.delete(moved[donor], lightest)


PARTITIONERS: dict[str, Partitioner] = {"round_robin": round_robin, "lpt": lpt, "kk": kk, "token_kk": kk}
"""Name -> function.  ``token_kk`` is ``kk`` given token counts instead of costs (see ``weights_for``)."""


def weights_for(name: str, costs: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """What partitioner ``name`` balances: token counts for ``token_kk`` (``lengths`` needed), costs otherwise."""
    if name != "token_kk":
        return costs
    if lengths is None:
        raise ValueError("partitioner 'token_kk' balances token counts: pass the samples' lengths")
    return lengths.astype(np.float64)


def partition(name: str, costs: np.ndarray, lengths: np.ndarray | None, num_parts: int,
              equal_count: bool = False, capacities: np.ndarray | None = None) -> Parts:
    """Run partitioner ``name``; every part non-empty when there are enough samples.  ``capacities`` (one per
    part: its speed) balance the parts' times instead of their costs: ``lpt`` only."""
    if name not in PARTITIONERS:
        raise ValueError(f"unknown partitioner '{name}' (have: {', '.join(PARTITIONERS)})")
    if capacities is not None:
        if name != "lpt":
            raise ValueError(f"partitioner '{name}' does not plan by rank speed (capacities): use 'lpt'")
        return fill_empty(costs, lpt(costs, num_parts, equal_count, capacities))
    parts = PARTITIONERS[name](weights_for(name, costs, lengths), num_parts, equal_count)
    return fill_empty(costs, parts)
