"""A replica group's one voice to the lighthouse, so that its load grows with groups, not ranks.

Without it every rank of every group sends its own heartbeats (20 a second), quorum
requests and commit ballots to one lighthouse: about 20,000 requests a second at 1,024
ranks.  With it, member 0 of a group of more than one rank starts this agent (a small
process: ``python -m freescale.ft.agent_process``, no torch, serving in a fraction of a
second), and every member of the group talks to the agent instead of the lighthouse, over
the very same HTTP API (``freescale.ft.lighthouse``; the members' ``LighthouseClient`` is
unchanged, only its URL differs).  The agent speaks for the group upstream, over one
WebSocket to the lighthouse (``/v1/agent``: a message costs the lighthouse less than half
an HTTP request, and the link's life is the group's presence):

- **heartbeats**: one every ``heartbeat_interval_s`` (or as slowly as the lighthouse asks),
  carrying each member's age (seconds since its last heartbeat to the agent) and the group's
  progress (the least advanced member's).  The lighthouse keeps judging the group by its
  stalest member, so a hung (SIGSTOPped) member still makes the group unhealthy: its age
  grows.  The reply (current quorum, lost or not) answers the members' heartbeats.
- **quorum**: the members' requests are held until every member has asked, then sent as
  one request listing each member's step and snapshot address (the lighthouse's *join* of
  the group), and the one answer goes to all of them.
- **commit vote**: the members' ballots are held until all are in (or one says no: sent at
  once, the vote fails anyway), then sent as one ballot for the listed members; the answer
  (and the next step's quorum it may carry) goes to all.
- **presence**: each member holds ``/v1/presence`` open to the agent: a member whose
  process dies closes it, and the agent tells the lighthouse at once (``members_lost`` in an
  immediate heartbeat).  The agent's own death (or member 0's: the agent exits when its
  parent does) closes the link, which the lighthouse takes as the group's presence ending.
- **report, finish, status**: passed through as HTTP requests (rare).

Why a process and not a thread of member 0: a thread would share member 0's GIL with the
training loop, so every member's vote would wait for member 0's Python work; and a process
that keeps running while member 0 is stopped still reports member 0's growing age.

An upstream failure (no link, no answer in time) is answered 503, which the members'
clients retry with their own backoff (``LighthouseClient._request``): one retry policy, in
the client; the link itself is reopened with backoff.  Requests to the
agent need the lighthouse's token, when one is set.  Groups of one rank need no agent (the
rank is its group's voice already).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from freescale.ft.membership_records import BadRequest, _count, _field, is_count
from freescale.ft.serving import LINK_PING_S, backoff_delays, token_ok

log = logging.getLogger("freescale.ft.group_agent")

Answer = tuple[int, bytes]
"""(HTTP status, JSON body) of an upstream answer, handed to each member it answers."""


@dataclass
class _QuorumAsk:
    step: int
    address: str
    store: str
    last_quorum_id: int
    waits: bool = False
    """The member joins by waiting (``[ft] join = "wait"``): relayed as the group's ``"join": "wait"``."""
    waiters: list[asyncio.Future[Answer]] = field(default_factory=list)

    def live(self) -> bool:
        """A member whose request is still open (a closed connection cancels its waiter)."""
        self.waiters = [w for w in self.waiters if not w.done()]
        return bool(self.waiters)


@dataclass
class _Ballots:
    votes: dict[int, tuple[bool, bool]] = field(default_factory=dict)
    """member -> (ok, ready)."""
    waiters: list[asyncio.Future[Answer]] = field(default_factory=list)
    sending: bool = False
    answer: Answer | None = None


class GroupAgent:
    """The agent's server and upstream loops (module docstring)."""

    def __init__(self, upstream: str, replica_id: str, incarnation: int, group_size: int, *, token: str = "",
                 run_id: str = "", bind: str = "127.0.0.1:0", advertise: str = "",
                 heartbeat_interval_s: float = 0.05, request_timeout_s: float = 60.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.identity: dict[str, Any] = {"replica_id": replica_id, "incarnation": incarnation, "member": 0,
                                         "group_size": group_size, "run_id": run_id}
        self.token, self.bind, self.advertise = token, bind, advertise
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.heartbeat_interval_s, self.request_timeout_s = heartbeat_interval_s, request_timeout_s
        self.url = ""
        self._beats: dict[int, float] = {}
        self._progress: dict[int, dict[str, Any]] = {}
        self._fail_slow: Any = None
        """Member 0's last ``fail_slow`` report (``LighthouseClient.notes``), relayed with the group's heartbeat."""
        self._lost: set[int] = set()
        """Members whose presence connection closed, until the lighthouse acknowledged it."""
        self._beat_reply: Answer = (200, b'{"ok": true, "quorum_id": null, "quorum_lost": false}')
        self._wake = asyncio.Event()
        self._asks: dict[int, _QuorumAsk] = {}
        self._asking: dict[int, _QuorumAsk] | None = None
        """The members' requests behind the upstream quorum request in flight."""
        self._ballots: dict[tuple[int, int], _Ballots] = {}
        self._held: set[asyncio.Event] = set()
        self._present: dict[int, int] = {}
        """Members with a presence connection open (their client is running): member -> connections."""
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._link: aiohttp.ClientWebSocketResponse[bool] | None = None
        """The link to the lighthouse (``/v1/agent``) while it is open."""
        self._calls: dict[int, asyncio.Future[Answer]] = {}
        self._calls_made = 0
        self._refused = ""
        """Why the lighthouse last refused the link ("" if it never did)."""
        self._runner: web.AppRunner | None = None

    @property
    def group_size(self) -> int:
        return int(self.identity["group_size"])

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        app = web.Application(client_max_size=64 * 1024, middlewares=[self._auth])
        app.router.add_post("/v1/heartbeat", self._heartbeat)
        app.router.add_post("/v1/quorum", self._quorum)
        app.router.add_post("/v1/commit", self._commit)
        app.router.add_post("/v1/presence", self._presence)
        app.router.add_post("/v1/report", self._pass_through)
        app.router.add_post("/v1/finish", self._pass_through)
        app.router.add_get("/v1/status", self._pass_through)
        # A member's closed connection cancels its handler: how its death is seen (``_presence``).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        host, _, port = self.bind.rpartition(":")
        await web.TCPSite(self._runner, host, int(port)).start()
        self.url = f"http://{self.advertise or host}:{self._runner.addresses[0][1]}"
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._beat_loop()), loop.create_task(self._link_loop())]
        return self.url

    async def drain(self, timeout_s: float) -> None:
        """Until every member has closed its client (their last requests, ``finish`` among them,
        go through this agent), at most ``timeout_s``: member 0 stops the agent when *it* is done,
        which can be before the others are."""
        deadline = time.monotonic() + timeout_s
        while self._present and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        for held in list(self._held):
            held.set()
        for task in self._tasks:
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ upstream
    async def _upstream(self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Answer:
        """One attempt, answered as the lighthouse's bytes (relayed to members untouched: a quorum
        at 512 groups is tens of KB, not decoded and encoded again per member); a failure is
        answered 503, which the member's client retries with backoff."""
        assert self._session is not None
        try:
            async with self._session.request(method, self.upstream + path, json=body, headers=self.headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
                return answer.status, await answer.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return self._unreachable(path, str(exc) or type(exc).__name__)

    async def _call(self, op: str, body: dict[str, Any], timeout_s: float) -> Answer:
        """One operation on the link (``/v1/agent``), answered by id; 503 while the link is down or
        when no answer came in time (the member's client retries it)."""
        link = self._link
        if link is None or link.closed:
            return self._unreachable(op, "no link to it")
        self._calls_made += 1
        number = self._calls_made
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._calls[number] = answer
        try:
            await link.send_str(json.dumps({"id": number, "op": op, "body": body}))
            return await asyncio.wait_for(answer, timeout_s)
        except (TimeoutError, ConnectionError, RuntimeError) as exc:
            return self._unreachable(op, str(exc) or type(exc).__name__)
        finally:
            self._calls.pop(number, None)

    def _unreachable(self, what: str, why: str) -> Answer:
        return 503, json.dumps({"error": f"group agent of '{self.identity['replica_id']}': lighthouse "
                                         f"{self.upstream} unreachable for {what}: {' '.join(why.split())[:200]}"}
                               ).encode()

    async def _link_loop(self) -> None:
        """Keep the link to the lighthouse open (reopened with backoff after a lighthouse restart):
        a hello, then every answer handed to its caller.  The link is the group's presence."""
        assert self._session is not None
        rng = random.Random()
        delays = backoff_delays(rng)
        while True:
            opened = time.monotonic()
            try:
                async with self._session.ws_connect(self.upstream + "/v1/agent", headers=self.headers,
                                                    max_msg_size=0, heartbeat=LINK_PING_S) as link:
                    await link.send_str(json.dumps({"id": 0, "op": "hello", "body": self.identity}))
                    hello = await link.receive(timeout=self.request_timeout_s)
                    status, raw = _framed(hello.data) if hello.type == aiohttp.WSMsgType.TEXT else (0, b"")
                    if status != 200:
                        why = raw[:300].decode(errors="replace")
                        if why != self._refused:  # once per reason, not once per retry
                            log.warning("group agent of '%s': the lighthouse refused its link (%s): %s",
                                        self.identity["replica_id"], status, why)
                        self._refused = why
                    else:
                        self._link = link
                        self._wake.set()  # a heartbeat now: the group is known at once
                        async for message in link:
                            if message.type != aiohttp.WSMsgType.TEXT:
                                break
                            number = int(json.loads(message.data.partition("\n")[0])["id"])
                            waiting = self._calls.get(number)
                            if waiting is not None and not waiting.done():
                                waiting.set_result(_framed(message.data))
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError):
                pass
            finally:
                self._link = None
                for waiting in self._calls.values():
                    if not waiting.done():
                        waiting.set_result(self._unreachable("a request", "its link closed"))
            if time.monotonic() - opened > 1.0:
                delays = backoff_delays(rng)  # it was up: come back quickly
            await asyncio.sleep(next(delays))

    async def _beat_loop(self) -> None:
        interval = self.heartbeat_interval_s
        while True:
            self._wake.clear()  # (before the beat: a member lost while it is on its way wakes the next at once)
            now = time.monotonic()
            lost = sorted(self._lost)
            body = {"member_ages_s": [round(now - self._beats[m], 4) if m in self._beats else None
                                      for m in range(self.group_size)], **self._group_progress()}
            if lost:
                body["members_lost"] = lost
            status, raw = await self._call("heartbeat", body, max(0.5, 4 * interval))
            if status != 503:  # a lighthouse that is down keeps the last word, as a member's client does
                reply = _decoded(raw)
                every = reply.pop("beat_every_s", None)  # for the group's voice; members beat the agent as usual
                if isinstance(every, (int, float)) and 0 < every <= 10:
                    interval = max(self.heartbeat_interval_s, float(every))
                self._beat_reply = (status, json.dumps(reply).encode())
            if status == 200:
                self._lost.difference_update(lost)
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except TimeoutError:
                pass

    def _group_progress(self) -> dict[str, Any]:
        """The least advanced member's last commit (``LighthouseClient.progress``), once every member told it."""
        if len(self._progress) < self.group_size:
            return {}
        least = min(self._progress.values(), key=lambda p: (p["quorum_id"], p["step"]))
        slow = {} if self._fail_slow is None else {"fail_slow": self._fail_slow}  # checked by the lighthouse
        return {**least, "ready": all(p["ready"] for p in self._progress.values()), **slow}

    # ------------------------------------------------------------------ member side
    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not token_ok(request, self.token):
            return web.json_response({"error": "missing or wrong token"}, status=401)
        try:
            return await handler(request)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except (ConnectionError, asyncio.IncompleteReadError, aiohttp.ClientPayloadError):
            return web.Response(status=499)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await asyncio.wait_for(request.read(), 5.0))
        except TimeoutError:
            raise BadRequest("the request body did not arrive within 5 s") from None
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    def _member(self, body: dict[str, Any]) -> int:
        """The calling member's index (a sign of life); a caller from another group is refused."""
        mine = (self.identity["replica_id"], self.identity["incarnation"], self.group_size)
        theirs = (_field(body, "replica_id", str), _count(body, "incarnation"), _field(body, "group_size", int))
        member = _field(body, "member", int)
        if theirs != mine or not 0 <= member < self.group_size:
            raise BadRequest(f"this is the group agent of replica '{mine[0]}' incarnation {mine[1]} "
                             f"({mine[2]} members), not of {theirs[0]!r} incarnation {theirs[1]} member {member}")
        self._beats[member] = time.monotonic()
        return member

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        member = self._member(body)
        quorum_id, step = body.get("quorum_id"), body.get("step")
        if is_count(quorum_id) and is_count(step):
            self._progress[member] = {"quorum_id": quorum_id, "step": step, "ready": body.get("ready") is True}
        if member == 0 and "fail_slow" in body:  # (every member judged alike: the first one speaks for the group)
            self._fail_slow = body["fail_slow"]
        return _relay(self._beat_reply)

    async def _quorum(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        member = self._member(body)
        ask = _QuorumAsk(_count(body, "step"), str(body.get("address", ""))[:300],
                         str(body.get("store", ""))[:300], _count(body, "last_quorum_id", 0),
                         body.get("join") == "wait")
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        if self._asking is not None and member in self._asking:
            self._asking[member].waiters.append(waiter)  # a retry of a request already on its way
        else:
            if member in self._asks and self._asks[member].live():
                ask.waiters = self._asks[member].waiters
            ask.waiters.append(waiter)
            self._asks[member] = ask
            self._send_quorum_when_all_asked()
        return _relay(await waiter)

    def _send_quorum_when_all_asked(self) -> None:
        if self._asking is not None or len(self._asks) < self.group_size:
            return
        if not all(ask.live() for ask in self._asks.values()):
            self._asks = {m: a for m, a in self._asks.items() if a.waiters}
            return
        self._asking, self._asks = self._asks, {}
        asyncio.get_running_loop().create_task(self._ask_quorum(self._asking))

    async def _ask_quorum(self, asks: dict[int, _QuorumAsk]) -> None:
        ordered = [asks[m] for m in range(self.group_size)]
        body = {"step": max(a.step for a in ordered), "last_quorum_id": max(a.last_quorum_id for a in ordered),
                "address": ordered[0].address, "store": ordered[0].store,
                "members": [{"step": a.step, "address": a.address} for a in ordered],
                **({"join": "wait"} if all(a.waits for a in ordered) else {})}
        answer = await self._call("quorum", body, self.request_timeout_s)
        for ask in ordered:
            for waiter in ask.waiters:
                if not waiter.done():
                    waiter.set_result(answer)
        self._asking = None
        self._send_quorum_when_all_asked()  # requests that arrived meanwhile

    async def _commit(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        member = self._member(body)
        key = (_count(body, "quorum_id"), _count(body, "step"))
        ballots = self._ballots.setdefault(key, _Ballots())
        if ballots.answer is not None:
            return _relay(ballots.answer)
        ballots.votes.setdefault(member, (_field(body, "ok", bool), body.get("ready", True) is True))
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        ballots.waiters.append(waiter)
        said_no = not all(ok for ok, _ in ballots.votes.values())
        if not ballots.sending and (said_no or len(ballots.votes) == self.group_size):
            ballots.sending = True
            asyncio.get_running_loop().create_task(self._vote(key, ballots))
        for old in [k for k in self._ballots if k[1] < key[1] - 8]:
            del self._ballots[old]
        return _relay(await waiter)

    async def _vote(self, key: tuple[int, int], ballots: _Ballots) -> None:
        members = sorted(ballots.votes)
        body = {"quorum_id": key[0], "step": key[1], "members": members,
                "ok": all(ballots.votes[m][0] for m in members), "ready": all(ballots.votes[m][1] for m in members)}
        answer = await self._call("commit", body, self.request_timeout_s)
        if answer[0] == 200:
            ballots.answer = answer  # members that vote later are answered at once
        ballots.sending = False  # else: the members retry, and the next ballot sends again
        waiters, ballots.waiters = ballots.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(answer)

    async def _presence(self, request: web.Request) -> web.Response:
        member = self._member(await self._body(request))
        held = asyncio.Event()
        self._held.add(held)
        self._present[member] = self._present.get(member, 0) + 1
        try:
            await held.wait()  # set only when the agent stops
        except asyncio.CancelledError:
            self._lost.add(member)  # the member's process is gone: tell the lighthouse now
            self._wake.set()
            self._fail_pending(member)
            raise
        finally:
            self._held.discard(held)
            self._present[member] -= 1
            if not self._present[member]:
                del self._present[member]
        return web.json_response({"ok": True, "stopping": True})

    def _fail_pending(self, member: int) -> None:
        """A member is gone: the group is too (the unit of failure), so the others' quorum requests
        and ballots held for it are answered at once, in words the rank reports as a peer's
        failure in one line (``freescale.rank_console``), rather than left to their timeout."""
        gone = (409, json.dumps({"error": f"replica group: member {member} of '{self.identity['replica_id']}' is "
                                          "gone (its process ended); the group stops"}).encode())
        waiters = [w for ask in self._asks.values() for w in ask.waiters]
        waiters += [w for ballots in self._ballots.values() if ballots.answer is None for w in ballots.waiters]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(gone)

    async def _pass_through(self, request: web.Request) -> web.Response:
        body = await self._body(request) if request.method == "POST" else None
        if body is not None:
            self._member(body)
        return _relay(await self._upstream(request.method, request.path, body, self.request_timeout_s))


def _relay(answer: Answer) -> web.Response:
    return web.Response(body=answer[1], status=answer[0], content_type="application/json")


def _framed(text: str) -> Answer:
    """An answer on the link: ``{"id", "status"}``, a newline, the answer's JSON (relayed as it is)."""
    header, _, answer = text.partition("\n")
    return int(json.loads(header)["status"]), answer.encode()


def _decoded(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {"error": raw[:200].decode(errors="replace")}
    return value if isinstance(value, dict) else {"error": str(value)[:200]}
