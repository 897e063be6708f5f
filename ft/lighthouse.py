"""The lighthouse: membership, per-step quorums and commit votes for replica groups.

A replica group (one torchrun job of ``group_size`` ranks, the unit of failure)
is known by ``replica_id`` and an ``incarnation`` number that grows each time
the group restarts.  Every rank of every group talks to the lighthouse over
HTTP (aiohttp server, JSON bodies of bounded size, optional shared token):

``POST /v1/heartbeat``  ``{replica_id, incarnation, member, group_size, quorum_id, step, ready}``
    Sent every ~50 ms from a background thread of each rank, with the quorum of
    its last committed step, its next step and whether it holds valid state
    (what a lighthouse restarted without a state file rebuilds its facts from).  A higher
    incarnation replaces the group's previous one (its pending requests fail);
    a lower one is refused (409): that process belongs to a dead incarnation.
    The reply says ``{quorum_id, quorum_lost}``: the current quorum, and
    whether a collective of it can no longer complete (a failure was reported,
    or a participant is unhealthy or restarted).  A rank blocked in a
    collective of that quorum (or of an older one) stops waiting and redoes
    the step with the survivors (``freescale.ft.replica_group``): a hung peer
    stalls the others for the heartbeat timeout, not the collective timeout.

``POST /v1/quorum``  ``{replica_id, incarnation, member, group_size, step, last_quorum_id, address, store}``
    Long-polls until a quorum that includes the caller's group forms, then
    returns ``{quorum_id, participants: [{replica_id, incarnation, step,
    addresses}], max_step, store: "host:port"}`` (``addresses``: each member's
    snapshot server, for catch-up; ``store``: the rendezvous store of the first
    participant's member 0, which every participant's process groups meet on).
    While the only groups that could join cannot form a quorum without
    committing steps twice (``freescale.ft.membership``: the holders of the
    run's progress), the answer is ``{waiting: why}`` and the caller asks again;
    when those holders are gone for good, 409 with why.  A group has *joined*
    when all its members have asked.  A quorum forms:

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
    the next quorum after the grace instead of the heartbeat timeout.  Whether
    a suspect is *gone* (no longer counted by the majority rule) is learned
    from its own presence connection only (``/v1/presence``): one group's
    report cannot make another group gone.
``POST /v1/finish``  ``{replica_id, incarnation, member, step}``
    A group finished the run at ``step``.  From then on every quorum request
    is answered ``{finished: true, finished_step}``: a group restarted after
    the others finished stops instead of training alone from step 0.

Every quorum also carries ``high_step``, the highest step any earlier quorum
reached; a quorum whose ``max_step`` is below it holds none of the groups
that had that progress, and its clients stop with an error rather than
silently start over (a second guard behind the holders rule).

Restarts: with ``state_path`` (``freescale lighthouse --state FILE``) the
durable facts (run, quorum id, high step, finish, holders: ``freescale.ft.durable``)
survive a restart, so the rules above hold across it and a group restarted
right after it still catches up from its peers (``settled`` in ``/v1/status``).
The lighthouse imports neither torch nor numpy, so it serves within a fraction
of a second of its start; the groups' requests retry with backoff until it does.

Runs: every request may carry a ``run_id`` (``freescale launch`` makes one per
run).  A lighthouse that outlives a run serves the next one once the previous
finished or all its groups are gone (its state is then forgotten; quorum ids
keep growing); while the previous run is going, requests of another run are
refused (409) with a message saying so.

``POST /v1/presence``  ``{replica_id, incarnation, member, group_size}``
    Held open by each rank for its lifetime; when its connection closes (the process
    died), the group is suspect and known gone at once (see
    ``_presence``): a kill costs the suspect grace, whatever the survivors were doing
    (a collective, or waiting for the dead group's vote).

``GET /v1/status``  the membership, holders, why joiners wait (``blocked``), for operators and tests.

Health: a group is healthy while every member's last heartbeat (or request) is
younger than ``heartbeat_timeout_s`` and it is not suspect.  A SIGSTOPped
group stops heartbeating and is evicted by that timeout.

Requests are bounded: a body not in within ``body_timeout_s`` is answered 408,
and a client that goes away mid-request is one log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from aiohttp import ClientPayloadError, web

from freescale.ft import durable
from freescale.ft.membership import BadRequest, LighthouseConfig, Membership, _field, _Group, _Join, _Vote, resolve
from freescale.ft.serving import LoopThread, token_ok

log = logging.getLogger("freescale.ft.lighthouse")

SCAN_EVERY_S = 0.05
"""How often the ticker scans every group (``Lighthouse._ticker``)."""


class _BodyTimeout(Exception):
    pass


class Lighthouse(Membership):
    """The lighthouse server: HTTP handlers over ``Membership``'s decisions, and the durable state file."""

    def __init__(self, cfg: LighthouseConfig) -> None:
        super().__init__(cfg, durable.load(cfg.state_path) if cfg.state_path else None)
        if cfg.state_path:
            self.on_durable_change = self._save
        self._saved_high_step = self.high_step
        self._saved_at = time.monotonic()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._held: set[asyncio.Event] = set()
        """One per open ``/v1/presence`` request."""
        self._encoded: tuple[tuple[Any, ...] | None, str] = (None, "")
        """(quorum key, its JSON): ``_quorum_text``'s one-entry cache."""
        self._lost_at_tick: tuple[int, bool] = (-1, False)
        """(quorum id, ``_lost``) as of the last tick: what heartbeat replies say (module docstring)."""
        self._background = LoopThread("freescale-lighthouse")

    def _save(self) -> None:
        """Write the durable facts (``freescale.ft.durable``), synchronously: no answer that
        depends on them leaves before they are on disk."""
        try:
            durable.save(self.cfg.state_path, self.durable)
        except OSError as exc:
            # Going on would tell groups what a restart would forget: stop; the groups retry until a
            # lighthouse (restarted by whoever runs it) serves again from the last state written.
            log.critical("lighthouse: cannot write its state file %s (%s); stopping", self.cfg.state_path,
                         exc.strerror or exc)
            os._exit(3)
        self._saved_high_step, self._saved_at = self.high_step, time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Serve on ``cfg.bind``; returns the base URL."""
        host, _, port = self.cfg.bind.rpartition(":")
        app = web.Application(client_max_size=self.cfg.max_request_bytes, middlewares=[self._auth])
        app.router.add_post("/v1/heartbeat", self._heartbeat)
        app.router.add_post("/v1/quorum", self._quorum)
        app.router.add_post("/v1/commit", self._commit)
        app.router.add_post("/v1/report", self._report)
        app.router.add_post("/v1/finish", self._finish)
        app.router.add_post("/v1/presence", self._presence)
        app.router.add_get("/v1/status", self._status)
        # Handlers are cancelled when their client's connection closes: a ``/v1/presence`` request
        # ending that way is the evidence that a rank's process is gone.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, int(port))
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{host}:{bound[1]}"
        self._tick_task = asyncio.get_running_loop().create_task(self._ticker())
        return self.url

    async def stop(self) -> None:
        for held in list(self._held):
            held.set()  # presence requests end with an answer, not a closed connection
        if self._tick_task is not None:
            self._tick_task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.cfg.state_path and self.high_step != self._saved_high_step:
            self._save()

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
        except _BodyTimeout as exc:
            return web.json_response({"error": str(exc)}, status=408, headers={"Connection": "close"})
        except (ConnectionError, asyncio.IncompleteReadError, ClientPayloadError) as exc:
            log.warning("lighthouse: %s %s from %s: the client went away mid-request (%s)", request.method,
                        request.path, request.remote, type(exc).__name__)
            return web.Response(status=499)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object, read within ``body_timeout_s`` (a body that never arrives
        does not hold a handler: 408)."""
        try:  # a small body has usually arrived with its headers: no timer then
            raw = await (request.read() if request.content.is_eof() else
                         asyncio.wait_for(request.read(), self.cfg.body_timeout_s))
        except asyncio.TimeoutError:
            raise _BodyTimeout(f"the request body did not arrive within {self.cfg.body_timeout_s:g} s") from None
        try:
            body = json.loads(raw)
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
                resolve(stale.waiters, web.HTTPConflict(text="a newer incarnation of this replica joined"))
        if body.get("agent") is True:  # a group agent's beat carries its members' ages instead
            group.agent = True
        else:
            group.beat(member, time.monotonic())
        return group, member, ""

    def _new_run(self, run_id: str) -> None:
        """A new run (another ``freescale launch``) on a lighthouse whose previous run finished or
        died: forget its groups, quorum, votes and progress; quorum ids keep growing."""
        for join in self.joins.values():
            resolve(join.waiters, web.HTTPConflict(text=f"a new run '{run_id}' started on this lighthouse"))
        self.run_id = run_id
        self.groups.clear()
        self.joins.clear()
        self.votes.clear()
        self.steady_steps.clear()
        self.quorum = None
        self.high_step = -1
        self.finished_step = None
        self.holders, self.holders_quorum_id, self.blocked = {}, 0, ""
        self.on_durable_change()

    # ------------------------------------------------------------------ handlers
    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        group, _, error = self._member(body)
        if group is None:
            return web.json_response({"error": error}, status=409)
        self._agent_beat(group, body)
        self.note_progress(group, body)
        q = self.quorum
        return web.json_response({"ok": True, "quorum_id": q["quorum_id"] if q is not None else None,
                                  "quorum_lost": q is not None and (bool(q.get("broken"))
                                                                    or self._lost_at_tick == (q["quorum_id"], True)),
                                  "beat_every_s": self.beat_interval()})

    def _agent_beat(self, group: _Group, body: dict[str, Any]) -> None:
        """A group agent's heartbeat (``freescale.ft.group_agent``): each member's age (seconds since
        it last beat to the agent; null: never) and the members whose presence connection closed."""
        ages, lost = body.get("member_ages_s"), body.get("members_lost")
        if ages is not None:
            if not isinstance(ages, list) or len(ages) != group.group_size or not all(
                    a is None or isinstance(a, (int, float)) and not isinstance(a, bool) and a >= 0 for a in ages):
                raise BadRequest(f"field 'member_ages_s' must be {group.group_size} ages in seconds (or null)")
            now = time.monotonic()
            for member, age in enumerate(ages):
                if age is not None:
                    group.beat(member, now - age)
        if lost:
            self._member_indices(body, "members_lost", group)
            self.connection_lost(group.replica_id, group.incarnation)

    @staticmethod
    def _member_indices(body: dict[str, Any], name: str, group: _Group) -> list[int]:
        """A group agent's list of member indices (``members`` of a ballot, ``members_lost``)."""
        value = body[name]
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
            return self._quorum_response(steady)
        join = self.joins.get(group.replica_id)
        if join is None or join.incarnation != group.incarnation:
            join = _Join(group.incarnation, time.monotonic())
            self.joins[group.replica_id] = join
        address = body.get("address", "")
        if not isinstance(address, str) or len(address) > 300:
            raise BadRequest("field 'address' must be a string of at most 300 characters")
        if "members" in body:  # a group agent joins the whole group at once
            for m, entry in enumerate(self._member_asks(body, group)):
                join.steps[m], join.addresses[m] = entry["step"], entry.get("address", "")
        else:
            join.steps[member], join.addresses[member] = step, address
        store = body.get("store", "")
        if not isinstance(store, str) or len(store) > 300:
            raise BadRequest("field 'store' must be a string of at most 300 characters")
        if member == 0:
            join.store = store
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        join.waiters.append(waiter)
        if len(self.joins) >= len(self.groups):  # maybe everyone is in: decide now (else the next tick does,
            self._try_form(time.monotonic())      # not every request: one scan of all groups per request is O(n^2))
        try:
            answer = await waiter
        except web.HTTPConflict as exc:
            return web.json_response({"error": exc.text}, status=409)
        if "refused" in answer:
            return web.json_response({"error": answer["refused"]}, status=409)
        return self._quorum_response(answer)

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
            ready = body.get("ready", True) is True
            for m in self._member_indices(body, "members", group) if "members" in body else [member]:
                vote.cast(group.replica_id, m, ok, ready)
            self._settle(vote, time.monotonic(), scan=False)
        if vote.result is None:
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            vote.waiters.append(waiter)
            await waiter
        if vote.result and self.cfg.quorum_in_vote and self.finished_step is None:
            following = self._steady_answer(group, step + 1)
            if following is not None:  # the same participants: the voter has them (tens of KB at 512 groups)
                return _json(f'{{"commit": true, "next": {{"quorum_id": {following["quorum_id"]}, '
                             f'"max_step": {following["max_step"]}, "high_step": {following["high_step"]}, '
                             '"same_participants": true}}')
        return _json('{"commit": true}' if vote.result else '{"commit": false}')

    def _quorum_text(self, quorum: dict[str, Any]) -> str:
        """``quorum`` as JSON, encoded once for all the participants it answers (at 512 groups the
        quorum is tens of KB: encoding it per answer would cost the lighthouse more than the rest)."""
        key = (id(quorum), quorum["quorum_id"], quorum["max_step"], quorum["high_step"], bool(quorum.get("broken")))
        if self._encoded[0] != key:
            self._encoded = (key, json.dumps(quorum))
        return self._encoded[1]

    def _quorum_response(self, answer: dict[str, Any]) -> web.Response:
        return _json(self._quorum_text(answer)) if "participants" in answer else web.json_response(answer)

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
                if group is not None and p["replica_id"] != reporter and not group.silent_since_report():
                    group.suspect_since = now  # (one already silent since an earlier report keeps its grace)
        reporter_group = self.groups.get(reporter)
        if reporter_group is not None:
            for m in list(reporter_group.beats):
                reporter_group.beat(m, now)
        for vote in self.votes.values():
            self._settle(vote, now)
        self._try_form(now)
        return web.json_response({"ok": True})

    async def _presence(self, request: web.Request) -> web.Response:
        """Held open for as long as the rank's process lives (the client's presence thread).  Its
        connection closing (the process died: the kernel closes its sockets) makes the group
        suspect and known gone at once: an open vote fails and the next quorum forms
        after the suspect grace, not the heartbeat timeout.  A hung or stopped process keeps it
        open, a partition does not close it, so neither is mistaken for a death."""
        group, _, error = self._member(await self._body(request))
        if group is None:
            return web.json_response({"error": error}, status=409)
        incarnation, held = group.incarnation, asyncio.Event()
        self._held.add(held)
        try:
            await held.wait()  # set only when this lighthouse stops
        except asyncio.CancelledError:
            self.connection_lost(group.replica_id, incarnation)
            raise
        finally:
            self._held.discard(held)
        return web.json_response({"ok": True, "stopping": True})

    def _finished_answer(self) -> dict[str, Any]:
        return {"finished": True, "finished_step": self.finished_step}

    async def _finish(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        step = _field(body, "step", int)
        group, _, error = self._member(body)
        if group is None:
            return web.json_response({"error": error}, status=409)
        self.finished_step = max(step, self.finished_step if self.finished_step is not None else step)
        self.on_durable_change()
        for join in self.joins.values():
            resolve(join.waiters, self._finished_answer())
        self.joins.clear()
        for vote in self.votes.values():  # a vote still open cannot complete: its group went home
            if vote.result is None:
                vote.result = False
                resolve(vote.waiters, False)
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
            "holders": self.holders,
            "blocked": self.blocked,
            "settled": self.settled(now),
            "restored": self.restored,
            "finished_step": self.finished_step,
        })

    async def _ticker(self) -> None:
        """Every ``tick_s``: form a quorum that can form now.  Every ``SCAN_EVERY_S``: the scans over
        every group (the quorum's health for heartbeat replies, open votes' unhealthy
        participants, the voices that set the beat rate): once per scan, not per request, and
        not every tick (at 512 groups they would cost the lighthouse more than its requests;
        health moves on the heartbeat timeout's scale, and a death's evidence, a failure report
        or a closed presence connection, settles votes at once)."""
        scanned = 0.0
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            try:
                now = time.monotonic()
                if now - scanned >= SCAN_EVERY_S:
                    scanned = now
                    self.count_voices()
                    if self.quorum is not None:
                        self._lost_at_tick = (self.quorum["quorum_id"], self._lost(self.quorum, now))
                    for vote in list(self.votes.values()):
                        self._settle(vote, now)
                self._try_form(now)
                if self.cfg.state_path and self.high_step != self._saved_high_step and now - self._saved_at >= 1.0:
                    self._save()  # the growing high_step, at most once a second (a lower bound)
            except Exception:  # a bug here must not stop every later decision
                log.exception("lighthouse: tick failed")


def _json(text: str) -> web.Response:
    return web.Response(text=text, content_type="application/json")


def run_forever(cfg: LighthouseConfig) -> None:
    """``freescale lighthouse``: serve until SIGINT/SIGTERM."""
    import signal

    async def main() -> None:
        lighthouse = Lighthouse(cfg)
        url = await lighthouse.start()
        state = (f"state {cfg.state_path}" + (f" (restored: run '{lighthouse.run_id}', quorum {lighthouse.quorum_id}, "
                                              f"step {lighthouse.high_step})" if lighthouse.restored else " (new)")
                 if cfg.state_path else "no state file: a restart forgets the run")
        print(f"lighthouse: serving {url} (min_replicas={cfg.min_replicas}; {state})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await lighthouse.stop()

    asyncio.run(main())


__all__ = ["Lighthouse", "LighthouseConfig", "run_forever"]
