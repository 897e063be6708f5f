"""The lighthouse's requests, whatever carries them: HTTP from ranks, a WebSocket from group agents.

Each operation takes the request's JSON object and returns a ``Reply``: the status and the
answer's JSON text (text, so that a quorum tens of KB long is encoded once for everyone it
answers).  ``freescale.ft.lighthouse`` maps them to its routes and its agent socket; the
protocol is described there, the decisions live in ``freescale.ft.membership``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, NamedTuple

from aiohttp.http_exceptions import HttpProcessingError

from freescale.ft.durable import DurableState
from freescale.ft.membership import LighthouseConfig, Membership
from freescale.ft.membership_records import BadRequest, _count, _field, _Group, _Join, _Vote, resolve

Reply = tuple[int, str]
"""(HTTP status, JSON text) of one answer."""

_MAX_GROUP_RANKS = 1 << 20
"""The most ranks a replica group may say it has (the lighthouse keeps a list of its members)."""


class OneLineBadRequests(logging.Filter):
    """aiohttp logs a request it cannot parse (a malformed header, a garbage request line) with a traceback, after
    answering it 400: one line instead, so a scanner or a broken client does not fill the server's console."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and exc.code == 400:
            reason = (str(exc.message).strip().splitlines() or ["malformed"])[0]
            record.msg, record.args = f"{record.getMessage()}: answered 400 ({reason})", ()
            record.exc_info, record.exc_text = None, None
        return True


def quiet_bad_requests() -> None:
    """``OneLineBadRequests`` on aiohttp's server log (every freescale server in the process), once."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineBadRequests) for f in logger.filters):
        logger.addFilter(OneLineBadRequests())


class Conflict(Exception):
    """A pending quorum request that can no longer be answered for its group (a newer
    incarnation joined, a new run started): 409 with this text."""


def error(status: int, message: str) -> Reply:
    return status, json.dumps({"error": message})


OK: Reply = (200, '{"ok": true}')


def json_object(raw: bytes | str) -> dict[str, Any]:
    """A request's body (an HTTP request's, a link message's): a JSON object, or ``BadRequest`` saying why not."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def call_id(call: Any) -> int:
    """The id of a message on an agent's link, to answer it by; -1 where it has none that is an integer."""
    number = call.get("id") if isinstance(call, dict) else None
    return number if isinstance(number, int) and not isinstance(number, bool) else -1


class Pending(NamedTuple):
    """A ballot counted in a vote not decided yet (``LighthouseOps.cast_ballot``)."""
    vote: _Vote
    group: _Group


class LighthouseOps(Membership):
    """Request operations over ``Membership``'s state and decisions (module docstring)."""

    def __init__(self, cfg: LighthouseConfig, restored: DurableState | None = None) -> None:
        super().__init__(cfg, restored)
        self._encoded: tuple[tuple[Any, ...] | None, str] = (None, "")
        """(quorum key, its JSON): ``_quorum_text``'s one-entry cache."""
        self.lost_at_scan: tuple[int, bool] = (-1, False)
        """(quorum id, ``_lost``) as of the last scan of every group: what heartbeat replies say."""

    # ------------------------------------------------------------------ who is asking
    def member(self, body: dict[str, Any]) -> tuple[_Group | None, int, str]:
        """Record a sign of life from (replica, incarnation, member); returns (group, member, error)."""
        replica_id = _field(body, "replica_id", str)
        incarnation = _count(body, "incarnation")
        member = _field(body, "member", int)
        group_size = _field(body, "group_size", int)
        if not replica_id or len(replica_id) > 200:
            raise BadRequest("field 'replica_id' must be 1-200 characters")
        if not 1 <= group_size <= _MAX_GROUP_RANKS:
            raise BadRequest(f"field 'group_size' must be 1 to {_MAX_GROUP_RANKS} ranks, got {group_size}")
        if not 0 <= member < group_size:
            raise BadRequest(f"member {member} is outside a group of {group_size}")
        run_id = body.get("run_id", "")
        if not isinstance(run_id, str) or len(run_id) > 100:
            raise BadRequest("field 'run_id' must be a string of at most 100 characters")
        if run_id != self.run_id:
            now = time.monotonic()
            restoring = self.restored and now - self.started < self.cfg.heartbeat_timeout_s  # its groups re-register
            if (self.run_id is not None and self.finished_step is None
                    and (self._healthy(now) or not self.settled(now) or restoring)):
                return None, member, (f"this lighthouse serves run '{self.run_id}', which is still going; "
                                      f"start another lighthouse for run '{run_id}'")
            self._new_run(run_id)
        group = self.groups.get(replica_id)
        if group is not None and incarnation < group.incarnation:
            return None, member, (f"replica '{replica_id}' incarnation {incarnation} is stale "
                                  f"(current: {group.incarnation})")
        if group is None or incarnation > group.incarnation:
            group = _Group(replica_id, incarnation, group_size)
            self.groups[replica_id] = group
            stale = self.joins.pop(replica_id, None)
            if stale is not None:
                resolve(stale.waiters, Conflict("a newer incarnation of this replica joined"))
        if body.get("agent") is True:  # a group agent's beat carries its members' ages instead
            group.agent = True
        else:
            group.beat(member, time.monotonic())
        return group, member, ""

    def caller(self, body: dict[str, Any], known: tuple[str, int] | None) -> tuple[_Group | None, int, str]:
        """``member``, or at once the group an agent's link speaks for (``known``: its replica id and
        incarnation, checked at its hello) while that incarnation is still the group's."""
        if known is not None:
            group = self.groups.get(known[0])
            if group is not None and group.incarnation == known[1]:
                return group, 0, ""
        return self.member(body)

    def _new_run(self, run_id: str) -> None:
        """A new run (another ``freescale launch``) on a lighthouse whose previous run finished or
        died: forget its groups, quorum, votes and progress; quorum ids keep growing."""
        for join in self.joins.values():
            resolve(join.waiters, Conflict(f"a new run '{run_id}' started on this lighthouse"))
        self.run_id = run_id
        self.groups.clear()
        self.joins.clear()
        self._drop_votes(list(self.votes))
        self.steady_steps.clear()
        self.quorum = None
        self.high_step = -1
        self.finished_step = None
        self.holders, self.holders_quorum_id, self.blocked = {}, 0, ""
        self.on_durable_change()

    @staticmethod
    def _member_indices(body: dict[str, Any], name: str, group: _Group) -> list[int]:
        """A group agent's list of member indices (``members`` of a ballot, ``members_lost``)."""
        value = body[name]
        if value == group.members:  # a ballot for the whole group, as agents send it: nothing else to check (a
            return group.members    # list of bools or floats equal to it counts as it: its own list is used)
        if not isinstance(value, list) or not value or not all(
                isinstance(m, int) and not isinstance(m, bool) and 0 <= m < group.group_size for m in value):
            raise BadRequest(f"field '{name}' must list member indices below {group.group_size}")
        return value

    @staticmethod
    def _member_asks(body: dict[str, Any], group: _Group) -> list[dict[str, Any]]:
        """A group agent's quorum request: one ``{step, address}`` per member."""
        value = body["members"]
        if not isinstance(value, list) or len(value) != group.group_size or not all(
                isinstance(e, dict) and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool)
                and isinstance(e.get("address", ""), str) and len(e.get("address", "")) <= 300 for e in value):
            raise BadRequest(f"field 'members' must hold {group.group_size} {{step, address}} objects")
        return value

    # ------------------------------------------------------------------ operations
    def heartbeat(self, body: dict[str, Any], known: tuple[str, int] | None = None) -> Reply:
        group, _, why = self.caller(body, known)
        if group is None:
            return error(409, why)
        self._agent_beat(group, body)
        self.note_progress(group, body)
        q = self.quorum
        lost = q is not None and (bool(q.get("broken")) or self.lost_at_scan == (q["quorum_id"], True))
        current = q["quorum_id"] if q is not None else "null"
        return 200, (f'{{"ok": true, "quorum_id": {current}, "quorum_lost": {"true" if lost else "false"}, '
                     f'"beat_every_s": {self.beat_interval()}}}')

    def _agent_beat(self, group: _Group, body: dict[str, Any]) -> None:
        """A group agent's heartbeat (``freescale.ft.group_agent``): each member's age (seconds since
        it last beat to the agent; null: never) and the members whose presence connection closed."""
        ages, lost = body.get("member_ages_s"), body.get("members_lost")
        if ages is not None:
            if not isinstance(ages, list) or len(ages) != group.group_size or not all(
                    a is None or (isinstance(a, (int, float)) and not isinstance(a, bool) and a >= 0) for a in ages):
                raise BadRequest(f"field 'member_ages_s' must be {group.group_size} ages in seconds (or null)")
            now = time.monotonic()
            for member, age in enumerate(ages):
                if age is not None:
                    group.beat(member, now - age)
        if lost:
            self._member_indices(body, "members_lost", group)
            self.connection_lost(group.replica_id, group.incarnation)

    async def ask_quorum(self, body: dict[str, Any], known: tuple[str, int] | None = None) -> Reply:
        step, last_seen = _count(body, "step"), _count(body, "last_quorum_id", 0)
        group, member, why = self.caller(body, known)
        if group is None:
            return error(409, why)
        self.quorum_id = max(self.quorum_id, last_seen)
        if self.finished_step is not None:
            return 200, json.dumps(self._finished_answer())
        steady = self._steady_answer(group, step)
        if steady is not None:
            return 200, self._quorum_text(steady)
        join = self._join_of(group, member, step, body)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        join.waiters.append(waiter)
        if len(self.joins) >= len(self.groups):  # maybe everyone is in: decide now (else the next tick does,
            self._try_form(time.monotonic())      # not every request: one scan of all groups per request is O(n^2))
        try:
            answer = await waiter
        except Conflict as exc:
            return error(409, str(exc))
        if "refused" in answer:
            return error(409, answer["refused"])
        return 200, self._quorum_text(answer) if "participants" in answer else json.dumps(answer)

    def _join_of(self, group: _Group, member: int, step: int, body: dict[str, Any]) -> _Join:
        """Record the caller's join (a group agent's: every member's at once)."""
        join = self.joins.get(group.replica_id)
        if join is None or join.incarnation != group.incarnation:
            join = _Join(group.incarnation, time.monotonic())
            self.joins[group.replica_id] = join
        address, store = body.get("address", ""), body.get("store", "")
        for name, value in (("address", address), ("store", store)):
            if not isinstance(value, str) or len(value) > 300:
                raise BadRequest(f"field '{name}' must be a string of at most 300 characters")
        join.waits = body.get("join") == "wait"
        if "members" in body:
            for m, entry in enumerate(self._member_asks(body, group)):
                join.steps[m], join.addresses[m] = entry["step"], entry.get("address", "")
        else:
            join.steps[member], join.addresses[member] = step, address
        if member == 0:
            join.store = store
        return join

    def cast_ballot(self, body: dict[str, Any], known: tuple[str, int] | None = None) -> Reply | Pending:
        """A commit ballot's own part, synchronous: checked, counted, the vote settled if it can be.  The answer
        now (the vote was decided, or the ballot is refused), or ``Pending``: the vote still waits for others,
        and ``vote_answer`` answers this ballot once ``vote.result`` is set."""
        quorum_id, step = _count(body, "quorum_id"), _count(body, "step")
        ok = _field(body, "ok", bool)
        group, member, why = self.caller(body, known)
        if group is None:
            return error(409, why)
        vote = self.votes.get((quorum_id, step))
        if vote is None:
            if self.quorum is None or self.quorum["quorum_id"] != quorum_id:
                return 200, '{"commit": false, "reason": "quorum superseded"}'
            vote = _Vote(quorum_id, step, {p["replica_id"]: (p["incarnation"], self.groups[p["replica_id"]].group_size)
                                           for p in self.quorum["participants"] if p["replica_id"] in self.groups})
            self.votes[(quorum_id, step)] = vote
            self._drop_votes([k for k in self.votes if k[1] < step - 8])  # keep the table small
        if vote.result is None:
            expected = vote.participants.get(group.replica_id)
            if expected is None or expected[0] != group.incarnation:
                return 200, '{"commit": false, "reason": "not a participant of this quorum"}'
            ready = body.get("ready", True) is True
            vote.cast(group.replica_id, self._member_indices(body, "members", group) if "members" in body else [member],
                      ok, ready)
            self._settle(vote, time.monotonic(), scan=False)
        return Pending(vote, group) if vote.result is None else self.vote_answer(vote, group)

    def _drop_votes(self, keys: list[tuple[int, int]]) -> None:
        """Forget these votes; one still open is decided no first, so that no ballot waits for it forever."""
        for key in keys:
            vote = self.votes.pop(key)
            if vote.result is None:
                vote.result = False
                self._decided(vote)

    def vote_answer(self, vote: _Vote, group: _Group) -> Reply:
        """A decided vote's answer to ``group``'s ballot: no; yes, stage the step for a joiner; or yes with the
        next step's quorum when its participants stay the same (the voter then asks for no quorum)."""
        if not vote.result:
            return 200, '{"commit": false}'
        if vote.hint is None:  # decided once per vote: every answer says the same
            vote.hint = self.joiners_waiting(vote.step)
        stage, joining = vote.hint
        if joining:  # the sources stage this step now; the waiting joiners are planned into the next
            return 200, json.dumps({"commit": True, "stage": True, "joining": [list(j) for j in joining]})
        if stage:  # the sources stage this step now: the joiner asks for it at once
            return 200, '{"commit": true, "stage": true}'
        if self.cfg.quorum_in_vote and self.finished_step is None:
            following = self._steady_answer(group, vote.step + 1)
            if following is not None:  # the same participants: the voter has them (tens of KB at 512 groups)
                return 200, (f'{{"commit": true, "next": {{"quorum_id": {following["quorum_id"]}, '
                             f'"max_step": {following["max_step"]}, "high_step": {following["high_step"]}, '
                             '"same_participants": true}}')
        return 200, '{"commit": true}'

    async def commit(self, body: dict[str, Any], known: tuple[str, int] | None = None) -> Reply:
        """A commit ballot over HTTP: cast, then answered once every participant voted or one cannot."""
        cast = self.cast_ballot(body, known)
        if not isinstance(cast, Pending):
            return cast
        decided: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        cast.vote.waiters.append(decided)
        await decided
        return self.vote_answer(cast.vote, cast.group)

    def _quorum_text(self, quorum: dict[str, Any]) -> str:
        """``quorum`` as JSON, encoded once for all the participants it answers (at 512 groups the
        quorum is tens of KB: encoding it per answer would cost the lighthouse more than the rest)."""
        key = (id(quorum), quorum["quorum_id"], quorum["max_step"], quorum["high_step"], bool(quorum.get("broken")))
        if self._encoded[0] != key:
            self._encoded = (key, json.dumps(quorum))
        return self._encoded[1]

    def report(self, body: dict[str, Any]) -> Reply:
        quorum_id = _count(body, "quorum_id")
        reporter = _field(body, "replica_id", str)
        now = time.monotonic()
        if self.quorum is not None and self.quorum["quorum_id"] == quorum_id:
            # Its process groups are broken: the next quorum gets a new id even if
            # every participant turns out to be alive.
            self.quorum["broken"] = True
            for p in self.quorum["participants"]:
                group = self.groups.get(p["replica_id"])
                if group is not None and p["replica_id"] != reporter and not group.silent_since_report():
                    group.suspect_since = now  # (one already silent since an earlier report keeps its grace)
        reporter_group = self.groups.get(reporter)
        if reporter_group is not None:
            for m in list(reporter_group.beats):
                reporter_group.beat(m, now)
        for vote in self.votes.values():
            self._settle(vote, now)
        self._try_form(now)
        return OK

    def _finished_answer(self) -> dict[str, Any]:
        return {"finished": True, "finished_step": self.finished_step}

    def finish(self, body: dict[str, Any]) -> Reply:
        step = _count(body, "step")
        group, _, why = self.member(body)
        if group is None:
            return error(409, why)
        self.finished_step = max(step, self.finished_step if self.finished_step is not None else step)
        self.on_durable_change()
        for join in self.joins.values():
            resolve(join.waiters, self._finished_answer())
        self.joins.clear()
        for vote in self.votes.values():  # a vote still open cannot complete: its group went home
            if vote.result is None:
                vote.result = False
                resolve(vote.waiters, False)
        return OK

    def status(self) -> Reply:
        now = time.monotonic()
        return 200, json.dumps({
            "quorum_id": self.quorum_id,
            "quorum": self.quorum,
            "groups": {rid: {"incarnation": g.incarnation, "group_size": g.group_size,
                             "healthy": g.healthy(now, self.cfg.heartbeat_timeout_s),
                             "since_heartbeat_s": now - g.last_beat(), "fail_slow": g.fail_slow}
                       for rid, g in self.groups.items()},
            "joining": sorted(self.joins),
            "high_step": self.high_step,
            "holders": self.holders,
            "blocked": self.blocked,
            "settled": self.settled(now),
            "restored": self.restored,
            "finished_step": self.finished_step,
        })

    def scan(self, now: float) -> None:
        """The scans over every group, once per ``SCAN_EVERY_S`` (``Lighthouse._ticker``): the
        quorum's health for heartbeat replies, open votes' unhealthy participants, the voices
        that set the beat rate."""
        self.count_voices()
        if self.quorum is not None:
            self.lost_at_scan = (self.quorum["quorum_id"], self._lost(self.quorum, now))
        for vote in list(self.votes.values()):
            self._settle(vote, now)
