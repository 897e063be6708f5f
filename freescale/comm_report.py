"""Reading a comm trace (``comm_trace_rank<R>.jsonl``, written by ``freescale.comm_trace``): events
back as ``CommEvent``, each put in a category (embedding forward/backward, input dist, dense
reduce), and the time the training thread was blocked in collectives, per step and category."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path

from freescale.comm_trace import CommEvent


def read_jsonl(path: str | Path) -> list[CommEvent]:
    """Events written by :meth:`CommTracer.write_jsonl` (fields a trace lacks take their defaults)."""
    names = {f.name for f in fields(CommEvent)}
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
