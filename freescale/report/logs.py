"""A run's logs, read for the report: every group's JSONL events and the kills the run left behind.

A run directory holds ``train_log.jsonl`` (one group, no fault tolerance) or
``replica<g>/train_log.jsonl`` per replica group (``freescale/run_log.py``: one format), and,
where ``FREESCALE_FAULTS`` killed a rank, ``replica<g>/rank<r>.killed`` holding the kill's wall
time (``freescale/testing.py``).  Bad input is one ``ReportError`` line naming the file (and
line): a missing directory, no log, a line that is not a JSON object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ReportError(ValueError):
    """The run directory cannot be reported on (one line naming the file)."""


@dataclass(frozen=True)
class Kill:
    group: int
    rank: int
    time: float


@dataclass
class GroupLog:
    """One replica group's events, in file order (every incarnation appends to the same file)."""

    group: int
    path: Path
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in kinds]

    @property
    def commits(self) -> list[dict[str, Any]]:
        return self.of("commit")

    @property
    def catch_ups(self) -> list[dict[str, Any]]:
        return [e["catch_up"] for e in self.of("catch_up") if isinstance(e.get("catch_up"), dict)]


@dataclass
class RunLogs:
    root: Path
    groups: list[GroupLog]
    kills: list[Kill]

    @property
    def fault_tolerant(self) -> bool:
        return len(self.groups) > 1 or any("quorum_id" in c for g in self.groups for c in g.commits)

    @property
    def t0(self) -> float:
        """The earliest event time: the report's time axis starts there."""
        times = [e["time"] for g in self.groups for e in g.events if isinstance(e.get("time"), (int, float))]
        return min(times) if times else 0.0


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    events = []
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read ({exc.strerror})") from None
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path}:{i}: not a JSON line ({exc.msg})") from None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise ReportError(f"{path}:{i}: not a log event (a JSON object with an 'event' field)")
        if not isinstance(event.get("time", 0.0), (int, float)):
            raise ReportError(f"{path}:{i}: 'time' is not a number")
        events.append(event)
    return events


def _kills(root: Path) -> list[Kill]:
    found = []
    for path in sorted(root.glob("replica*/rank*.killed")):
        try:
            group, rank = int(path.parent.name[len("replica"):]), int(path.stem[len("rank"):])
            found.append(Kill(group, rank, float(path.read_text().strip())))
        except (ValueError, OSError):
            raise ReportError(f"{path}: expected the kill's wall time (a number)") from None
    return sorted(found, key=lambda k: k.time)


def read_run(root: Path) -> RunLogs:
    """Every group's log under ``root`` (``replica<g>/`` or the run's own ``train_log.jsonl``)."""
    if not root.is_dir():
        raise ReportError(f"{root}: no such run directory")
    paths = sorted(root.glob("replica*/train_log.jsonl"), key=lambda p: p.parent.name)
    groups = []
    for path in paths:
        suffix = path.parent.name[len("replica"):]
        if suffix.isdigit():
            groups.append(GroupLog(int(suffix), path, _read_jsonl(path)))
    if not groups and (root / "train_log.jsonl").is_file():
        groups = [GroupLog(0, root / "train_log.jsonl", _read_jsonl(root / "train_log.jsonl"))]
    if not groups:
        raise ReportError(f"{root}: no train_log.jsonl (nor replica<g>/train_log.jsonl): not a run's output_dir")
    groups.sort(key=lambda g: g.group)
    if not any(g.commits for g in groups):
        raise ReportError(f"{groups[0].path}: no committed step logged yet")
    return RunLogs(root, groups, _kills(root))
