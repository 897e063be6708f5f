"""Membership and quorum rules of the lighthouse (``ft/lighthouse.py``): which groups are
healthy, when a quorum forms, how a commit vote settles.

The lighthouse's HTTP handlers feed it requests and hand its answers back; this part decides,
and holds the state the decisions are made on (groups, joins, the quorum, votes).  The
protocol itself is described in ``ft/lighthouse.py``.

**A committed step is never committed again** (with another state), whatever fails at once.
Two rules keep it, and both hold across a restart of the lighthouse, because the facts they
read are durable (``freescale.ft.durable``: written before anyone is told):

- *holders*: the participants of the last quorum (replica id and incarnation) are the only
  groups that may hold the job's newest state.  Once any step has been reached, a quorum
  must include one of them.  While none can join, the others wait (``blocked``, said in one
  line) as long as one of them may still be alive (hung, stopped, partitioned, or not yet
  re-registered with a restarted lighthouse); once every one is gone for good (replaced by a
  newer incarnation of its group), the quorum is refused: the run's progress is lost, and
  only an operator restarting it from a checkpoint can go on.  A group restored from an
  older checkpoint therefore never commits steps the holders already committed.
- *majority*: a new quorum holds more than half of the previous quorum's groups that may
  still be alive; after a restart the previous quorum is the durable holders, and a holder
  not heard from yet counts as alive for one heartbeat timeout.

Quorum ids only grow (durable, and callers report the last id they saw).  Without a state
file the same facts are rebuilt from the groups' heartbeats, which carry each rank's last
quorum, step and whether it holds valid state: enough after a restart for every group that
is alive, not for one that is stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freescale.ft.durable import DurableState
from freescale.ft.membership_records import _Group, _Join, _Vote, fail_slow_entries, is_count, resolve

log = logging.getLogger("freescale.ft.lighthouse")


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
    body_timeout_s: float = 5.0
    """A request whose body has not fully arrived by then is answered 408 (its handler let go)."""
    tick_s: float = 0.01
    suspect_grace_s: float = 0.15
    """After a failure report, how long a suspect participant has to show it is alive (a
    heartbeat: clients send one every 50 ms) before a quorum forms without it."""
    max_beats_per_s: float = 2000.0
    """Heartbeats a second the lighthouse asks for at most: each reply says how often to beat
    (``beat_interval``), every 50 ms up to ``max_beats_per_s / 20`` groups, then more slowly (512
    groups: every 0.26 s), and the suspect grace grows with it (three intervals)."""
    state_path: str = ""
    """The durable state file (``freescale.ft.durable``); empty: none (a restart forgets the run,
    and the groups' heartbeats rebuild what they can)."""
    settle_s: float = 0.0
    """How long after start a lighthouse waits for live groups to re-register before it forms a
    first quorum or tells a new group that the run is fresh (no step reached).  0 suits a
    lighthouse that knows it is the run's first (started before any group, as ``freescale
    launch`` does) or that restores a state file; ``freescale lighthouse`` without ``--state``
    cannot tell a first start from a restart and waits one heartbeat timeout."""
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
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"lighthouse: bind must be host:port (a port up to 65535), got '{self.bind}'")
        if self.body_timeout_s <= 0 or self.max_request_bytes <= 0:
            raise ValueError("lighthouse: body_timeout_s and max_request_bytes must be > 0")
        if self.settle_s < 0:
            raise ValueError(f"lighthouse: settle_s must be >= 0, got {self.settle_s}")
        if self.max_beats_per_s <= 0:
            raise ValueError(f"lighthouse: max_beats_per_s must be > 0, got {self.max_beats_per_s}")


BEAT_INTERVAL_S = 0.05
"""How often a group's voice heartbeats while the lighthouse asks for no slower (``beat_interval``)."""

PROGRESS_LOST = "held the run's progress"
"""In the refusal of a quorum whose holders are all gone (``_progress_check``): the client turns it
into a final error (``freescale.ft.client.ProgressLost``)."""



class Membership:
    """The lighthouse's state and decisions (no I/O: the server calls these and replies; it
    persists ``durable`` whenever ``on_durable_change`` is called)."""

    def __init__(self, cfg: LighthouseConfig, restored: DurableState | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.groups: dict[str, _Group] = {}
        self.joins: dict[str, _Join] = {}
        self.quorum: dict[str, Any] | None = None
        self.votes: dict[tuple[int, int], _Vote] = {}
        self.steady_steps: dict[tuple[int, int], bool] = {}
        state = restored or DurableState()
        self.restored = restored is not None
        self.run_id: str | None = state.run_id
        """The run being served (``run_id`` of the requests; ``freescale launch`` makes one per run)."""
        self.quorum_id = state.quorum_id
        self.high_step = state.high_step
        """Highest step any quorum reached: a quorum below it has lost the job's progress."""
        self.finished_step: int | None = state.finished_step
        """Set when a group finished the run: later quorum requests are told so (a group restarted
        after the others finished must not train alone from step 0)."""
        self.holders: dict[str, int] = dict(state.holders)
        self.holders_quorum_id = state.holders_quorum_id
        self.blocked = ""
        """Why the groups waiting to join cannot form a quorum now ("" when they can; a holder of
        the run's progress may be alive: module docstring)."""
        self.on_durable_change: Callable[[], None] = lambda: None
        self.started = time.monotonic()
        self._members_of: tuple[dict[str, Any] | None, frozenset[tuple[str, int]]] = (None, frozenset())
        """(quorum, its participants' (replica id, incarnation)): ``_steady_answer``'s cache."""
        self.voices = 0
        """Heartbeating clients: one per group with an agent, one per rank otherwise (``beat_interval``)."""

    @property
    def durable(self) -> DurableState:
        return DurableState(self.run_id, self.quorum_id, self.high_step, self.finished_step,
                            self.holders_quorum_id, dict(self.holders))

    def settled(self, now: float) -> bool:
        """Long enough up that every live group has re-registered (``LighthouseConfig.settle_s``)."""
        return now - self.started >= self.cfg.settle_s

    def beat_interval(self) -> float:
        """How often each voice (a group's agent, or a rank that speaks for itself) should heartbeat,
        said in every heartbeat reply: 50 ms, or slower once that would exceed ``max_beats_per_s``;
        at most a quarter of the heartbeat timeout.  Recomputed by the ticker (``count_voices``)."""
        wanted = self.voices / self.cfg.max_beats_per_s
        return min(max(BEAT_INTERVAL_S, wanted), self.cfg.heartbeat_timeout_s / 4)

    def count_voices(self) -> None:
        self.voices = sum(1 if g.agent else g.group_size for g in self.groups.values())

    def suspect_grace(self) -> float:
        """How long a suspect has to show a sign of life: ``suspect_grace_s``, or three beat intervals
        when the lighthouse asks for slower beats."""
        return max(self.cfg.suspect_grace_s, 3 * self.beat_interval())

    def note_progress(self, group: _Group, body: dict[str, Any]) -> None:
        """A heartbeat's report of the rank's last committed quorum and next step (when it holds
        valid state): rebuilds a forgetful lighthouse's facts (module docstring).  Its ``fail_slow`` list (the
        job's fail-slow ranks, as the group judged them) is kept for ``/v1/status``."""
        reported = fail_slow_entries(body.get("fail_slow"))
        if reported is not None:
            group.fail_slow = reported
        quorum_id, step = body.get("quorum_id"), body.get("step")
        if not is_count(quorum_id) or body.get("ready") is not True:
            return  # (an id out of range would poison every later quorum, and the state file)
        if is_count(step):
            self.high_step = max(self.high_step, step)
        self.quorum_id = max(self.quorum_id, quorum_id)
        if quorum_id > self.holders_quorum_id:
            self.holders_quorum_id, self.holders = quorum_id, {group.replica_id: group.incarnation}
            self.on_durable_change()
        elif quorum_id == self.holders_quorum_id and self.holders.get(group.replica_id) != group.incarnation:
            self.holders[group.replica_id] = group.incarnation
            self.on_durable_change()

    def connection_lost(self, replica_id: str, incarnation: int) -> None:
        """A member's presence connection closed: its process is gone (``/v1/presence``)."""
        group = self.groups.get(replica_id)
        if group is None or group.incarnation != incarnation or self.finished_step is not None:
            return
        now = time.monotonic()
        if not group.silent_since_report():  # already silent since an earlier report: keep its grace running
            group.suspect_since = now
        group.presence_lost = True
        if self.quorum is not None and any(p["replica_id"] == replica_id for p in self.quorum["participants"]):
            self.quorum["broken"] = True  # its collectives cannot complete: the next quorum gets a new id
        for vote in self.votes.values():
            self._settle(vote, now)
        self._try_form(now)

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
        if self._members_of[0] is not q:  # (replica id, incarnation) of each participant, once per quorum
            self._members_of = (q, frozenset((p["replica_id"], p["incarnation"]) for p in q["participants"]))
        if (group.replica_id, group.incarnation) not in self._members_of[1]:
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

    def joiners_waiting(self, step: int) -> tuple[bool, tuple[tuple[str, int], ...]]:
        """(whether a healthy group of the current incarnation outside the quorum waits to join it behind ``step``,
        those of them that join by waiting with their ranks, sorted).  Their first quorum will be the next one and
        they will fetch the state of ``step`` from a participant, which stages it when its commit answer says so
        (``"stage": true``); the waiting ones train the next step, into which every group's data side plans them
        (``"joining"``)."""
        if not self.joins or self.quorum is None:
            return False, ()
        members = {p["replica_id"] for p in self.quorum["participants"]}
        healthy = self._healthy(time.monotonic())
        behind = sorted(rid for rid, join in self.joins.items() if rid not in members and rid in healthy
                        and join.incarnation == self.groups[rid].incarnation and join.steps
                        and min(join.steps.values()) <= step)
        return bool(behind), tuple((rid, self.groups[rid].group_size) for rid in behind if self.joins[rid].waits)

    def _healthy(self, now: float) -> set[str]:
        return {rid for rid, g in self.groups.items() if g.healthy(now, self.cfg.heartbeat_timeout_s)}

    def _awaiting_suspects(self, now: float) -> bool:
        """Suspects still inside their grace period: alive ones will heartbeat any moment."""
        grace = self.suspect_grace()
        return any(
            g.silent_since_report() and now - g.suspect_since < grace  # type: ignore[operator]
            and now - g.last_beat() <= self.cfg.heartbeat_timeout_s
            for g in self.groups.values()
        )

    def _try_form(self, now: float) -> None:
        if not self.joins:
            return  # nobody asks (the steady state): nothing to scan
        if self._awaiting_suspects(now):
            return  # forming now could leave out a live group that is merely suspect
        if not self.settled(now):
            return  # a restarted lighthouse without a state file: let every live group report first
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
        verdict, why = self._progress_check(joined)
        if verdict != "ok":
            self._turn_away(joined, {"waiting" if verdict == "wait" else "refused": why})
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

    def _progress_check(self, joined: set[str]) -> tuple[str, str]:
        """(``ok`` | ``wait`` | ``refuse``, why): may ``joined`` form a quorum without committing again
        steps that the holders of the run's progress committed (module docstring)?"""
        if not self.holders or any(self.holders.get(rid) == self.groups[rid].incarnation for rid in joined):
            return "ok", ""
        top = max(max(self.joins[rid].steps.values()) for rid in joined)
        maybe_alive = sorted(rid for rid, inc in self.holders.items()
                             if (g := self.groups.get(rid)) is None or g.incarnation <= inc)
        reached = f"at least step {self.high_step}" if self.high_step >= 0 else "a step"
        start = f"at step {top}" if top > 0 else "from an older state"
        if maybe_alive:
            return "wait", (f"waiting for replica group(s) {', '.join(maybe_alive)}: they hold the run's newest state "
                            f"(it reached {reached}) and may be alive (hung, stopped or cut off); a quorum of "
                            f"{', '.join(sorted(joined))} would start again {start} and commit steps twice. "
                            "If they are gone for good, stop the job and start it again with --resume (a new run, "
                            "from the newest checkpoint)")
        return "refuse", (f"every replica group that {PROGRESS_LOST} (it reached {reached}) is gone, so no "
                          f"one can catch up from it; a quorum of {', '.join(sorted(joined))} would start again "
                          f"{start}: start the job again with --resume (a new run, from the newest checkpoint)")

    def _turn_away(self, joined: set[str], answer: dict[str, Any]) -> None:
        """Answer the joined groups' pending quorum requests with ``answer`` and forget their joins:
        a group told to wait joins again when it asks again (a quorum never counts a group that has
        no request open), a refused one stops."""
        why = next(iter(answer.values()))
        if why != self.blocked:
            log.warning("lighthouse: %s", why)
        self.blocked = why
        for rid in joined:
            resolve(self.joins.pop(rid).waiters, answer)

    def _keeps_majority(self, joined: set[str], now: float) -> bool:
        """A new quorum must hold more than half of the previous quorum's participants that may
        still be alive (``_maybe_alive``); after a lighthouse restart the previous quorum is the
        durable holders.

        So a lone group whose peers are merely slow to answer (a starved heartbeat
        thread, a long pause) cannot go on by itself and commit a step that the
        others then commit differently; a crashed group's share stops counting when
        its heartbeat times out, or sooner when its presence connection closed and
        it showed no sign of life through the suspect grace.
        With three or more groups one crash leaves a majority at once; with two, the
        survivor goes on after that grace.
        """
        if self.quorum is not None:
            previous = {p["replica_id"]: p["incarnation"] for p in self.quorum["participants"]}
        else:
            previous = self.holders
        maybe_alive = {rid for rid, inc in previous.items() if self._maybe_alive(rid, inc, now)}
        return not maybe_alive or 2 * len(maybe_alive & joined) > len(maybe_alive)

    def _commit_holders(self, vote: _Vote) -> None:
        """A step committed: the groups that hold valid state after it (every member voted
        ``ready``) are the holders now; durable before any voter is told."""
        ready = {rid: inc for rid, (inc, size) in vote.participants.items() if vote.ready.get(rid, 0) == size}
        if ready and (ready != self.holders or self.holders_quorum_id != vote.quorum_id):
            self.holders, self.holders_quorum_id = ready, vote.quorum_id
            self.on_durable_change()

    def _maybe_alive(self, replica_id: str, incarnation: int, now: float) -> bool:
        """Same incarnation, not reported gone, and a sign of life within the heartbeat timeout
        (in a lighthouse's first timeout, not heard from yet counts: it may be re-registering)."""
        group = self.groups.get(replica_id)
        if group is not None and (group.incarnation != incarnation or group.gone(now, self.suspect_grace())):
            return False
        if now - self.started <= self.cfg.heartbeat_timeout_s:
            return True
        return group is not None and now - group.last_beat() <= self.cfg.heartbeat_timeout_s

    def _form(self, joined: set[str], new_id: bool) -> None:
        if new_id or self.quorum is None:
            self.quorum_id += 1
        participants: list[dict[str, Any]] = [
            {"replica_id": rid, "incarnation": self.groups[rid].incarnation,
             "step": max(self.joins[rid].steps.values()),
             "addresses": [self.joins[rid].addresses.get(m, "") for m in range(self.groups[rid].group_size)]}
            for rid in sorted(joined)
        ]
        store = next((self.joins[rid].store for rid in sorted(joined) if self.joins[rid].store), "")
        self.quorum = {
            "quorum_id": self.quorum_id, "participants": participants,
            "max_step": max(p["step"] for p in participants), "store": store,
            "high_step": self.high_step,
        }
        self.high_step = max(self.high_step, self.quorum["max_step"])
        self.blocked = ""
        self.on_durable_change()  # the quorum id, durable before any participant is told
        self.steady_steps.clear()
        for rid in joined:
            resolve(self.joins.pop(rid).waiters, self.quorum)

    def _settle(self, vote: _Vote, now: float, scan: bool = True) -> None:
        """Decide ``vote`` if it can be: no as soon as a ballot says no or a participant that has not
        voted fully is unhealthy (``scan``: looked for by the ticker and on failure evidence, not on
        every ballot), yes once every member voted."""
        if vote.result is not None:
            return
        if vote.said_no:
            vote.result = False
        elif len(vote.ballots) == vote.expected:
            vote.result = True
        elif scan:
            for rid, (incarnation, group_size) in vote.participants.items():
                group = self.groups.get(rid)
                if vote.voted.get(rid, 0) < group_size and (group is None or group.incarnation != incarnation
                                                            or not group.healthy(now, self.cfg.heartbeat_timeout_s)):
                    vote.result = False
                    break
        if vote.result is not None:
            self._decided(vote)

    def _decided(self, vote: _Vote) -> None:
        """``vote.result`` is set: a yes makes its holders; a no breaks its quorum; its ballots are answered."""
        if vote.result:
            self._commit_holders(vote)
        elif self.quorum is not None and self.quorum["quorum_id"] == vote.quorum_id:
            # Everyone drops the quorum's process groups: the next one gets a new id (and store
            # prefix), even with the same members, so no rendezvous reads this one's keys.
            self.quorum["broken"] = True
        resolve(vote.waiters, vote.result)
