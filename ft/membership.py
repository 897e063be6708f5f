"""Membership and quorum rules of the lighthouse (``ft/lighthouse.py``): which groups are
healthy, when a quorum forms, how a commit vote settles.

The lighthouse's HTTP handlers feed it requests and hand its answers back; this part decides,
and holds the state the decisions are made on (groups, joins, the quorum, votes).  The
protocol itself is described in ``ft/lighthouse.py``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LighthouseConfig:
    bind: str = "127.0.0.1:0"
    """host:port for HTTP; port 0 picks a free one."""
    min_replicas: int = 1
    join_timeout_s: float = 1.0
    heartbeat_timeout_s: float = 1.0
    """A crash is found faster (failure reports); this catches hangs, and must exceed the longest
    time a loaded machine can keep a rank's heartbeat thread off the CPU."""
    token: str = ""
    """When set, every request must carry ``Authorization: Bearer <token>``."""
    max_request_bytes: int = 64 * 1024
    store_port: int = 0
    """Port of the rendezvous TCPStore (0: a free one)."""
    tick_s: float = 0.01
    suspect_grace_s: float = 0.15
    """After a failure report, how long a suspect participant has to show it is alive (a
    heartbeat: clients send one every 50 ms) before a quorum forms without it."""
    quorum_in_vote: bool = True
    """A committed vote's reply carries the next step's quorum when it is the steady-state
    answer, so a participant's next quorum request is not sent at all (one request per step
    per rank instead of two; see ``/v1/commit``)."""

    def validate(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"lighthouse: min_replicas must be >= 1, got {self.min_replicas}")
        if self.join_timeout_s < 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("lighthouse: join_timeout_s must be >= 0 and heartbeat_timeout_s > 0")
        host, _, port = self.bind.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"lighthouse: bind must be host:port, got '{self.bind}'")


class BadRequest(Exception):
    pass


@dataclass
class _Group:
    replica_id: str
    incarnation: int
    group_size: int
    beats: dict[int, float] = field(default_factory=dict)
    suspect_since: float | None = None

    def last_beat(self) -> float:
        """The *least* recent member's last sign of life (0 while a member has never shown one).

        A group is the unit of failure: one dead or hung rank stops all of it (its peers
        block in the group's own collectives), so the group is as alive as its
        stalest member, whose heartbeat thread a healthy peer's does not vouch for."""
        return min((self.beats.get(m, 0.0) for m in range(self.group_size)), default=0.0)

    def healthy(self, now: float, timeout: float) -> bool:
        last = self.last_beat()
        if self.suspect_since is not None and last <= self.suspect_since:
            return False
        return now - last <= timeout


@dataclass
class _Join:
    incarnation: int
    since: float
    steps: dict[int, int] = field(default_factory=dict)
    addresses: dict[int, str] = field(default_factory=dict)
    waiters: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)


@dataclass
class _Vote:
    quorum_id: int
    participants: dict[str, tuple[int, int]]
    """replica_id -> (incarnation, group_size)."""
    ballots: dict[tuple[str, int], bool] = field(default_factory=dict)
    waiters: list[asyncio.Future[bool]] = field(default_factory=list)
    result: bool | None = None


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    if name not in body:
        raise BadRequest(f"missing field '{name}'")
    value = body[name]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise BadRequest(f"field '{name}' must be {kind.__name__}, got {type(value).__name__}")
    return value


class Membership:
    """The lighthouse's state and decisions (no I/O: the server calls these and replies)."""

    def __init__(self, cfg: LighthouseConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.groups: dict[str, _Group] = {}
        self.joins: dict[str, _Join] = {}
        self.quorum: dict[str, Any] | None = None
        self.quorum_id = 0
        self.votes: dict[tuple[int, int], _Vote] = {}
        self.steady_steps: dict[tuple[int, int], bool] = {}
        self.run_id: str | None = None
        """The run being served (``run_id`` of the requests; ``freescale launch`` makes one per run)."""
        self.high_step = -1
        """Highest step any quorum reached: a quorum below it has lost the job's progress."""
        self.finished_step: int | None = None
        """Set when a group finished the run: later quorum requests are told so (a group restarted
        after the others finished must not train alone from step 0)."""

    def _lost(self, quorum: dict[str, Any], now: float) -> bool:
        """A collective of ``quorum`` cannot complete: a failure was reported, or a participant is
        unhealthy (hung or dead: no heartbeat within the timeout) or was restarted."""
        return bool(quorum.get("broken")) or any(
            (g := self.groups.get(p["replica_id"])) is None or g.incarnation != p["incarnation"]
            or not g.healthy(now, self.cfg.heartbeat_timeout_s)
            for p in quorum["participants"])

    # ------------------------------------------------------------------ decisions
    def _steady_answer(self, group: _Group, step: int) -> dict[str, Any] | None:
        """The steady-state fast path: answer at once, without waiting for the other participants.

        Taken when the caller is in the current, unbroken quorum, every
        participant is healthy and no healthy outsider is waiting to join.  The
        choice is made once per (quorum, step), by the first request of that
        step, and every participant's request for the step follows it, so all
        of them use the same quorum.  A participant that died since is found
        by the step's all-reduce (the survivors report it) or by its
        heartbeat; the commit vote still needs everyone.
        """
        q = self.quorum
        if q is None or q.get("broken"):
            return None
        if (group.replica_id, group.incarnation) not in {(p["replica_id"], p["incarnation"]) for p in q["participants"]}:
            return None
        key = (q["quorum_id"], step)
        steady = self.steady_steps.get(key)
        if steady is None:
            now = time.monotonic()
            healthy = self._healthy(now)
            members = {p["replica_id"] for p in q["participants"]}
            outsiders = [rid for rid in self.joins if rid not in members and rid in healthy]
            current = all(rid in self.groups and self.groups[rid].incarnation == p["incarnation"]
                          for rid, p in ((p["replica_id"], p) for p in q["participants"]))
            steady = current and members <= healthy and not outsiders and step == q["max_step"] + 1
            self.steady_steps[key] = steady
            if steady:
                q["max_step"] = step
                self.high_step = max(self.high_step, step)
                q["high_step"] = self.high_step
                q["participants"] = [{**p, "step": step} for p in q["participants"]]
            for old in [k for k in self.steady_steps if k[1] < step - 8]:
                del self.steady_steps[old]
        if not steady:
            return None
        return q

    def _healthy(self, now: float) -> set[str]:
        return {rid for rid, g in self.groups.items() if g.healthy(now, self.cfg.heartbeat_timeout_s)}

    def _awaiting_suspects(self, now: float) -> bool:
        """Suspects still inside their grace period: alive ones will heartbeat any moment."""
        return any(
            g.suspect_since is not None and g.last_beat() <= g.suspect_since
            and now - g.suspect_since < self.cfg.suspect_grace_s
            and now - g.last_beat() <= self.cfg.heartbeat_timeout_s
            for g in self.groups.values()
        )

    def _try_form(self, now: float) -> None:
        if self._awaiting_suspects(now):
            return  # forming now could leave out a live group that is merely suspect
        healthy = self._healthy(now)
        joined = {
            rid for rid, j in self.joins.items()
            if rid in healthy and j.incarnation == self.groups[rid].incarnation
            and len(j.steps) == self.groups[rid].group_size
        }
        if not joined:
            return
        previous: set[tuple[str, int]] = set()
        if self.quorum is not None and not self.quorum.get("broken"):
            previous = {(p["replica_id"], p["incarnation"]) for p in self.quorum["participants"]}
        if not self._keeps_majority(joined, now):
            return
        members = {(rid, self.groups[rid].incarnation) for rid in joined}
        if previous and members == previous:
            self._form(joined, new_id=False)
        elif healthy <= joined and len(joined) >= self.cfg.min_replicas:
            self._form(joined, new_id=True)
        else:
            first = min(self.joins[rid].since for rid in joined)
            if (now - first >= self.cfg.join_timeout_s and len(joined) >= self.cfg.min_replicas
                    and 2 * len(joined) > len(healthy)):
                self._form(joined, new_id=True)

    def _keeps_majority(self, joined: set[str], now: float) -> bool:
        """A new quorum must hold more than half of the previous quorum's participants that may
        still be alive (same incarnation, heartbeat within the timeout, suspect or not).

        So a lone group whose peers are merely slow to answer (a starved heartbeat
        thread, a long pause) cannot go on by itself and commit a step that the
        others then commit differently; a crashed group's share stops counting only
        when its heartbeat times out.  With three or more groups one crash leaves a
        majority at once; with two, the survivor waits for the heartbeat timeout.
        """
        if self.quorum is None:
            return True
        maybe_alive = {
            p["replica_id"] for p in self.quorum["participants"]
            if (g := self.groups.get(p["replica_id"])) is not None and g.incarnation == p["incarnation"]
            and now - g.last_beat() <= self.cfg.heartbeat_timeout_s
        }
        return not maybe_alive or 2 * len(maybe_alive & joined) > len(maybe_alive)

    def _form(self, joined: set[str], new_id: bool) -> None:
        if new_id or self.quorum is None:
            self.quorum_id += 1
        participants = [
            {"replica_id": rid, "incarnation": self.groups[rid].incarnation,
             "step": max(self.joins[rid].steps.values()),
             "addresses": [self.joins[rid].addresses.get(m, "") for m in range(self.groups[rid].group_size)]}
            for rid in sorted(joined)
        ]
        self.quorum = {
            "quorum_id": self.quorum_id, "participants": participants,
            "max_step": max(p["step"] for p in participants), "store": self.store_address,
            "high_step": self.high_step,
        }
        self.high_step = max(self.high_step, self.quorum["max_step"])
        self.steady_steps.clear()
        for rid in joined:
            join = self.joins.pop(rid)
            for waiter in join.waiters:
                if not waiter.done():
                    waiter.set_result(self.quorum)

    def _settle(self, vote: _Vote, now: float) -> None:
        if vote.result is not None:
            return
        if not all(vote.ballots.values()):
            vote.result = False
        else:
            for rid, (incarnation, group_size) in vote.participants.items():
                group = self.groups.get(rid)
                voted = sum(1 for (r, _) in vote.ballots if r == rid)
                if voted < group_size and (group is None or group.incarnation != incarnation
                                           or not group.healthy(now, self.cfg.heartbeat_timeout_s)):
                    vote.result = False
                    break
            else:
                expected = sum(size for _, size in vote.participants.values())
                if len(vote.ballots) == expected:
                    vote.result = True
        if vote.result is not None:
            if not vote.result and self.quorum is not None and self.quorum["quorum_id"] == vote.quorum_id:
                # Everyone drops the quorum's process groups: the next one gets a new id (and store
                # prefix), even with the same members, so no rendezvous reads this one's keys.
                self.quorum["broken"] = True
            for waiter in vote.waiters:
                if not waiter.done():
                    waiter.set_result(vote.result)
