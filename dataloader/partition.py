"""Split one batch of per-sample costs into per-rank parts (FreeScale technique 1).

Every partitioner has the signature ``(costs, num_parts, equal_count) -> parts``:
``costs`` is a float64 array with one entry per sample, ``parts`` a list of
``num_parts`` int64 index arrays into ``costs`` that together are a permutation
of ``range(len(costs))``.  Every rank calls the same function on the same
costs and gets the same answer, so no sample ever crosses the network.

- ``round_robin``: sample i to part i mod k; what "split by sample count" does.
- ``lpt``: greedy longest-processing-time first: heaviest sample to the lightest part.
- ``kk``: Karmarkar-Karp largest differencing, k-way: repeatedly merge the two
  partial solutions whose spread (max - min part) is largest, pairing the
  heaviest part of one with the lightest of the other.
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
from collections.abc import Callable

import numpy as np

Partitioner = Callable[[np.ndarray, int, bool], list[np.ndarray]]


def imbalance(costs: np.ndarray, parts: list[np.ndarray]) -> float:
    """``max_part(cost) / mean_part(cost)``; 1.0 is perfect (DESIGN.md "imbalance")."""
    loads = np.array([costs[p].sum() for p in parts])
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def lower_bound(costs: np.ndarray, num_parts: int) -> float:
    """``max(1, max_sample / mean_part)``: no partition of this batch does better."""
    total = costs.sum()
    if total <= 0 or costs.size == 0:
        return 1.0
    return max(1.0, float(costs.max()) / (total / num_parts))


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
    return max(1.0, float(loads.max()) / (total / k))


def round_robin(costs: np.ndarray, num_parts: int, equal_count: bool = False) -> list[np.ndarray]:
    return [np.arange(p, costs.size, num_parts, dtype=np.int64) for p in range(num_parts)]


def lpt(costs: np.ndarray, num_parts: int, equal_count: bool = False) -> list[np.ndarray]:
    order = np.argsort(-costs, kind="stable")
    n = costs.size
    owner = np.empty(n, dtype=np.int64)
    if num_parts >= n:
        owner[order] = np.arange(n)
        return _groups(owner, num_parts)
    # The first k samples open the k parts; after that the heap decides.
    owner[order[:num_parts]] = np.arange(num_parts)
    heap = [(float(costs[order[p]]), p) for p in range(num_parts)]
    heapq.heapify(heap)
    capacity = -(-n // num_parts) if equal_count else n
    counts = [1] * num_parts
    ordered_costs = costs[order].tolist()
    ordered_index = order.tolist()
    replace, pop = heapq.heapreplace, heapq.heappop
    for i in range(num_parts, n):
        load, part = heap[0]
        owner[ordered_index[i]] = part
        counts[part] += 1
        if counts[part] < capacity:
            replace(heap, (load + ordered_costs[i], part))
        else:
            pop(heap)
    return _groups(owner, num_parts)


def kk(costs: np.ndarray, num_parts: int, equal_count: bool = False) -> list[np.ndarray]:
    n, k = costs.size, num_parts
    if n == 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(k)]
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
    return _groups(owner, k)


def _groups(owner: np.ndarray, num_parts: int) -> list[np.ndarray]:
    """Index arrays per part from an owner-per-sample array (indices ascending)."""
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(num_parts + 1))
    return [order[bounds[p] : bounds[p + 1]] for p in range(num_parts)]


def fill_empty(costs: np.ndarray, parts: list[np.ndarray]) -> list[np.ndarray]:
    """Give every part at least one sample (when there are enough): a rank with an
    empty batch would still have to join every collective, for nothing."""
    parts = list(parts)
    while True:
        empty = [i for i, p in enumerate(parts) if p.size == 0]
        donor = max(range(len(parts)), key=lambda i: parts[i].size)
        if not empty or parts[donor].size < 2:
            return parts
        lightest = int(np.argmin(costs[parts[donor]]))
        parts[empty[0]] = parts[donor][lightest : lightest + 1]
        parts[donor] = np.delete(parts[donor], lightest)


PARTITIONERS: dict[str, Partitioner] = {"round_robin": round_robin, "lpt": lpt, "kk": kk, "token_kk": kk}
"""Name -> function.  ``token_kk`` is ``kk`` given token counts instead of costs (see ``weights_for``)."""


def weights_for(name: str, costs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """What partitioner ``name`` balances: token counts for ``token_kk``, costs otherwise."""
    return lengths.astype(np.float64) if name == "token_kk" else costs


def partition(name: str, costs: np.ndarray, lengths: np.ndarray, num_parts: int, equal_count: bool = False) -> list[np.ndarray]:
    """Run partitioner ``name``; every part non-empty when there are enough samples."""
    if name not in PARTITIONERS:
        raise ValueError(f"unknown partitioner '{name}' (have: {', '.join(PARTITIONERS)})")
    parts = PARTITIONERS[name](weights_for(name, costs, lengths), num_parts, equal_count)
    return fill_empty(costs, parts)
