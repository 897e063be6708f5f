"""Reading a comm trace (``comm_trace_rank<R>.jsonl``, written by ``freescale.comm_trace``): events
back as ``CommEvent``, each put in a category (embedding forward/backward, input dist, dense
reduce), and the time the training thread was blocked in collectives, per step and category.

Across ranks, the C4 view (arXiv 2406.04594: a healthy job's collectives are periodic and homogeneous,
so the rank every other waits for stands out): the ranks of a process group issue its collectives in
the same order, so the k-th event of a group on every rank is one collective; the rank blocked least in
it arrived last, and the others waited for it about the difference (:func:`waited_for`)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path

from freescale.comm_trace import CommEvent


def read_jsonl(path: str | Path) -> list[CommEvent]:
    """Events written by :meth:`CommTracer.write_jsonl` (fields a trace lacks take their defaults)."""
    names = {f.name for f in dataclass_fields(CommEvent)}
    events = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            events.append(CommEvent(**{k: v for k, v in record.items() if k in names}))
    return events


CATEGORIES = ("emb_fwd", "emb_bwd", "input_dist", "dense_reduce", "other")
"""What :func:`category` sorts events into."""


def category(event: CommEvent) -> str:
    """What the collective is for, from op, dtype, phase and group:

    ``input_dist``: all-to-alls of integer tensors (ids, lengths, split sizes: torchrec's input dist);
    ``emb_fwd`` / ``emb_bwd``: floating-point all-to-alls in forward (embeddings out) / backward (their
    gradients back); ``dense_reduce``: floating-point all-reduces in backward or on the group labelled
    ``dense`` (DDP's buckets, ``BucketedGrads``); ``other``: the rest (metrics, step statistics, barriers).
    """
    op = event.op.removeprefix("functional.")
    floating = event.dtype.startswith(("float", "bfloat", "complex"))
    if op.startswith("all_to_all"):
        if not floating:
            return "input_dist"
        if event.phase == "forward":
            return "emb_fwd"
        if event.phase == "backward":
            return "emb_bwd"
        return "other"
    if op.startswith("all_reduce") and floating and (event.phase == "backward" or event.group == "dense"):
        return "dense_reduce"
    return "other"


def blocked_per_step(events: Iterable[CommEvent], key: Callable[[CommEvent], str] | None = None,
                     steps: Iterable[int] | None = None) -> dict[int, dict[str, float]]:
    """``{step: {key(event): seconds blocked}}`` (key defaults to :func:`category`; ``"total"`` always
    present), for the given steps (default: every step with an event).  Steps without any event in the
    given range count as 0."""
    key = key or category
    out: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    wanted = set(steps) if steps is not None else None
    for e in events:
        if wanted is not None and e.step not in wanted:
            continue
        out[e.step][key(e)] += e.blocked_s
        out[e.step]["total"] += e.blocked_s
    for s in wanted or ():
        out[s]["total"] += 0.0
    return {s: dict(v) for s, v in sorted(out.items())}


def summarize(events: Iterable[CommEvent],
              key: Callable[[CommEvent], str] | None = None) -> dict[str, dict[str, float]]:
    """Per ``key`` (default :func:`category`): ``count``, ``bytes``, ``blocked_s`` over all the events."""
    key = key or category
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0, "blocked_s": 0.0})
    for e in events:
        row = out[key(e)]
        row["count"] += 1
        row["bytes"] += e.bytes
        row["blocked_s"] += e.blocked_s
    return dict(out)


@dataclass
class WaitView:
    """Who the others waited for, over every collective matched across the ranks' traces (the C4 view)."""

    last: dict[int, int] = field(default_factory=dict)
    """Rank -> collectives it arrived at last (blocked least), counted where the ranks' blocked times differ."""
    waited_s: dict[int, float] = field(default_factory=dict)
    """Rank -> the time the others waited for it (per collective: the largest blocked time minus its own)."""
    collectives: int = 0
    """Collectives matched (the same group, op and position on every rank)."""
    unmatched: list[str] = field(default_factory=list)
    """Groups left out: their ranks' traces hold different numbers or kinds of collectives."""

    def slowest(self) -> int | None:
        """The rank the others waited for longest, or None with nothing measured."""
        return max(self.waited_s, key=lambda r: self.waited_s[r]) if self.waited_s else None


def waited_for(traces: dict[int, list[CommEvent]], min_gap_s: float = 1e-4) -> WaitView:
    """The C4 view of ranks' traces (rank -> its events, as ``read_jsonl`` gives them): each group's ``k``-th
    collective matched across the ranks that issued that group's collectives; a collective whose blocked
    times differ by less than ``min_gap_s`` (nobody waited) names no one."""
    view = WaitView()
    by_group: dict[str, dict[int, list[CommEvent]]] = defaultdict(dict)
    for rank, events in traces.items():
        for e in events:
            by_group[e.group].setdefault(rank, []).append(e)
    for group, per_rank in sorted(by_group.items()):
        lists = list(per_rank.values())
        if len(per_rank) < 2:
            continue
        if len({len(events) for events in lists}) > 1 or any(
                len({events[k].op for events in lists}) > 1 for k in range(len(lists[0]))):
            view.unmatched.append(group)
            continue
        ranks = list(per_rank)
        for k in range(len(lists[0])):
            blocked = [per_rank[r][k].blocked_s for r in ranks]
            view.collectives += 1
            gap = max(blocked) - min(blocked)
            if gap < min_gap_s:
                continue
            last = ranks[blocked.index(min(blocked))]
            view.last[last] = view.last.get(last, 0) + 1
            view.waited_s[last] = view.waited_s.get(last, 0.0) + gap
    return view


def read_traces(root: Path) -> dict[int, list[CommEvent]]:
    """Every ``comm_trace_rank<R>.jsonl`` directly in ``root`` (a run's output_dir), by rank."""
    found = {}
    for path in sorted(root.glob("comm_trace_rank*.jsonl")):
        rank = path.stem.removeprefix("comm_trace_rank")
        if rank.isdigit():
            found[int(rank)] = read_jsonl(path)
    return found
