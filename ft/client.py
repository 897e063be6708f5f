"""A rank's side of the lighthouse: heartbeats on a thread, quorum and commit requests.

Every rank of every replica group runs one ``LighthouseClient``: in a group of one rank it
talks to the lighthouse, in a larger group to the group's agent on member 0, which speaks
for the group (``freescale.ft.group_agent``; same API).  Heartbeats go out every
``heartbeat_interval_s`` (or as slowly as a loaded lighthouse asks: ``beat_every_s`` in its
replies) on their own HTTP session and thread, so a long forward or a blocked collective
never makes a live rank look dead.
``quorum_async`` starts the step's quorum request on a worker thread; the
trainer calls it at the start of a step so the round trip overlaps the forward
and reads the result before the gradient exchange.

Every request (``_request``: one path for all of them; the commit vote first
tries a send-now-read-later shortcut, ``commit_async``, and falls back to it)
retries on connection errors and transient 5xx answers (502, 503, 504: a lighthouse restarting, or a
proxy in front of it) until ``request_timeout_s``, sleeping with exponential
backoff and full jitter in between (20 ms doubling to a 1 s cap), so the ranks of
many groups do not reconnect in lockstep.  A lighthouse that is restarted (same
address) is re-registered with by the next heartbeat, and the quorum id the
client last saw travels with each quorum request so the new lighthouse keeps ids
growing.  ``http://`` and ``https://`` URLs are accepted (https with the default
SSL context: system CAs, or ``SSL_CERT_FILE`` for a private one); any other
scheme is refused when the client is made.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from freescale.ft.membership import PROGRESS_LOST
from freescale.ft.serving import backoff_delays
from freescale.step_types import JobFinished

_TRANSIENT_STATUSES = frozenset({502, 503, 504})
"""Answers worth retrying: a proxy that cannot reach a restarting lighthouse, or an overloaded one.
Other 5xx (500: a lighthouse bug) and every 4xx are reported at once."""


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


def _keep_alive(sock: socket.socket | None) -> None:
    """No read timeout on the held presence request, but TCP keep-alive probes (after 5 s idle,
    every 2 s, 3 missed): a lighthouse whose host vanished is given up in ~11 s and reconnected."""
    if sock is None:
        return
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class LighthouseError(RuntimeError):
    pass


class ProgressLost(LighthouseError):
    """Every group that held the run's progress is gone: no restart of this group can fix it (the
    run must start again from a checkpoint)."""


@dataclass(frozen=True)
class Participant:
    replica_id: str
    incarnation: int
    step: int
    addresses: tuple[str, ...] = ()
    """Each member's snapshot server (``freescale.ft.catchup``), "" where it runs none."""


@dataclass(frozen=True)
class Quorum:
    quorum_id: int
    participants: tuple[Participant, ...]
    max_step: int
    store_host: str
    store_port: int
    high_step: int = -1
    """Highest step any earlier quorum reached (see ``freescale.ft.lighthouse``)."""

    @staticmethod
    def from_json(body: dict[str, Any]) -> Quorum:
        host, _, port = str(body.get("store") or "").rpartition(":")
        return Quorum(
            quorum_id=int(body["quorum_id"]),
            participants=tuple(Participant(str(p["replica_id"]), int(p["incarnation"]), int(p["step"]),
                                           tuple(str(a) for a in p.get("addresses", ())))
                               for p in body["participants"]),
            max_step=int(body["max_step"]), store_host=host, store_port=int(port or 0),
            high_step=int(body.get("high_step", -1)),
        )

    def index_of(self, replica_id: str) -> int:
        for i, p in enumerate(self.participants):
            if p.replica_id == replica_id:
                return i
        raise LighthouseError(f"replica '{replica_id}' is not in quorum {self.quorum_id}")

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(p.replica_id for p in self.participants)


class LighthouseClient:
    def __init__(
        self,
        url: str,
        replica_id: str,
        incarnation: int,
        member: int = 0,
        group_size: int = 1,
        token: str = "",
        heartbeat_interval_s: float = 0.05,
        request_timeout_s: float = 60.0,
        run_id: str = "",
    ) -> None:
        self.url = url.rstrip("/")
        parsed = urllib.parse.urlsplit(self.url)
        try:
            port = parsed.port
        except ValueError:
            port = -1
        if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1:
            raise LighthouseError(f"lighthouse URL {url!r} is not http://HOST[:PORT] or https://HOST[:PORT]")
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, port
        self._ssl_context = ssl.create_default_context() if self._https else None
        """Made once (loading the CAs costs milliseconds); every thread's connection shares it."""
        self._rng = random.Random()
        self._sleep = time.sleep
        self.identity = {"replica_id": replica_id, "incarnation": incarnation, "member": member,
                         "group_size": group_size, "run_id": run_id}
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.heartbeat_interval_s = heartbeat_interval_s
        self.request_timeout_s = request_timeout_s
        self.last_quorum_id = 0
        self.address = ""
        """This rank's snapshot server, announced with every quorum request."""
        self.store = ""
        """Member 0's rendezvous store (``freescale.ft.replica_group.RendezvousStore``), announced likewise."""
        self.progress: dict[str, Any] = {}
        """``{quorum_id, step, ready}`` of this rank's last committed step, sent with every heartbeat
        (what a lighthouse restarted without its state file rebuilds the run's facts from)."""
        self.notes: dict[str, Any] = {}
        """More this rank tells the lighthouse with every heartbeat, for its ``/v1/status`` (``fail_slow``: the job's
        fail-slow ranks, ``freescale.speed_share``)."""
        self.waiting_reason = ""
        """Why the lighthouse holds this group back (its last ``waiting`` answer), "" when it does not."""
        self.on_waiting: Callable[[str], None] = lambda why: None
        """Called once per new ``waiting`` reason (the trainer prints it, in one line)."""
        self._lighthouse_quorum: tuple[int | None, bool] = (None, False)
        """(current quorum id, lost) from the last heartbeat reply."""
        self._last_quorum: dict[str, Any] | None = None
        """The last quorum answer accepted, as sent (what a compact ``next`` refers to)."""
        self._next: tuple[int, Quorum] | None = None
        """(step, quorum) from the last committed vote's reply: that step's quorum, already decided."""
        self.joiner_waiting = False
        """The last committed vote's answer said a group waits to join, behind that step: stage it."""
        self.joiners: tuple[tuple[str, int], ...] = ()
        """The groups among them that join by waiting, with their ranks (the answer's ``joining``; the same in every
        answer of the vote): the data side plans them into the next step."""
        self.join_mode = "record"
        """``[ft] join``: sent with quorum requests as ``"join": "wait"`` (the lighthouse names only such joiners)."""
        self._local = threading.local()
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeat_loop, name="freescale-heartbeat", daemon=True)
        self._presence = threading.Thread(target=self._presence_loop, name="freescale-presence", daemon=True)
        self._presence_conn: http.client.HTTPConnection | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freescale-quorum")

    @property
    def replica_id(self) -> str:
        return str(self.identity["replica_id"])

    def start(self) -> LighthouseClient:
        self._beats.start()
        self._presence.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._beats.ident is not None:  # started (a client used without heartbeats closes too)
            self._beats.join(timeout=2)
        conn = self._presence_conn
        if conn is not None and conn.sock is not None:
            try:  # wakes the thread blocked reading the held request, and tells the lighthouse now
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.drop_connection()

    # ------------------------------------------------------------------ requests
    def _connection(self) -> http.client.HTTPConnection:
        """This thread's keep-alive connection (http.client: ~0.2 ms a request on loopback,
        about a quarter of ``requests``' cost, and the commit vote is on every step's path)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._https:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.request_timeout_s,
                                                   context=self._ssl_context)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self.request_timeout_s)
            self._local.conn = conn
        return conn

    def drop_connection(self) -> None:
        """Close this thread's connection (it failed, or a request on it was left unanswered)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _send(self, method: str, path: str, body: dict[str, Any] | None,
              timeout_s: float) -> http.client.HTTPConnection:
        """Write one request (``body`` with this client's identity, or None: GET) on this thread's
        connection; ``_receive`` reads its answer."""
        headers = dict(self.headers)
        payload = None if body is None else json.dumps({**self.identity, **body})
        if payload is not None:
            headers["Content-Type"] = "application/json"
        conn = self._connection()
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        conn.request(method, path, payload, headers)
        return conn

    @staticmethod
    def _receive(conn: http.client.HTTPConnection) -> tuple[int, Any]:
        """(status, parsed JSON answer; a body that is not JSON as ``{"error": its start}``)."""
        response = conn.getresponse()
        status, raw = response.status, response.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, {"error": raw[:200].decode(errors="replace")}

    def _request(self, method: str, path: str, body: dict[str, Any] | None,
                 timeout_s: float | None = None) -> dict[str, Any]:
        """The one way to the lighthouse: ``body`` (sent with this client's identity) or None (GET).

        Connection errors and transient answers (502/503/504) are retried, with backoff, until
        ``timeout_s`` (default ``request_timeout_s``) has passed; then, or at once for any other
        answer than 200 (4xx: a refused request), a one-line ``LighthouseError`` naming the URL,
        the path and the lighthouse's message."""
        deadline = time.monotonic() + (timeout_s or self.request_timeout_s)
        delays = backoff_delays(self._rng)
        reconnected = False
        while True:
            open_conn = getattr(self._local, "conn", None)
            reused = open_conn is not None and open_conn.sock is not None  # a keep-alive from before
            try:
                status, answer = self._receive(self._send(method, path, body, max(0.1, deadline - time.monotonic())))
            except ssl.SSLCertVerificationError as exc:  # not transient: retrying cannot fix it
                self.drop_connection()
                raise LighthouseError(f"lighthouse {self.url}{path}: TLS certificate not trusted: "
                                      f"{_one_line(exc.verify_message or exc)}") from None
            except (OSError, http.client.HTTPException) as exc:
                self.drop_connection()  # lighthouse down, restarting, or the keep-alive closed
                failure = f"lighthouse {self.url} unreachable for {path}: {_one_line(exc) or type(exc).__name__}"
                if reused and not reconnected and not isinstance(exc, TimeoutError):
                    reconnected = True  # most likely an idle keep-alive the server closed: reconnect at once
                    continue
            else:
                if status == 200:
                    return dict(answer)
                message = answer.get("error", answer) if isinstance(answer, dict) else answer
                failure = f"lighthouse {self.url}{path} answered {status}: {_one_line(message)}"
                if status not in _TRANSIENT_STATUSES:
                    raise LighthouseError(failure)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LighthouseError(failure)
            self._sleep(min(next(delays), remaining))

    def quorum(self, step: int) -> Quorum:
        """Block until a quorum including this replica forms (see ``freescale.ft.lighthouse``).

        When the last committed vote's reply carried this step's quorum, that is the answer,
        without a request."""
        known, self._next = self._next, None
        if known is not None and known[0] == step:
            return known[1]
        while True:
            try:
                answer = self._request("POST", "/v1/quorum", {
                    "step": step, "last_quorum_id": self.last_quorum_id, "address": self.address, "store": self.store,
                    **({"join": "wait"} if self.join_mode == "wait" else {})})
            except LighthouseError as exc:
                if PROGRESS_LOST in str(exc):  # the lighthouse's refusal (``freescale.ft.membership``)
                    raise ProgressLost(str(exc)) from None
                raise
            why = answer.get("waiting")
            if not isinstance(why, str):
                self.waiting_reason = ""
                return self._accept(answer)
            if why != self.waiting_reason:  # held back so no step is committed twice: say why once, ask again
                self.waiting_reason = why
                self.on_waiting(why)
            if self._stop.wait(0.25):
                raise LighthouseError(f"lighthouse {self.url}: client closed while waiting ({why})")

    def _accept(self, body: dict[str, Any]) -> Quorum:
        if body.get("finished"):
            raise JobFinished(int(body["finished_step"]))
        quorum = Quorum.from_json(body)
        self._last_quorum = body
        if quorum.max_step < quorum.high_step:
            raise ProgressLost(
                f"quorum {quorum.quorum_id} reaches step {quorum.max_step} but the run had reached step "
                f"{quorum.high_step}: every group holding that progress is gone, so no one can catch up from it; "
                "start the job again with --resume (a new run, from the newest checkpoint)")
        self.last_quorum_id = max(self.last_quorum_id, quorum.quorum_id)
        return quorum

    def quorum_async(self, step: int) -> Future[Quorum]:
        if self._next is not None and self._next[0] == step:
            done: Future[Quorum] = Future()
            done.set_result(self.quorum(step))
            return done
        return self._pool.submit(self.quorum, step)

    def commit(self, quorum_id: int, step: int, ok: bool) -> bool:
        """The step's commit vote: True only if every member of every participant voted ok.

        A committed reply may carry step + 1's quorum (``quorum`` then answers it without a
        request); ``forget_next`` drops it when this rank does not go on to that step."""
        return self.commit_async(quorum_id, step, ok)()

    def commit_async(self, quorum_id: int, step: int, ok: bool, ready: bool = True) -> Callable[[], bool]:
        """Send the step's commit vote now; the returned call reads the outcome (``commit``'s).

        The lighthouse answers once every participant voted, so the caller can do work that
        changes no state (build the committed update) while the other groups vote.  Sent and
        read on this thread's keep-alive connection, no thread hand-off; if either half fails
        the vote goes again through the retrying request path (a vote is idempotent: a
        member's ballot for a quorum and step is recorded once), within the same
        ``request_timeout_s``.  ``ready``: this rank holds valid state (it is not catching up): the
        lighthouse counts the groups that commit ready as the holders of the run's progress.  Read it on this thread, with no other request of this thread in
        between (they share its connection); one left unread is dropped with ``drop_connection``."""
        body = {"quorum_id": quorum_id, "step": step, "ok": ok, "ready": ready}
        deadline = time.monotonic() + self.request_timeout_s
        conn: http.client.HTTPConnection | None = None
        try:
            conn = self._send("POST", "/v1/commit", body, self.request_timeout_s)
        except (OSError, http.client.HTTPException):
            self.drop_connection()

        def outcome() -> bool:
            answer: Any = None
            if conn is not None:
                try:
                    status, answer = self._receive(conn)
                    answer = answer if status == 200 else None
                except (OSError, http.client.HTTPException):
                    self.drop_connection()
            if not isinstance(answer, dict) or "commit" not in answer:  # retries, or a one-line error
                answer = self._request("POST", "/v1/commit", body, timeout_s=max(0.1, deadline - time.monotonic()))
            return self._took_vote(step, answer)
        return outcome

    def _took_vote(self, step: int, body: dict[str, Any]) -> bool:
        self._next = None
        self.joiner_waiting = bool(body["commit"]) and body.get("stage") is True
        joining = body.get("joining") if self.joiner_waiting else None
        try:
            self.joiners = tuple((str(r), int(n)) for r, n in joining) if isinstance(joining, list) else ()
        except (TypeError, ValueError):
            self.joiners = ()  # not this protocol's form: plan nobody in (every group reads the same answer)
        following = body.get("next")
        if body["commit"] and isinstance(following, dict):
            try:
                if following.get("same_participants"):  # the last quorum's, at the next step
                    following = self._same_participants(following)
                self._next = None if following is None else (step + 1, self._accept(following))
            except (LighthouseError, KeyError, TypeError, ValueError):
                self._next = None  # not usable: the next step asks the lighthouse as usual
        return bool(body["commit"])

    def _same_participants(self, compact: dict[str, Any]) -> dict[str, Any] | None:
        """A committed vote's ``next`` that names no participants (the lighthouse sends them only
        when they change): the last quorum this client accepted, at ``max_step``; None if that
        quorum is not the one named."""
        last = self._last_quorum
        if last is None or last.get("quorum_id") != compact["quorum_id"]:
            return None
        max_step = int(compact["max_step"])
        return {**last, "max_step": max_step, "high_step": int(compact["high_step"]),
                "participants": [{**p, "step": max_step} for p in last["participants"]]}

    def forget_next(self) -> None:
        self._next = None

    def finish(self, step: int) -> None:
        """This group ran its last step: tell late joiners (restarted groups) to stop."""
        self._request("POST", "/v1/finish", {"step": step})

    def report_failure(self, quorum_id: int) -> None:
        self._request("POST", "/v1/report", {"quorum_id": quorum_id})

    def status(self) -> dict[str, Any]:
        """``GET /v1/status``; retried like every request, a ``LighthouseError`` naming the URL if it stays down."""
        return self._request("GET", "/v1/status", None)

    def quorum_lost(self, quorum_id: int) -> bool:
        """The lighthouse's last heartbeat reply says a collective of ``quorum_id`` cannot complete:
        that quorum lost a participant (failure report, heartbeat timeout, restart) or a newer one
        formed without this rank's help (its peers left it).  False while nothing is known (no
        reply yet, lighthouse restarting: it has no quorum then)."""
        current, lost = self._lighthouse_quorum
        return current is not None and (current > quorum_id or (current == quorum_id and lost))

    def _presence_loop(self) -> None:
        """Hold ``/v1/presence`` open for this process's lifetime (reopened after a lighthouse restart):
        when the process dies its kernel closes the connection, and the lighthouse knows at once."""
        delays = backoff_delays(self._rng)
        while not self._stop.is_set():
            try:
                conn = self._send("POST", "/v1/presence", {}, self.request_timeout_s)
                _keep_alive(conn.sock)  # held until this process ends; a dead lighthouse host is found
                self._presence_conn = conn
                if self._stop.is_set():  # closed while connecting
                    break
                self._receive(conn)  # returns only when the lighthouse goes away (or refuses: 409)
            except (OSError, http.client.HTTPException, ValueError):
                pass
            self.drop_connection()
            self._stop.wait(next(delays))

    def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval_s
        while not self._stop.is_set():
            try:
                reply = self._request("POST", "/v1/heartbeat", {**self.progress, **self.notes},
                                      timeout_s=max(0.5, 4 * self.heartbeat_interval_s))
                current = reply.get("quorum_id")
                self._lighthouse_quorum = (current if isinstance(current, int) else None,
                                           bool(reply.get("quorum_lost")))
                every = reply.get("beat_every_s")
                if isinstance(every, (int, float)) and 0 < every <= 10:  # a loaded lighthouse asks for fewer
                    interval = max(self.heartbeat_interval_s, float(every))
            except LighthouseError:
                pass  # lighthouse down or restarting: keep beating, the next one re-registers
            self._stop.wait(interval)
        self.drop_connection()
