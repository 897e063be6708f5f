"""What the lighthouse knows of each replica group, each join and each commit vote, and the
request-field checks its rules and handlers share (``freescale.ft.membership`` decides on them).

A group is as alive as its stalest member (``_Group.last_beat``); a failure report makes the
other participants *suspect* until a sign of life that cannot have been in flight before the
report (``IN_FLIGHT_S``); a vote counts its ballots per group as they come, so it settles in
O(1) per ballot.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, TypeGuard

IN_FLIGHT_S = 0.05
"""A heartbeat read this soon after a failure report may have been sent before it (by a rank that
has died since): not a sign of life.  Each member beats every 50 ms, so a live group's slowest
member has the rest of the suspect grace (0.1 s, two beats) to show one that counts; a loaded
machine that misses it costs that group a catch-up, never a wrong commit."""


def resolve(waiters: list[asyncio.Future[Any]], value: Any) -> None:
    """Answer every pending request in ``waiters`` with ``value`` (an exception is raised there)."""
    for waiter in waiters:
        if not waiter.done():
            if isinstance(value, BaseException):
                waiter.set_exception(value)
            else:
                waiter.set_result(value)
    waiters.clear()


def fail_slow_entries(value: Any) -> list[dict[str, Any]] | None:
    """A heartbeat's ``fail_slow`` list (the job's fail-slow ranks: ``freescale.speed_share``), checked: each entry
    an integer ``group``, ``rank`` and ``step``, a number ``share`` and a string ``host``; the first 64 kept.  None
    if it is absent or malformed (the last good report stays: a status never shows a malformed one)."""
    if not isinstance(value, list):
        return None
    out = []
    for entry in value[:64]:
        if not isinstance(entry, dict):
            return None
        ints, share, host = [entry.get(k) for k in ("group", "rank", "step")], entry.get("share"), entry.get("host")
        if any(type(v) is not int for v in ints) or not isinstance(host, str):
            return None
        if not isinstance(share, (int, float)) or isinstance(share, bool):
            return None
        out.append({"group": ints[0], "rank": ints[1], "step": ints[2], "share": float(share), "host": host[:64]})
    return out


class BadRequest(Exception):
    pass


@dataclass
class _Group:
    replica_id: str
    incarnation: int
    group_size: int
    beats: dict[int, float] = field(default_factory=dict)
    suspect_since: float | None = None
    """When a peer reported a failed collective with this group; a sign of life counts against it
    only from ``IN_FLIGHT_S`` later (a beat a dead rank sent just before it died may be read after
    the report)."""
    _stalest: float | None = None
    agent: bool = False
    """It speaks through a group agent (``freescale.ft.group_agent``): one voice for all its members."""
    fail_slow: list[dict[str, Any]] = field(default_factory=list)
    """The job's fail-slow ranks as this group's last heartbeat reported them (``freescale.speed_share``: every
    group reaches the same verdicts), shown by ``/v1/status``."""
    presence_lost: bool = False
    """A member's presence connection closed (its process is gone: ``/v1/presence``): with no sign of
    life during the suspect grace, the group no longer counts as maybe alive for the majority rule
    (a two-group job goes on without the heartbeat timeout)."""

    members: list[int] = field(init=False)
    """Every member index, in order (a ballot for the whole group lists exactly these); never changed."""

    def __post_init__(self) -> None:
        self.members = list(range(self.group_size))

    def gone(self, now: float, grace: float) -> bool:
        """Its presence connection closed and it stayed silent through the suspect grace since."""
        return self.presence_lost and self.silent_since_report() and now - self.suspect_since >= grace  # type: ignore[operator]

    def silent_since_report(self) -> bool:
        """Suspect, and no sign of life since the report (beats in flight then not counted)."""
        return self.suspect_since is not None and self.last_beat() <= self.suspect_since + IN_FLIGHT_S

    def beat(self, member: int, at: float) -> None:
        """A sign of life of ``member`` at ``at`` (monotonic seconds; an older one changes nothing)."""
        if at > self.beats.get(member, 0.0):
            self.beats[member] = at
            self._stalest = None

    def last_beat(self) -> float:
        """The *least* recent member's last sign of life (0 while a member has never shown one).

        A group is the unit of failure: one dead or hung rank stops all of it (its peers
        block in the group's own collectives), so the group is as alive as its
        stalest member, whose heartbeat thread a healthy peer's does not vouch for.  Kept
        until a beat changes it (the ticker asks for every group every tick)."""
        if self._stalest is None:
            self._stalest = min((self.beats.get(m, 0.0) for m in range(self.group_size)), default=0.0)
        return self._stalest

    def healthy(self, now: float, timeout: float) -> bool:
        last = self.last_beat()
        if self.silent_since_report():
            return False
        return now - last <= timeout


@dataclass
class _Join:
    incarnation: int
    since: float
    steps: dict[int, int] = field(default_factory=dict)
    addresses: dict[int, str] = field(default_factory=dict)
    store: str = ""
    """Member 0's rendezvous store (``host:port``; ``freescale.ft.replica_group``)."""
    waits: bool = False
    """It joins by waiting (``[ft] join = "wait"``, said in its request): the vote before names it as joining."""
    waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)


@dataclass
class _Vote:
    quorum_id: int
    step: int
    participants: dict[str, tuple[int, int]]
    """replica_id -> (incarnation, group_size)."""
    ballots: dict[tuple[str, int], bool] = field(default_factory=dict)
    voted: dict[str, int] = field(default_factory=dict)
    """Ballots per group (counted as they come: a vote settles in O(1) per ballot)."""
    ready: dict[str, int] = field(default_factory=dict)
    """Ballots per group cast holding valid state (not catching up)."""
    said_no: bool = False
    hint: tuple[bool, tuple[tuple[str, int], ...]] | None = None
    """(a group waits to join behind this step, those of them that join by waiting with their ranks), taken when the
    vote was first answered committed: every answer of the vote says the same (``Membership.joiners_waiting``;
    the sources stage the step, the data side plans the waiting ones into the next)."""
    waiters: list[asyncio.Future[bool]] = field(default_factory=list)
    listeners: list[Any] = field(default_factory=list)
    """Ballots whose carrier answers them itself once the vote is decided (the lighthouse's agent links:
    one task answers them all, ``Lighthouse._answer_links``), each with the one waiter in ``waiters``."""
    result: bool | None = None

    def cast(self, replica_id: str, members: list[int], ok: bool, ready: bool) -> None:
        """One ballot for each of ``members`` of group ``replica_id``; a retried one counts once."""
        counted = 0
        for member in members:
            if (replica_id, member) not in self.ballots:
                self.ballots[(replica_id, member)] = ok
                counted += 1
        self.voted[replica_id] = self.voted.get(replica_id, 0) + counted
        self.ready[replica_id] = self.ready.get(replica_id, 0) + counted * int(ready)
        self.said_no = self.said_no or (counted > 0 and not ok)

    expected: int = 0
    """Ballots that make it unanimous (every member of every participant), counted once."""

    def __post_init__(self) -> None:
        self.expected = sum(size for _, size in self.participants.values())


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    if name not in body:
        raise BadRequest(f"missing field '{name}'")
    value = body[name]
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise BadRequest(f"field '{name}' must be {kind.__name__}, got {type(value).__name__}")
    return value


_COUNTS = 2**53
"""Steps, quorum ids and incarnations are below this (the integers JSON carries exactly, and an int64's range)."""


def is_count(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is a step, quorum id or incarnation: a whole number in ``[0, 2**53)``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _COUNTS


def _count(body: dict[str, Any], name: str, default: int | None = None) -> int:
    """A step, quorum id or incarnation: a whole number in ``[0, 2**53)``; ``default`` where it is absent or null
    (else it is required): ``BadRequest`` naming the field otherwise, never a 500 from deeper down."""
    if body.get(name) is None and default is not None:
        return default
    value: int = _field(body, name, int)
    if not is_count(value):
        raise BadRequest(f"field '{name}' must be a whole number in [0, 2**53), got {value}")
    return value
