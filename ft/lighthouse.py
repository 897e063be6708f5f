"""The lighthouse: membership, per-step quorums and commit votes for replica groups.

A replica group (one torchrun job of ``group_size`` ranks, the unit of failure)
is known by ``replica_id`` and an ``incarnation`` number that grows each time
the group restarts.  Every rank of every group talks to the lighthouse over
HTTP (aiohttp server, JSON bodies of bounded size, optional shared token):

``POST /v1/heartbeat``  ``{replica_id, incarnation, member, group_size}``
    Sent every ~50 ms from a background thread of each rank.  A higher
    incarnation replaces the group's previous one (its pending requests fail);
    a lower one is refused (409): that process belongs to a dead incarnation.
    The reply says ``{quorum_id, quorum_lost}``: the current quorum, and
    whether a collective of it can no longer complete (a failure was reported,
    or a participant is unhealthy or restarted).  A rank blocked in a
    collective of that quorum (or of an older one) stops waiting and redoes
    the step with the survivors (``freescale.ft.replica_group``): a hung peer
    stalls the others for the heartbeat timeout, not the collective timeout.

``POST /v1/quorum``  ``{replica_id, incarnation, member, group_size, step, last_quorum_id, address}``
    Long-polls until a quorum that includes the caller's group forms, then
    returns ``{quorum_id, participants: [{replica_id, incarnation, step,
    addresses}], max_step, store: "host:port"}`` (``addresses``: each member's
    snapshot server, for catch-up).  A group has *joined* when all its
    members have asked.  A quorum forms:

    - steady state: the caller is in the current quorum, all its
      participants are healthy, nobody waits to join, and the step is the
      next one: answered at once, without waiting for the others (decided
      once per step, so all participants agree; see ``_steady_answer``);
    - fast path: the joined groups are exactly the previous quorum's
      (same incarnations): at once, same quorum id;
    - every healthy group has joined and there are at least ``min_replicas``:
      at once, new id;
    - ``join_timeout_s`` after the first group joined, if at least
      ``min_replicas`` joined *and* they are more than half of the healthy
      groups (the split-brain guard: two disjoint quorums cannot both hold a
      majority): new id.

    On every path a new quorum must also hold a majority of the previous
    quorum's groups that may still be alive (``_keeps_majority``).

    Quorum ids only grow, also across a lighthouse restart (callers report
    the last id they saw).  Participants are sorted by ``replica_id``, so
    every rank derives the same process-group ranks from the reply.

``POST /v1/commit``  ``{replica_id, incarnation, member, quorum_id, step, ok}``
    The commit vote of a step: resolves ``{commit: true}`` once every member
    of every participant voted ``ok``; ``{commit: false}`` as soon as one
    votes not ok, or a participant turns unhealthy before voting.  All
    replicas therefore commit exactly the same steps.  A committed reply also
    carries ``next``: the quorum of ``step + 1`` when it is the steady-state
    answer (decided then, as if the first participant had asked for it at that
    moment), so the client does not ask for it; absent otherwise (a group waits
    to join, someone is unhealthy, ...), and the client asks as usual.

``POST /v1/report``  ``{replica_id, quorum_id}``
    A rank saw a collective of ``quorum_id`` fail.  That quorum is broken (the
    next one gets a new id, so nobody reuses its process groups) and every
    other participant becomes *suspect*: healthy again only after a heartbeat
    (or request) that arrives after the report.  No quorum forms while a
    suspect is within ``suspect_grace_s`` (three heartbeat intervals) of the
    report, so a live group is never left out (which could let two quorums
    commit the same step); a dead group never answers, so the survivors form
    the next quorum after the grace instead of the heartbeat timeout.

``POST /v1/finish``  ``{replica_id, incarnation, member, step}``
    A group finished the run at ``step``.  From then on every quorum request
    is answered ``{finished: true, finished_step}``: a group restarted after
    the others finished stops instead of training alone from step 0.

Every quorum also carries ``high_step``, the highest step any earlier quorum
reached; a quorum whose ``max_step`` is below it holds none of the groups
that had that progress (all of them died), and its clients stop with an error
rather than silently start over.

Runs: every request may carry a ``run_id`` (``freescale launch`` makes one per
run).  A lighthouse that outlives a run serves the next one once the previous
finished or all its groups are gone (its state is then forgotten; quorum ids
keep growing); while the previous run is going, requests of another run are
refused (409) with a message saying so.

``GET /v1/status``  the membership, for operators and tests.

Health: a group is healthy while every member's last heartbeat (or request) is
younger than ``heartbeat_timeout_s`` and it is not suspect.  A SIGSTOPped
group stops heartbeating and is evicted by that timeout.

The lighthouse also hosts the ``TCPStore`` that the groups' fault-tolerant
all-reduce process groups rendezvous on (one key prefix per quorum id and
rank position, so a new quorum never reads an old one's keys).
"""

from __future__ import annotations

import asyncio
import socket
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from freescale.ft.serving import LoopThread, token_ok

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


class Lighthouse:
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
        self.store: Any = None
        self.store_address = ""
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._background = LoopThread("freescale-lighthouse")

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Serve on ``cfg.bind`` (and start the rendezvous store); returns the base URL."""
        from torch.distributed import TCPStore

        host, _, port = self.cfg.bind.rpartition(":")
        self.store = TCPStore(host, self.cfg.store_port, is_master=True, wait_for_workers=False)
        # Bound to every interface: advertise a name other hosts can reach (the groups connect to it).
        advertised = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
        self.store_address = f"{advertised}:{self.store.port}"
        app = web.Application(client_max_size=self.cfg.max_request_bytes, middlewares=[self._auth])
        app.router.add_post("/v1/heartbeat", self._heartbeat)
        app.router.add_post("/v1/quorum", self._quorum)
        app.router.add_post("/v1/commit", self._commit)
        app.router.add_post("/v1/report", self._report)
        app.router.add_post("/v1/finish", self._finish)
        app.router.add_get("/v1/status", self._status)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, int(port))
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{host}:{bound[1]}"
        self._tick_task = asyncio.get_running_loop().create_task(self._ticker())
        return self.url

    async def stop(self) -> None:
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        self.store = None

    def start_in_thread(self) -> str:
        """Run in a daemon thread of this process (demo, local launcher, tests); returns the URL."""
        return str(self._background.run(self.start, self.stop))

    def stop_thread(self) -> None:
        self._background.stop()

    # ------------------------------------------------------------------ http plumbing
    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not token_ok(request, self.cfg.token):
            return web.json_response({"error": "missing or wrong token"}, status=401)
        try:
            return await handler(request)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    def _member(self, body: dict[str, Any]) -> tuple[_Group | None, int, str]:
        """Record a sign of life from (replica, incarnation, member); returns (group, member, error)."""
        replica_id = _field(body, "replica_id", str)
        incarnation = _field(body, "incarnation", int)
        member = _field(body, "member", int)
        group_size = _field(body, "group_size", int)
        if not replica_id or len(replica_id) > 200:
            raise BadRequest("field 'replica_id' must be 1-200 characters")
        if group_size < 1 or not 0 <= member < group_size:
            raise BadRequest(f"member {member} is outside a group of {group_size}")
        run_id = body.get("run_id", "")
        if not isinstance(run_id, str) or len(run_id) > 100:
            raise BadRequest("field 'run_id' must be a string of at most 100 characters")
        if run_id != self.run_id:
            if self.run_id is not None and self.finished_step is None and self._healthy(time.monotonic()):
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
                for waiter in stale.waiters:
                    if not waiter.done():
                        waiter.set_exception(web.HTTPConflict(text="a newer incarnation of this replica joined"))
        group.beats[member] = time.monotonic()
        return group, member, ""

    def _new_run(self, run_id: str) -> None:
        """A new run (another ``freescale launch``) on a lighthouse whose previous run finished or
        died: forget its groups, quorum, votes and progress; quorum ids keep growing."""
        for join in self.joins.values():
            for waiter in join.waiters:
                if not waiter.done():
                    waiter.set_exception(web.HTTPConflict(text=f"a new run '{run_id}' started on this lighthouse"))
        self.run_id = run_id
        self.groups.clear()
        self.joins.clear()
        self.votes.clear()
        self.steady_steps.clear()
        self.quorum = None
        self.high_step = -1
        self.finished_step = None

    # ------------------------------------------------------------------ handlers
    async def _heartbeat(self, request: web.Request) -> web.Response:
        group, _, error = self._member(await self._body(request))
        if group is None:
            return web.json_response({"error": error}, status=409)
        q = self.quorum
        return web.json_response({"ok": True, "quorum_id": q["quorum_id"] if q is not None else None,
                                  "quorum_lost": q is not None and self._lost(q, time.monotonic())})

    def _lost(self, quorum: dict[str, Any], now: float) -> bool:
        """A collective of ``quorum`` cannot complete: a failure was reported, or a participant is
        unhealthy (hung or dead: no heartbeat within the timeout) or was restarted."""
        return bool(quorum.get("broken")) or any(
            (g := self.groups.get(p["replica_id"])) is None or g.incarnation != p["incarnation"]
            or not g.healthy(now, self.cfg.heartbeat_timeout_s)
            for p in quorum["participants"])

    async def _quorum(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        step = _field(body, "step", int)
        last_seen = int(body.get("last_quorum_id", 0) or 0)
        group, member, error = self._member(body)
        if group is None:
            return web.json_response({"error": error}, status=409)
        self.quorum_id = max(self.quorum_id, last_seen)
        if self.finished_step is not None:
            return web.json_response(self._finished_answer())
        steady = self._steady_answer(group, step)
        if steady is not None:
            return web.json_response(steady)
        join = self.joins.get(group.replica_id)
        if join is None or join.incarnation != group.incarnation:
            join = _Join(group.incarnation, time.monotonic())
            self.joins[group.replica_id] = join
        join.steps[member] = step
        address = body.get("address", "")
        if not isinstance(address, str) or len(address) > 300:
            raise BadRequest("field 'address' must be a string of at most 300 characters")
        join.addresses[member] = address
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        join.waiters.append(waiter)
        self._try_form(time.monotonic())
        try:
            return web.json_response(await waiter)
        except web.HTTPConflict as exc:
            return web.json_response({"error": exc.text}, status=409)

    async def _commit(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        quorum_id, step = _field(body, "quorum_id", int), _field(body, "step", int)
        ok = _field(body, "ok", bool)
        group, member, error = self._member(body)
        if group is None:
            return web.json_response({"error": error}, status=409)
        vote = self.votes.get((quorum_id, step))
        if vote is None:
            if self.quorum is None or self.quorum["quorum_id"] != quorum_id:
                return web.json_response({"commit": False, "reason": "quorum superseded"})
            vote = _Vote(quorum_id, {p["replica_id"]: (p["incarnation"], self.groups[p["replica_id"]].group_size)
                          for p in self.quorum["participants"] if p["replica_id"] in self.groups})
            self.votes[(quorum_id, step)] = vote
            for key in [k for k in self.votes if k[1] < step - 8]:  # keep the table small
                del self.votes[key]
        if vote.result is None:
            expected = vote.participants.get(group.replica_id)
            if expected is None or expected[0] != group.incarnation:
                return web.json_response({"commit": False, "reason": "not a participant of this quorum"})
            vote.ballots[(group.replica_id, member)] = ok
            self._settle(vote, time.monotonic())
        if vote.result is None:
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            vote.waiters.append(waiter)
            await waiter
        answer: dict[str, Any] = {"commit": vote.result}
        if vote.result and self.cfg.quorum_in_vote and self.finished_step is None:
            following = self._steady_answer(group, step + 1)
            if following is not None:
                answer["next"] = following
        return web.json_response(answer)

    async def _report(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        quorum_id = _field(body, "quorum_id", int)
        reporter = _field(body, "replica_id", str)
        now = time.monotonic()
        if self.quorum is not None and self.quorum["quorum_id"] == quorum_id:
            # Its process groups are broken: the next quorum gets a new id even if
            # every participant turns out to be alive.
            self.quorum["broken"] = True
            for p in self.quorum["participants"]:
                group = self.groups.get(p["replica_id"])
                if group is not None and p["replica_id"] != reporter:
                    group.suspect_since = now
        reporter_group = self.groups.get(reporter)
        if reporter_group is not None:
            reporter_group.beats = {m: now for m in reporter_group.beats}
        for vote in self.votes.values():
            self._settle(vote, now)
        self._try_form(now)
        return web.json_response({"ok": True})

    def _finished_answer(self) -> dict[str, Any]:
        return {"finished": True, "finished_step": self.finished_step}

    async def _finish(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        step = _field(body, "step", int)
        group, _, error = self._member(body)
        if group is None:
            return web.json_response({"error": error}, status=409)
        self.finished_step = max(step, self.finished_step if self.finished_step is not None else step)
        for join in self.joins.values():
            for waiter in join.waiters:
                if not waiter.done():
                    waiter.set_result(self._finished_answer())
        self.joins.clear()
        for vote in self.votes.values():  # a vote still open cannot complete: its group went home
            if vote.result is None:
                vote.result = False
                for waiter in vote.waiters:
                    if not waiter.done():
                        waiter.set_result(False)
        return web.json_response({"ok": True})

    async def _status(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response({
            "quorum_id": self.quorum_id,
            "quorum": self.quorum,
            "groups": {rid: {"incarnation": g.incarnation, "group_size": g.group_size,
                             "healthy": g.healthy(now, self.cfg.heartbeat_timeout_s),
                             "since_heartbeat_s": now - g.last_beat()} for rid, g in self.groups.items()},
            "joining": sorted(self.joins),
            "high_step": self.high_step,
        })

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

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            try:
                now = time.monotonic()
                self._try_form(now)
                for vote in list(self.votes.values()):
                    self._settle(vote, now)
            except Exception:  # a bug here must not stop every later decision
                log.exception("lighthouse: tick failed")

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


def run_forever(cfg: LighthouseConfig) -> None:
    """``freescale lighthouse``: serve until SIGINT/SIGTERM."""
    import signal

    async def main() -> None:
        lighthouse = Lighthouse(cfg)
        url = await lighthouse.start()
        print(f"lighthouse: serving {url} (rendezvous store {lighthouse.store_address}), "
              f"min_replicas={cfg.min_replicas}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await lighthouse.stop()

    asyncio.run(main())


__all__ = ["Lighthouse", "LighthouseConfig", "run_forever"]
