"""A run's logs, read for the report: every group's JSONL events and the kills the run left behind.

A run directory holds ``train_log.jsonl`` (one group, no fault tolerance) or
``replica<g>/train_log.jsonl`` per replica group (``freescale/run_log.py``: one format), and,
where ``FREESCALE_FAULTS`` killed a rank, ``rank<r>.killed`` holding the kill's wall time
(``freescale/testing.py``) beside its group's log (``replica<g>/``, or the run directory itself).

What a real directory can hold, and what the reader does with it (each is a line in
``RunLogs.notes``, shown on the page):

- **a writer killed mid-line**: a SIGKILL can leave a truncated line, and the restarted
  incarnation appends its first event to it.  Such lines are skipped and counted (the appended
  event is recovered), up to one per incarnation of the group plus one; more garbled lines than
  killed writers can leave, or a file with no event at all, is not a log: one ``ReportError``;
- **several runs in one output_dir** (the log is opened in append mode): a fresh start
  (incarnation 0, not resumed) begins a new run; only the last run is reported, and a group or a
  kill file older than it is left out;
- **a long run**: past ``THIN_ABOVE`` commits (or log windows) per group, every k-th is kept for
  the figures, plus every commit that marks something (a redo, a quorum change, a recovering step,
  the first and the last): a 10^6-step run reads in seconds and renders at once.

Every event the report uses is checked for the fields it reads, by kind (``FIELDS``): a missing or
mistyped one is one ``ReportError`` naming ``file:line`` and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

THIN_ABOVE = 5_000
"""Commits (and log windows) per group kept whole; past it, every k-th (k doubling) plus the notable ones."""

NUM, INT, BOOL, DICT, LIST = "a number", "an integer", "true or false", "an object", "a list"
NUM_OR_NULL, INT_OR_NULL = "a number or null", "an integer or null"
FIELDS: dict[str, dict[str, tuple[str, bool]]] = {
    # kind: field -> (type, required); an optional field may be absent, null only where the type says so
    "commit": {"step": (INT, True), "seconds": (NUM, False), "batch_wait_s": (NUM, False), "samples": (NUM, False),
               "weight": (NUM, False), "attempts": (INT, False), "contributing": (BOOL, False),
               "participants": (LIST, False), "quorum_id": (INT, False)},
    "step": {"step": (INT, True), "loss": (NUM_OR_NULL, False), "auc": (NUM_OR_NULL, False),
             "imbalance": (NUM_OR_NULL, False), "bubble": (NUM_OR_NULL, False)},
    "start": {"incarnation": (INT, False), "start_step": (INT, False), "world_size": (INT, False),
              "config": (DICT, False), "pid": (INT_OR_NULL, False)},
    "catch_up": {"catch_up": (DICT, True)},
    "catch_up.catch_up": {"started": (NUM, False), "group_ready": (NUM, False), "finished": (NUM, False),
                          "bytes": (NUM, False), "bytes_per_s": (NUM, False), "joined_step": (INT_OR_NULL, False),
                          "snapshot_step": (INT_OR_NULL, False), "replayed": (INT_OR_NULL, False)},
    "fail_slow": {"step": (INT, True), "group": (INT, False), "rank": (INT, True), "share": (NUM, False)},
    "fail_slow_recovered": {"step": (INT, True), "group": (INT, False), "rank": (INT, True)},
    "checkpoint": {"step": (INT, True)},
    "calibrate": {"step": (INT, True)},
    "eval": {"auc": (NUM_OR_NULL, False)},
    "validate": {"step": (INT, True)},
    "validation_decision": {"step": (INT, True), "best_step": (INT, False)},
    "summary": {"samples_per_s": (NUM_OR_NULL, False), "train_loss": (NUM_OR_NULL, False),
                "train_auc": (NUM_OR_NULL, False)},
}
USED = {kind for kind in FIELDS if "." not in kind}
"""Event kinds the report reads; others (``stage``, ``warm_up``, ...) are counted and dropped."""


class ReportError(ValueError):
    """The run directory cannot be reported on (one line naming the file)."""


@dataclass(frozen=True)
class Kill:
    group: int
    rank: int
    time: float


@dataclass
class GroupLog:
    """One replica group's events of the reported run, in file order (every incarnation appends
    to the same file); commits and log windows possibly thinned (``stride`` > 1)."""

    group: int
    path: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    total_commits: int = 0
    recovering_commits: int = 0
    """Commits with ``contributing`` false (the group caught up or recovered, weight 0)."""
    stride: int = 1
    """Every ``stride``-th commit is kept (1: all), plus the notable ones."""
    garbled: list[int] = field(default_factory=list)
    """Line numbers of truncated/garbled lines skipped (killed writers)."""
    earlier_runs: int = 0

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in kinds]

    @property
    def commits(self) -> list[dict[str, Any]]:
        return self.of("commit")

    @property
    def catch_ups(self) -> list[dict[str, Any]]:
        return [e["catch_up"] for e in self.of("catch_up")]

    def sizes(self) -> list[tuple[int, int]]:
        """The group's size over time: (ranks, the first step it committed at that size) for each incarnation
        that committed one, in order, changes only (``[ft] on_rank_loss = "shrink"``: a group that lost a rank
        runs on fewer)."""
        out: list[tuple[int, int]] = []
        ranks = None
        for e in self.events:
            if e.get("event") == "start":
                ranks = int(e.get("world_size", 1))
            elif e.get("event") == "commit" and ranks is not None:
                if not out or out[-1][0] != ranks:
                    out.append((ranks, int(e["step"])))
                ranks = None
        return out

    @property
    def last_time(self) -> float:
        return max((e["time"] for e in self.events), default=float("-inf"))


@dataclass
class RunLogs:
    root: Path
    groups: list[GroupLog]
    kills: list[Kill]
    notes: list[str] = field(default_factory=list)
    """What the reader skipped or thinned (shown on the page)."""

    @property
    def fault_tolerant(self) -> bool:
        return len(self.groups) > 1 or any("quorum_id" in c for g in self.groups for c in g.commits)

    def fail_slow(self) -> list[dict[str, Any]]:
        """The run's ``fail_slow`` and ``fail_slow_recovered`` verdicts, once each (every replica group logs the
        job's verdicts alike), in step order."""
        seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        for g in self.groups:
            for e in g.of("fail_slow", "fail_slow_recovered"):
                seen.setdefault((e["event"], e["step"], e.get("group", 0), e["rank"]), e)
        return sorted(seen.values(), key=lambda e: (e["step"], e["event"]))

    @property
    def t0(self) -> float:
        """The earliest event time: the report's time axis starts there."""
        times = [e["time"] for g in self.groups for e in g.events]
        return min(times) if times else 0.0


def fail_slow_line(e: dict[str, Any]) -> str:
    """One verdict in words (the report's event table, the job summary)."""
    where = f"rank {e['rank']}" + (f" on {e['host']}" if e.get("host") else "")
    if e["event"] == "fail_slow_recovered":
        return f"{where} back to speed at step {e['step']}"
    share = e.get("share")
    return (f"{where} fail-slow at step {e['step']}" + (f": {share:.2f} of the median rank's speed" if share else "")
            + (f" (slow_policy {e['policy']})" if e.get("policy") else ""))

# ----- one file ------------------------------------------------------------------------------------
_TYPES = {NUM: (int, float), NUM_OR_NULL: (int, float, type(None)), INT: (int,), INT_OR_NULL: (int, type(None)),
          BOOL: (bool,), DICT: (dict,), LIST: (list,)}


def _is(value: Any, kind: str) -> bool:
    return type(value) in _TYPES[kind]  # exact types: true is not a number, 1.0 not an integer


NOTABLE = {"attempts": FIELDS["commit"]["attempts"], "contributing": FIELDS["commit"]["contributing"],
           "participants": FIELDS["commit"]["participants"]}
"""What deciding whether a commit is kept reads (a thinned-out commit is checked for these only)."""


def _check(event: dict[str, Any], kind: str, where: str, prefix: str = "",
           fields: dict[str, tuple[str, bool]] | None = None) -> None:
    for name, (expected, required) in (fields or FIELDS[kind]).items():
        if name not in event:
            if required:
                raise ReportError(f"{where}: {event['event']} event has no '{prefix}{name}' ({expected})")
        elif type(event[name]) not in _TYPES[expected]:
            raise ReportError(f"{where}: {event['event']} event's '{prefix}{name}' is {event[name]!r}, not {expected}")


def _event(line: str) -> tuple[Any, bool]:
    """(the line's JSON, False), or for a line that is not JSON (a writer killed mid-line) the
    event a restarted writer appended to it: (that event or None, True)."""
    try:
        return json.loads(line), False
    except json.JSONDecodeError:
        pass
    at = line.find('{"event"', 1)
    while at > 0:
        try:
            return json.loads(line[at:]), True
        except json.JSONDecodeError:
            at = line.find('{"event"', at + 1)
    return None, True


class _Thin:
    """Keeps every ``stride``-th of a stream plus the notable items, ``stride`` doubling whenever
    more than ``THIN_ABOVE`` plain items are kept."""

    def __init__(self) -> None:
        self.stride, self.seen, self.plain = 1, 0, 0

    def keep(self, notable: bool) -> bool:
        self.seen += 1
        if notable:
            return True
        if (self.seen - 1) % self.stride:
            return False
        self.plain += 1
        return True

    def full(self) -> bool:
        return self.plain > THIN_ABOVE

    def double(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Drop every other plain item kept so far (``_n``: its position in the stream)."""
        self.stride *= 2
        kept = [e for e in items if e.get("_notable") or e["_n"] % self.stride == 0]
        self.plain = sum(1 for e in kept if not e.get("_notable"))
        return kept


def _fresh_start(event: dict[str, Any]) -> bool:
    """A new run (not a restarted incarnation, not a resume of the same run)."""
    return event["event"] == "start" and not event.get("incarnation") and not event.get("start_step")


def read_group(group: int, path: Path) -> GroupLog:
    """The last run in ``path``; see the module docstring for what is tolerated."""
    log = GroupLog(group, path)
    events: list[dict[str, Any]] = []
    thin = {"commit": _Thin(), "step": _Thin()}
    previous: dict[str, Any] | None = None
    last_commit: dict[str, Any] | None = None
    last_where = ""
    starts, parsed = 0, 0
    try:  # bytes that are not UTF-8 (a disk error, a binary write) make their line garbled, like any other garbage
        fh = path.open(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ReportError(f"{path}: cannot read ({exc.strerror})") from None
    with fh:
        for i, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            event, garbled = _event(line)
            if garbled:
                log.garbled.append(i)
                if event is None:
                    continue
            where = f"{path}:{i}"
            if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                raise ReportError(f"{where}: not a log event (a JSON object with an 'event' field)")
            if not _is(event.get("time"), NUM):
                raise ReportError(f"{where}: 'time' is {event.get('time')!r}, not a number")
            parsed += 1
            kind = event["event"]
            if kind not in USED:
                continue
            if kind not in thin:  # commits and windows: checked once kept (a thinned-out one is never read)
                _check(event, kind, where)
            if kind == "catch_up":
                _check({**event["catch_up"], "event": "catch_up"}, "catch_up.catch_up", where, "catch_up.")
            if kind == "start":
                starts += 1
                if _fresh_start(event) and events:
                    log.earlier_runs += 1
                    events, previous, last_commit = [], None, None
                    thin = {"commit": _Thin(), "step": _Thin()}
                    log.total_commits = log.recovering_commits = 0
            if kind == "commit":
                _check(event, kind, where, fields=NOTABLE)
                log.total_commits += 1
                log.recovering_commits += event.get("contributing", True) is False
                notable = (previous is None or event.get("attempts", 1) > 1
                           or event.get("contributing", True) != previous.get("contributing", True)
                           or event.get("participants") != previous.get("participants"))
                previous, last_commit, last_where = event, event, where
            else:
                notable = kind != "step"
            if kind in thin:
                event["_n"], event["_notable"] = thin[kind].seen, notable
                if not thin[kind].keep(notable):
                    continue
                _check(event, kind, where)
                if thin[kind].full():
                    kept = {id(e) for e in thin[kind].double([e for e in events if e["event"] == kind])}
                    events = [e for e in events if e["event"] != kind or id(e) in kept]
            events.append(event)
    if not parsed:
        if log.garbled:
            raise ReportError(f"{path}:{log.garbled[0]}: not a JSON line (no log event in the file)")
        raise ReportError(f"{path}: empty log")
    if len(log.garbled) > starts + 1:
        raise ReportError(f"{path}:{log.garbled[0]}: not a JSON line ({len(log.garbled)} garbled lines: more than "
                          f"killed writers leave, one per incarnation ({starts}) plus one)")
    if last_commit is not None and last_commit is not next(
            (e for e in reversed(events) if e["event"] == "commit"), None):  # thinned out: the last is kept too
        _check(last_commit, "commit", last_where)
        events.append(last_commit)
    log.events, log.stride = events, thin["commit"].stride
    return log


# ----- the run -------------------------------------------------------------------------------------
def _kills(root: Path) -> list[Kill]:
    found = []
    for path in sorted([*root.glob("rank*.killed"), *root.glob("replica*/rank*.killed")]):
        try:
            group = 0 if path.parent == root else int(path.parent.name[len("replica"):])
            found.append(Kill(group, int(path.stem[len("rank"):]), float(path.read_text().strip())))
        except (ValueError, OSError):
            raise ReportError(f"{path}: expected the kill's wall time (a number)") from None
    return sorted(found, key=lambda k: k.time)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def read_run(root: Path) -> RunLogs:
    """Every group's log under ``root`` (``replica<g>/`` or the run's own ``train_log.jsonl``)."""
    if not root.is_dir():
        raise ReportError(f"{root}: no such run directory")
    groups = [read_group(int(p.parent.name[len("replica"):]), p)
              for p in sorted(root.glob("replica*/train_log.jsonl"), key=lambda p: p.parent.name)
              if p.parent.name[len("replica"):].isdigit()]
    if not groups and (root / "train_log.jsonl").is_file():
        groups = [read_group(0, root / "train_log.jsonl")]
    if not groups:
        raise ReportError(f"{root}: no train_log.jsonl (nor replica<g>/train_log.jsonl): not a run's output_dir")
    groups.sort(key=lambda g: g.group)
    notes = []
    for g in groups:
        name = g.path.relative_to(root)
        if g.earlier_runs:
            notes.append(f"{name} holds {_plural(g.earlier_runs + 1, 'run')} (the output_dir was reused): the last "
                         "is reported")
        if g.garbled:
            notes.append(f"{name}: {_plural(len(g.garbled), 'truncated line')} skipped (a writer killed mid-line), "
                         f"line(s) {', '.join(map(str, g.garbled[:5]))}{' ...' if len(g.garbled) > 5 else ''}")
        if g.stride > 1:
            notes.append(f"{name}: {g.total_commits:,} commits; the figures show every {g.stride}th, plus every "
                         "redo, quorum change and recovering step")
    starts = [min((e["time"] for e in g.of("start")), default=None) for g in groups]
    begun = max((s for s in starts if s is not None), default=None)
    if begun is not None:  # a group whose whole log ends before the last run began is from an earlier run
        old = [g for g in groups if g.last_time < begun]
        if old and len(old) < len(groups):
            notes.append(f"{', '.join(str(g.path.relative_to(root)) for g in old)}: from an earlier run in this "
                         "output_dir (ends before the last run began): left out")
            groups = [g for g in groups if g not in old]
    if not any(g.commits for g in groups):
        raise ReportError(f"{groups[0].path}: no committed step logged yet")
    kills = _kills(root)
    first = min((e["time"] for g in groups for e in g.events), default=0.0)
    stale = [k for k in kills if k.time < first]
    if stale:
        notes.append(f"{_plural(len(stale), 'kill file')} older than the reported run left out (an earlier run's)")
        kills = [k for k in kills if k.time >= first]
    return RunLogs(root, groups, kills, notes)
