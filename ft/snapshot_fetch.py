"""The recovering side of a catch-up: download a snapshot from a source, trying the next one if it fails.

``freescale.ft.catchup`` says what a snapshot is and serves it (the source side); this module asks for
it over HTTP (the header: step, layout, stream address, ticket) and reads its bytes from the source's
raw stream (``freescale.ft.snapshot_stream``) straight into the rank's own tensors where they fit.
``SnapshotFetch`` runs that on a side thread while the rank trains with weight 0 (``freescale.ft.ftar``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import torch

from freescale.ft.snapshot_stream import landing, receive_payload, register_socket


@dataclass
class Fetched:
    """A downloaded snapshot: its step, its tensors (in place where ``own`` allowed) and timings."""

    step: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    waited_s: float
    """From the request to the header: the source reaching a step boundary and staging there."""
    transfer_s: float
    """From the header to the last byte, landed."""
    arrived: float
    """Wall time (``time.time``) of the last byte."""
    in_place: int = 0
    """Bytes written straight into the recovering rank's own tensors."""

    @property
    def rate(self) -> float:
        """Payload bytes per second of the transfer alone (a sub-figure: catch-up time is end to end)."""
        return self.nbytes / max(self.transfer_s, 1e-9)


def fetch_snapshot(address: str, min_step: int, token: str = "", timeout_s: float = 60.0,
                   own: dict[str, torch.Tensor] | None = None, cancelled: threading.Event | None = None,
                   sockets: list[socket.socket] | None = None, copied: bool = False, shards_only: bool = False
                   ) -> Fetched:
    """Download a snapshot of step >= ``min_step`` from ``address``: the header over HTTP, the bytes
    over the source's stream (``freescale.ft.snapshot_stream``).

    ``own``: where its tensors may land, the recovering rank's own state by snapshot name.  A
    tensor of the same dtype and shape, contiguous and in host memory, is written in place (no
    buffer, no load copy); the caller must not touch those until the download ended.  Any other
    (on a GPU, not built yet) gets a tensor of its own.  ``sockets`` collects the connections it
    opens (``SnapshotFetch.cancel`` shuts them down: a blocked read returns at once).  ``copied``:
    ask for a copied snapshot (a live one's transfer was cut: this state does not cross within a
    source's step), which the source stages at its next commit and from then on.  ``shards_only``: the sharded
    tensors' shards alone (``only=shards``: a lost position's table shards, without the dense state again).
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    host, _, port = address.rpartition(":")
    query = urllib.parse.urlencode({"min_step": min_step, "wait_s": timeout_s, **({"copied": 1} if copied else {}),
                                    **({"only": "shards"} if shards_only else {})})
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s + 5)
    own = own or {}
    try:
        conn.connect()
        if conn.sock is not None:
            register_socket(conn.sock, sockets, cancelled, address)
        conn.request("GET", f"/v1/snapshot?{query}", headers=headers)
        response = conn.getresponse()
        body = response.read(64 << 20)
        if response.status != 200:
            raise SourceRefused(f"snapshot source {address} answered {response.status}: "
                                f"{body[:200].decode(errors='replace')}")
        header = json.loads(body)
        total = header.get("payload_bytes") if isinstance(header, dict) else None
        if not isinstance(header, dict) or not isinstance(header.get("step"), int) or not isinstance(
                header.get("tensors"), list) or not (isinstance(total, int) and total >= 0) or not isinstance(
                header.get("stream"), str) or not isinstance(header.get("ticket"), str):
            raise ValueError(f"snapshot source {address} sent a malformed header")
        waited = time.perf_counter() - start
        tensors = receive_payload(header["stream"], header["ticket"], header["tensors"], total,
                                  lambda entry: landing(entry, own), timeout_s, cancelled, sockets)
    except (http.client.HTTPException, OSError, KeyError, TypeError, json.JSONDecodeError, RuntimeError,
            MemoryError) as exc:  # RuntimeError, MemoryError: a header whose shapes torch cannot allocate
        if isinstance(exc, ConnectionError) and str(exc).startswith("snapshot source"):
            raise
        raise ConnectionError(f"snapshot source {address}: transfer broken: {exc}") from None
    finally:
        conn.close()
    transfer_s = time.perf_counter() - start - waited
    in_place = sum(t.numel() * t.element_size() for name, t in tensors.items()
                   if name in own and t.data_ptr() == own[name].data_ptr())
    return Fetched(int(header["step"]), tensors, total, waited, transfer_s, time.time(), in_place)


class SourceRefused(ConnectionError):
    """A source answered the request with an error status (catching up itself, no snapshot in time, a bad token)."""


class SnapshotFetch:
    """A recovering replica's download of a snapshot of step >= ``min_step``, on a worker thread,
    trying each source in turn (three rounds): a source that dies mid-transfer costs one retry.

    ``log`` collects what the catch-up record reports (sources, the one used, failures)."""

    def __init__(self, sources: list[str], min_step: int, token: str, log: dict[str, Any],
                 own: dict[str, torch.Tensor] | None = None, shards_only: bool = False) -> None:
        self.sources, self.min_step, self.token, self.log = sources, min_step, token, log
        self.own, self.shards_only = own, shards_only
        self._result: Fetched | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, name="freescale-catchup", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        """Abandon the download and wait until it stopped writing (it may land in the rank's own tensors,
        which the next download writes): its connections are shut down, so a read blocked on a silent
        source returns at once."""
        self._cancelled.set()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            raise RuntimeError("catch-up: an abandoned snapshot download did not stop within 30 s")

    def _run(self) -> None:
        errors: list[str] = []
        broken = False  # a transfer broke (not a refusal: a source catching up itself, nothing staged in time)
        try:
            for _ in range(3):
                for address in self.sources:
                    self.log.setdefault("requested", time.time())  # the first request
                    try:
                        self._result = fetch_snapshot(address, self.min_step, self.token, own=self.own,
                                                      cancelled=self._cancelled, sockets=self._sockets,
                                                      copied=broken,  # after a broken transfer: never live
                                                      shards_only=self.shards_only)
                        self.log.update(source=address, failed_sources=errors)
                        return
                    except (ConnectionError, ValueError) as exc:
                        errors.append(f"{address}: {exc}")
                        broken = broken or not isinstance(exc, SourceRefused)
                        if self._cancelled.is_set():
                            raise
            self._error = RuntimeError(f"catch-up: every source failed: {'; '.join(errors[-len(self.sources):])}")
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    @property
    def arrived(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the download to end (arrived, or failed); whether it did."""
        return self._done.wait(max(timeout_s, 0.0))

    def result(self) -> Fetched:
        """The downloaded snapshot; blocks until the download ends."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class PositionsFetch:
    """The snapshots of every rank position a rank serves, as one download (``SnapshotFetch``'s surface).

    A rank of a group running on fewer ranks than its own holds the table shards of several positions
    (``freescale.shrunk_plan``): it takes its own position's snapshot (landing in place, its data side, RNGs and
    the rest come from it) and, beside it, each other position's from the peer rank serving that position,
    only the shards (``only=shards``: the dense state is its own position's), into tensors of their own.  All must be of one step: a
    source that staged an older one is asked again for the newest (three times at most)."""

    def __init__(self, sources: list[list[str]], min_step: int, token: str, log: dict[str, Any],
                 own: dict[str, torch.Tensor] | None = None) -> None:
        self.sources, self.token = sources, token
        # The other positions' shards land in tensors of their own, copied in at the load: a peer group on fewer
        # ranks serves every position from one rank, so its shards may include this position's, which its own
        # fetch writes in place; and a stale fetch, redone, must not leave its bytes in the rank's tensors.
        self.fetches = [SnapshotFetch(sources[0], min_step, token, log, own),
                        *(SnapshotFetch(s, min_step, token, {}, shards_only=True) for s in sources[1:])]

    def cancel(self) -> None:
        for fetch in self.fetches:
            fetch.cancel()

    @property
    def arrived(self) -> bool:
        return all(fetch.arrived for fetch in self.fetches)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every position's download to end; whether they did."""
        deadline = time.monotonic() + timeout_s
        return all(fetch.wait(deadline - time.monotonic()) for fetch in self.fetches)

    def result(self) -> Fetched:
        """The positions' snapshots merged (its own position's tensors first); blocks until all are in."""
        got = [fetch.result() for fetch in self.fetches]
        for attempt in range(4):
            step = max(g.step for g in got)
            if all(g.step == step for g in got):
                break
            if attempt == 3:
                raise RuntimeError(f"catch-up: the snapshots of the positions this rank serves stay at different "
                                   f"steps {[g.step for g in got]}")
            got = [g if g.step == step else SnapshotFetch(s, step, self.token, {}, shards_only=i > 0).result()
                   for i, (g, s) in enumerate(zip(got, self.sources))]
        own, *others = got
        tensors = {name: t for other in others for name, t in other.tensors.items()}
        tensors.update(own.tensors)
        return Fetched(own.step, tensors, sum(g.nbytes for g in got), max(g.waited_s for g in got),
                       max(g.transfer_s for g in got), max(g.arrived for g in got), own.in_place)
