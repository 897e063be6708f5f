"""A rank's side of the lighthouse: heartbeats on a thread, quorum and commit requests.

Every rank of every replica group runs one ``LighthouseClient``.  Heartbeats go
out every ``heartbeat_interval_s`` on their own HTTP session and thread, so a
long forward or a blocked collective never makes a live rank look dead.
``quorum_async`` starts the step's quorum request on a worker thread; the
trainer calls it at the start of a step so the round trip overlaps the forward
and reads the result before the gradient exchange.

Every request retries on connection errors until ``request_timeout_s``: a
lighthouse that is restarted (same address) is re-registered with by the next
heartbeat, and the quorum id the client last saw travels with each request so
the new lighthouse keeps ids growing.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any



class LighthouseError(RuntimeError):
    pass


class JobFinished(Exception):
    """Another group finished the run (``POST /v1/finish``): there is nothing left to train."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the run finished at step {step}")
        self.step = step


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
        host, _, port = str(body["store"]).rpartition(":")
        return Quorum(
            quorum_id=int(body["quorum_id"]),
            participants=tuple(Participant(str(p["replica_id"]), int(p["incarnation"]), int(p["step"]),
                                           tuple(str(a) for a in p.get("addresses", ())))
                               for p in body["participants"]),
            max_step=int(body["max_step"]), store_host=host, store_port=int(port),
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
        self.identity = {"replica_id": replica_id, "incarnation": incarnation, "member": member,
                         "group_size": group_size, "run_id": run_id}
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.heartbeat_interval_s = heartbeat_interval_s
        self.request_timeout_s = request_timeout_s
        self.last_quorum_id = 0
        self.address = ""
        """This rank's snapshot server, announced with every quorum request."""
        self._lighthouse_quorum: tuple[int | None, bool] = (None, False)
        """(current quorum id, lost) from the last heartbeat reply."""
        self._next: tuple[int, Quorum] | None = None
        """(step, quorum) from the last committed vote's reply: that step's quorum, already decided."""
        self._local = threading.local()
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeat_loop, name="freescale-heartbeat", daemon=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freescale-quorum")

    @property
    def replica_id(self) -> str:
        return str(self.identity["replica_id"])

    def start(self) -> LighthouseClient:
        self._beats.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._beats.join(timeout=2)
        self._drop_connection()

    # ------------------------------------------------------------------ requests
    def _connection(self) -> http.client.HTTPConnection:
        """This thread's keep-alive connection (http.client: ~0.2 ms a request on loopback,
        about a quarter of ``requests``' cost, and the commit vote is on every step's path)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            parsed = urllib.parse.urlsplit(self.url)
            cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
            conn = cls(parsed.hostname or "127.0.0.1", parsed.port, timeout=self.request_timeout_s)
            self._local.conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _post(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (timeout_s or self.request_timeout_s)
        payload = json.dumps({**self.identity, **body})
        headers = {"Content-Type": "application/json", **self.headers}
        while True:
            try:
                conn = self._connection()
                conn.timeout = max(0.1, deadline - time.monotonic())
                if conn.sock is not None:
                    conn.sock.settimeout(conn.timeout)
                conn.request("POST", path, payload, headers)
                response = conn.getresponse()
                status, raw = response.status, response.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop_connection()  # lighthouse down, restarting, or the keep-alive closed
                if time.monotonic() >= deadline:
                    raise LighthouseError(f"lighthouse {self.url} unreachable for {path}: {exc}") from None
                time.sleep(0.05)
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                answer = {"error": raw[:200].decode(errors="replace")}
            if status == 200:
                return dict(answer)
            raise LighthouseError(f"lighthouse {self.url}{path} answered {status}: {answer.get('error', answer)}")

    def quorum(self, step: int) -> Quorum:
        """Block until a quorum including this replica forms (see ``freescale.ft.lighthouse``).

        When the last committed vote's reply carried this step's quorum, that is the answer,
        without a request."""
        known, self._next = self._next, None
        if known is not None and known[0] == step:
            return known[1]
        return self._accept(self._post("/v1/quorum", {"step": step, "last_quorum_id": self.last_quorum_id,
                                                      "address": self.address}))

    def _accept(self, body: dict[str, Any]) -> Quorum:
        if body.get("finished"):
            raise JobFinished(int(body["finished_step"]))
        quorum = Quorum.from_json(body)
        if quorum.max_step < quorum.high_step:
            raise LighthouseError(
                f"quorum {quorum.quorum_id} reaches step {quorum.max_step} but the run had reached step "
                f"{quorum.high_step}: every group holding that progress is gone, so no one can catch up from it; "
                "restart the run (from a checkpoint) instead")
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
        body = self._post("/v1/commit", {"quorum_id": quorum_id, "step": step, "ok": ok})
        self._next = None
        following = body.get("next")
        if body["commit"] and isinstance(following, dict):
            try:
                self._next = (step + 1, self._accept(following))
            except (LighthouseError, KeyError, TypeError, ValueError):
                self._next = None  # not usable: the next step asks the lighthouse as usual
        return bool(body["commit"])

    def forget_next(self) -> None:
        self._next = None

    def finish(self, step: int) -> None:
        """This group ran its last step: tell late joiners (restarted groups) to stop."""
        self._post("/v1/finish", {"step": step})

    def report_failure(self, quorum_id: int) -> None:
        self._post("/v1/report", {"quorum_id": quorum_id})

    def status(self) -> dict[str, Any]:
        """``GET /v1/status``; retried like every request, a ``LighthouseError`` naming the URL if it stays down."""
        deadline = time.monotonic() + self.request_timeout_s
        parsed = urllib.parse.urlsplit(self.url)
        while True:
            conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=5)
            try:
                conn.request("GET", "/v1/status", headers=self.headers)
                response = conn.getresponse()
                raw = response.read()
                if response.status != 200:
                    raise LighthouseError(f"lighthouse {self.url}/v1/status answered {response.status}: "
                                          f"{raw[:200].decode(errors='replace')}")
                return dict(json.loads(raw))
            except (OSError, http.client.HTTPException) as exc:
                if time.monotonic() >= deadline:
                    raise LighthouseError(f"lighthouse {self.url} unreachable: {exc}") from None
                time.sleep(0.1)
            finally:
                conn.close()

    def quorum_lost(self, quorum_id: int) -> bool:
        """The lighthouse's last heartbeat reply says a collective of ``quorum_id`` cannot complete:
        that quorum lost a participant (failure report, heartbeat timeout, restart) or a newer one
        formed without this rank's help (its peers left it).  False while nothing is known (no
        reply yet, lighthouse restarting: it has no quorum then)."""
        current, lost = self._lighthouse_quorum
        return current is not None and (current > quorum_id or current == quorum_id and lost)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                reply = self._post("/v1/heartbeat", {}, timeout_s=max(0.5, 4 * self.heartbeat_interval_s))
                current = reply.get("quorum_id")
                self._lighthouse_quorum = (current if isinstance(current, int) else None,
                                           bool(reply.get("quorum_lost")))
            except LighthouseError:
                pass  # lighthouse down or restarting: keep beating, the next one re-registers
            self._stop.wait(self.heartbeat_interval_s)
        self._drop_connection()
