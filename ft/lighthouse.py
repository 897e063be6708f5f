"""The lighthouse: membership, per-step quorums and commit votes for replica groups.

A replica group (one torchrun job of ``group_size`` ranks, the unit of failure)
is known by ``replica_id`` and an ``incarnation`` number that grows each time
the group restarts.  Each group has one *voice* to the lighthouse: its agent
(``freescale.ft.group_agent``, on member 0, speaking for every member) over one
WebSocket, ``/v1/agent`` below; a group of one rank speaks for itself over the
HTTP routes (aiohttp server, JSON bodies of bounded size, optional shared token),
which the agents serve to their members unchanged:

``POST /v1/heartbeat``  ``{replica_id, incarnation, member, group_size, quorum_id, step, ready}``
    Sent every ~50 ms (slower when the reply's ``beat_every_s`` asks) from a
    background thread of each voice, with the quorum of its last committed
    step, its next step and whether it holds valid state (what a lighthouse
    restarted without a state file rebuilds its facts from).  A higher
    incarnation replaces the group's previous one (its pending requests fail);
    a lower one is refused (409): that process belongs to a dead incarnation.
    The reply says ``{quorum_id, quorum_lost, beat_every_s}``: the current quorum, and
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
    to join, someone is unhealthy, ...), and the client asks as usual.  When
    groups wait to join behind the step, it carries ``stage: true`` (stage
    this step for them) and ``joining``: those groups, sorted, decided once
    per vote so that every answer names the same ones.  Its
    participants are those of the quorum voted in, so ``next`` names only
    ``{quorum_id, max_step, high_step, same_participants: true}`` (a quorum of
    512 groups is tens of KB: sent once per membership change, not per step).

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

``GET /v1/agent``  (WebSocket) a group agent's link.  Its first message is
    ``{"id": 0, "op": "hello", "body": {replica_id, incarnation, member: 0,
    group_size, run_id}}``; then ``{"id", "op": "heartbeat" | "quorum" |
    "commit", "body"}``, each the route's body for the whole group, without
    the identity: a heartbeat carries ``member_ages_s`` (each member's seconds
    since it last beat to the agent: the group stays as alive as its stalest
    member) and ``members_lost`` (members whose connection to the agent
    closed), a quorum request ``members`` (each member's ``{step,
    address}``), a ballot ``members`` (the members it is cast for).  Each
    answer is ``{"id", "status"}``, a newline, then the route's answer.  The
    link is the group's presence: when it closes, as for ``/v1/presence``.
    A message costs the lighthouse less than half a request, and the load
    grows with groups, not ranks.

Health: a group is healthy while every member's last heartbeat (or request) is
younger than ``heartbeat_timeout_s`` and it is not suspect.  A SIGSTOPped
group stops heartbeating and is evicted by that timeout.  Each heartbeat reply
says how often to beat (``beat_every_s``): every 50 ms up to
``max_beats_per_s / 20`` voices, then slower, and the suspect grace grows with it.

Requests are bounded: a body not in within ``body_timeout_s`` is answered 408,
and a client that goes away mid-request is one log line.
"""


from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

from aiohttp import ClientPayloadError, WSMsgType, web

from freescale.ft import durable
from freescale.ft.lighthouse_ops import LighthouseOps, Pending, Reply, call_id, error, json_object, quiet_bad_requests
from freescale.ft.membership import LighthouseConfig
from freescale.ft.membership_records import BadRequest, _Vote
from freescale.ft.quiet_gc import PYTHON_GC_ENV, QuietCollector
from freescale.ft.serving import LINK_PING_S, LoopThread, run_loop, token_ok

log = logging.getLogger("freescale.ft.lighthouse")

SCAN_EVERY_S = 0.05
"""How often the ticker scans every group (``Lighthouse._ticker``)."""


class _BodyTimeout(Exception):
    pass


def _response(reply: Reply) -> web.Response:
    return web.Response(text=reply[1], status=reply[0], content_type="application/json")


class Lighthouse(LighthouseOps):
    """The lighthouse server: HTTP routes and agent links over ``LighthouseOps``, the ticker, and the
    durable state file."""

    def __init__(self, cfg: LighthouseConfig) -> None:
        super().__init__(cfg, durable.load(cfg.state_path) if cfg.state_path else None)
        if cfg.state_path:
            durable.check_writable(cfg.state_path)
            self.on_durable_change = self._save
        self._saved_high_step = self.high_step
        self._saved_at = time.monotonic()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._held: set[asyncio.Event] = set()
        """One per open ``/v1/presence`` request."""
        self._links: set[web.WebSocketResponse] = set()
        """The group agents' open links (``/v1/agent``)."""
        self._background = LoopThread("freescale-lighthouse")
        self.collector: QuietCollector | None = None
        """The process's garbage collector, when the lighthouse has a process of its own (``run_forever``)."""
        self.answering = 0
        """Quorum and commit requests received and not yet answered (on links or over HTTP)."""
        self._answering_links: set[asyncio.Task[None]] = set()
        """One per open vote with ballots from agent links (``_answer_links``)."""

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
        for path, operation in (("/v1/heartbeat", self.heartbeat), ("/v1/quorum", self.ask_quorum),
                                ("/v1/commit", self.commit), ("/v1/report", self.report),
                                ("/v1/finish", self.finish)):
            app.router.add_post(path, self._route(operation))
        app.router.add_post("/v1/presence", self._presence)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/v1/agent", self._agent_link)
        # Handlers are cancelled when their client's connection closes: a ``/v1/presence`` request
        # (or an agent's link) ending that way is the evidence that a rank's process is gone.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        quiet_bad_requests()
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
        for link in list(self._links):
            await link.close(code=1001, message=b"lighthouse stopping")
        if self._tick_task is not None:
            self._tick_task.cancel()
        for task in list(self._answering_links):
            task.cancel()
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
        except TimeoutError:
            raise _BodyTimeout(f"the request body did not arrive within {self.cfg.body_timeout_s:g} s") from None
        return json_object(raw)

    def quiet(self) -> bool:
        """No request being answered: no ballot waits for its vote, no quorum request for its quorum, no decided
        vote's answers still going out; a pause now delays no answer."""
        return not self.answering

    def _route(self, operation: Any) -> Any:
        async def handle(request: web.Request) -> web.Response:
            self.answering += 1
            try:
                reply = operation(await self._body(request))
                return _response(await reply if asyncio.iscoroutine(reply) else reply)
            finally:
                self.answering -= 1
        return handle

    async def _status(self, request: web.Request) -> web.Response:
        return _response(self.status())

    async def _presence(self, request: web.Request) -> web.Response:
        """Held open for as long as the rank's process lives (the client's presence thread).  Its
        connection closing (the process died: the kernel closes its sockets) makes the group
        suspect and known gone at once: an open vote fails and the next quorum forms
        after the suspect grace, not the heartbeat timeout.  A hung or stopped process keeps it
        open, a partition does not close it, so neither is mistaken for a death."""
        group, _, why = self.member(await self._body(request))
        if group is None:
            return _response(error(409, why))
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

    # ------------------------------------------------------------------ group agents
    async def _agent_link(self, request: web.Request) -> web.WebSocketResponse:
        """A group agent's link (module docstring): a hello, then operations answered by id, a quorum request
        on a task of its own and a ballot held on its vote (both wait for the others: ``_ballot``); the link's
        end is the group's presence ending.  A request the lighthouse fails on (a bug) is answered 500 and
        the link stays: the group is not taken for gone."""
        link = web.WebSocketResponse(max_msg_size=self.cfg.max_request_bytes, heartbeat=LINK_PING_S)
        await link.prepare(request)
        self._links.add(link)
        identity: dict[str, Any] | None = None
        speaking: tuple[str, int] | None = None
        pending: set[asyncio.Task[None]] = set()
        try:
            async for message in link:
                if message.type != WSMsgType.TEXT:
                    break
                call: Any = None
                try:
                    call = json_object(message.data)
                    number, op, body = call_id(call), call.get("op"), call.get("body")
                    if not isinstance(body, dict):
                        raise BadRequest("each message needs a JSON object 'body'")
                    if identity is None:
                        if op != "hello":
                            raise BadRequest("the first message must be the agent's hello")
                        group, _, why = self.member({**body, "agent": True})
                        if group is None:
                            await _answer(link, number, error(409, why))
                            break
                        identity, speaking = {**body, "agent": True}, (group.replica_id, group.incarnation)
                        await _answer(link, number, (200, '{"ok": true}'))
                        continue
                    body.update(identity)
                    if op == "heartbeat":
                        await _answer(link, number, self.heartbeat(body, speaking))
                    elif op == "commit":
                        answer = self._ballot(link, number, body, speaking)
                        if answer is not None:
                            await _answer(link, number, answer)
                    elif op == "quorum":
                        task = asyncio.get_running_loop().create_task(
                            self._answer_later(link, number, body, speaking))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                    else:
                        raise BadRequest(f"unknown op {op!r} (heartbeat, quorum, commit)")
                except BadRequest as exc:
                    await _answer(link, call_id(call), error(400, str(exc)))
                except Exception:
                    log.exception("lighthouse: a request on %s's link failed", speaking[0] if speaking else "an agent")
                    await _answer(link, call_id(call), error(500, "the lighthouse failed on this request"))
        finally:
            self._links.discard(link)
            for task in pending:
                task.cancel()
            if speaking is not None:
                self.connection_lost(*speaking)
        return link

    async def _answer_later(self, link: web.WebSocketResponse, number: int, body: dict[str, Any],
                            speaking: tuple[str, int] | None) -> None:
        """A quorum request on a link: answered once its quorum forms (or cannot)."""
        self.answering += 1
        try:
            try:
                reply = await self.ask_quorum(body, speaking)
            except BadRequest as exc:
                reply = error(400, str(exc))
            if not link.closed:
                await _answer(link, number, reply)
        finally:
            self.answering -= 1

    def _ballot(self, link: web.WebSocketResponse, number: int, body: dict[str, Any],
                speaking: tuple[str, int] | None) -> Reply | None:
        """A commit ballot on a link: its answer now, or None: the vote waits for others, and the ballot joins
        the vote's listeners, answered with every other link's ballot by one task when the vote is decided.
        At 512 groups the ballots arrive in one burst; a task per ballot (its creation, its wake-up when the
        vote is decided) was most of the lighthouse's cost of a step and delayed the last ballot's count.
        A held ballot counts in ``answering`` until its vote's answers are all out, also where its link
        closed meanwhile (the vote is then decided within the suspect grace, or by the others' ballots)."""
        cast = self.cast_ballot(body, speaking)
        if not isinstance(cast, Pending):
            return cast
        vote = cast.vote
        if not vote.listeners:
            decided: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            vote.waiters.append(decided)
            task = asyncio.get_running_loop().create_task(self._answer_links(vote, decided))
            self._answering_links.add(task)
            task.add_done_callback(functools.partial(self._answered, vote))  # (also if cancelled unstarted)
            task.add_done_callback(self._answering_links.discard)
        vote.listeners.append((link, number, cast.group))
        self.answering += 1
        return None

    async def _answer_links(self, vote: _Vote, decided: asyncio.Future[bool]) -> None:
        """Every link ballot of ``vote``, answered in one pass once it is decided: every answer computed first
        (from one state of the lighthouse: a quorum or a joiner changing while they go out cannot make two
        groups' answers differ), then written.  An answer is a few dozen bytes, one per ballot its agent sent:
        writing never waits for a link's buffer to drain unless that agent stopped reading thousands of
        answers ago.  One answer failing (a bug) costs that answer a 500, never the others."""
        await decided
        replies = []
        for link, number, group in vote.listeners:
            try:
                replies.append((link, number, self.vote_answer(vote, group)))
            except Exception:
                log.exception("lighthouse: answering %s's ballot failed", group.replica_id)
                replies.append((link, number, error(500, "the lighthouse failed to answer this ballot")))
        for link, number, reply in replies:
            if not link.closed:
                try:
                    await _answer(link, number, reply)
                except Exception:
                    log.exception("lighthouse: writing a vote's answer failed")

    def _answered(self, vote: _Vote, _: asyncio.Task[None]) -> None:
        """``vote``'s held ballots are answered (or the lighthouse stops): no longer waiting."""
        self.answering -= len(vote.listeners)
        vote.listeners = []

    # ------------------------------------------------------------------ time
    async def _ticker(self) -> None:
        """Every ``tick_s``: form a quorum that can form now.  Every ``SCAN_EVERY_S``: the scans over
        every group (``LighthouseOps.scan``): once per scan, not per request, and not every tick (at
        512 groups they would cost the lighthouse more than its requests; health moves on the
        heartbeat timeout's scale, and a death's evidence, a failure report or a closed presence
        connection, settles votes at once)."""
        scanned = 0.0
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            try:
                now = time.monotonic()
                if now - scanned >= SCAN_EVERY_S:
                    scanned = now
                    self.scan(now)
                self._try_form(now)
                if self.collector is not None:
                    self.collector.tick(self.quiet())
                if self.cfg.state_path and self.high_step != self._saved_high_step and now - self._saved_at >= 1.0:
                    self._save()  # the growing high_step, at most once a second (a lower bound)
            except Exception:  # a bug here must not stop every later decision
                log.exception("lighthouse: tick failed")


async def _answer(link: web.WebSocketResponse, number: int, reply: Reply) -> None:
    """One answer on an agent's link: ``{"id", "status"}``, a newline, the answer's JSON."""
    try:
        await link.send_str(f'{{"id": {number}, "status": {reply[0]}}}\n{reply[1]}')
    except ConnectionError:
        pass  # the agent went away: its link's end says so


def run_forever(cfg: LighthouseConfig) -> None:
    """``freescale lighthouse``: serve until SIGINT/SIGTERM."""
    import signal

    async def main() -> None:
        lighthouse = Lighthouse(cfg)
        url = await lighthouse.start()
        if os.environ.get(PYTHON_GC_ENV) != "1":
            lighthouse.collector = QuietCollector()
            lighthouse.collector.take_over()
        state = (f"state {cfg.state_path}" + (f" (restored: run '{lighthouse.run_id}', quorum {lighthouse.quorum_id}, "
                                              f"step {lighthouse.high_step})" if lighthouse.restored else " (new)")
                 if cfg.state_path else "no state file: a restart forgets the run")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before it says it serves: a stop from then on is handled
            loop.add_signal_handler(sig, stop.set)
        print(f"lighthouse: serving {url} (min_replicas={cfg.min_replicas}; {state})", flush=True)
        await stop.wait()
        await lighthouse.stop()

    run_loop(main())


__all__ = ["Lighthouse", "LighthouseConfig", "run_forever"]

