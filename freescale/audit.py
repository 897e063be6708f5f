"""The invariants of a fault-tolerant run, checked from its audit log (``FREESCALE_AUDIT=1``).

With auditing on, every ``commit`` record carries the group's whole state hash and the rows the
step trained (``freescale.testing``).  After a run, from each group's
``replica<g>/train_log.jsonl`` (every incarnation appends to it):

- **one state per step**: every commit record of a step, in any group and incarnation, holds the
  same hash (a step committed twice with different states, or replicas that drifted apart, differ);
  with tables averaged across groups less often than every step (``[ft] average_every > 1``) the
  hash leaves the tables out, and the slice each step averaged must hold one hash too;
- **every sample exactly once**: the rows trained over all steps plus the rows still carried at
  the end are exactly the rows of the planned global batches, none twice, none missing;
- **no step discarded**: every step ``0 .. steps - 1`` was committed by some group.

The fault-tolerance tests and ``benchmarks/bench_chaos.py`` use the same checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


def group_logs(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each group's events (its rank 0 writes them; the digest is the whole group's), by group index.
    Lines a killed writer left truncated are skipped."""
    found: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("replica*/train_log.jsonl")):
        events = []
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        found[int(path.parent.name[len("replica"):])] = events
    return found


def commits_by_step(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in events if e.get("event") == "commit"}


def planned_rows(data: Path, model: str, replicas: int, ranks: int, steps: int, batch_size: int = 32) -> np.ndarray:
    """Rows of global batches 0 .. steps-1, sorted (what the run must train: each row once per epoch)."""
    from freescale.dataloader.build import DataConfig, build_loader
    from freescale.models import ModelConfig, cost_model_for

    cfg = DataConfig(path=str(data), batch_size=batch_size)
    loader = build_loader(cfg, "train", rank=0, world_size=replicas * ranks, sparse_features=[],
                          derived_cost=cost_model_for(ModelConfig(kind=model), 8),  # type: ignore[arg-type]  # the CLI's choices
                          seed=0, training=True)
    loader.close()
    size, per_epoch = loader.global_batch_size, loader.steps_per_epoch
    return np.sort(np.concatenate([loader.planner.order(s // per_epoch)[(s % per_epoch) * size:][:size]
                                   for s in range(steps)]))


@dataclass
class Audit:
    steps_committed: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def audit_run(out: Path, data: Path, model: str, replicas: int, ranks: int, steps: int,
              batch_size: int = 32) -> Audit:
    """The module docstring's checks over the run in ``out``; each broken invariant is one problem."""
    runs = group_logs(out)
    audit = Audit()
    if len(runs) != replicas:
        audit.problems.append(f"{len(runs)} group logs, expected {replicas}")
    per_group = [commits_by_step(events) for events in runs.values()]
    committed = set().union(*per_group) if per_group else set()
    audit.steps_committed = len(committed)
    missing = sorted(set(range(steps)) - committed)
    if missing:
        audit.problems.append(f"steps never committed: {missing[:10]}")
    # Every commit record counts, not one per group: a group committing a step twice (a roll-back
    # in one group) shows two records of it.
    for key, what in (("digest", "state"), ("slice_digest", "averaged table slice")):
        digests: dict[int, set[str]] = {}
        for events in runs.values():
            for e in events:
                if e.get("event") == "commit" and key in e:
                    digests.setdefault(e["step"], set()).add(e[key])
        differ = [s for s in sorted(digests) if len(digests[s]) > 1]
        if differ:
            audit.problems.append(f"{len(differ)} step(s) with more than one {what} across groups, first {differ[:5]}")
    trained_by_step: dict[int, list[int]] = {}
    for events in runs.values():
        for step, e in commits_by_step(events).items():
            if "rows" in e and trained_by_step.setdefault(step, sorted(e["rows"])) != sorted(e["rows"]):
                audit.problems.append(f"step {step}: groups disagree on the rows it trained")
    summaries = {g: [e for e in events if e.get("event") == "summary"] for g, events in runs.items()}
    unfinished = [g for g, s in summaries.items() if len(s) != 1]
    if unfinished:
        audit.problems.append(f"group(s) {unfinished} did not end with exactly one summary")
    pending = {row for events in runs.values() for e in events if e.get("event") == "summary"
               for _, _, rows in e["pending_rows"] for row in rows}
    trained = [row for rows in trained_by_step.values() for row in rows]
    got = np.sort(np.array(trained + sorted(pending), dtype=np.int64))
    expected = planned_rows(data, model, replicas, ranks, steps, batch_size)
    if got.size != expected.size or not np.array_equal(got, expected):
        audit.problems.append(f"{got.size} samples trained or pending, {expected.size} planned: "
                              "a sample was lost or trained twice")
    return audit
