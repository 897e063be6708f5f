"""The snapshot's bytes on a raw TCP stream: a blocking ``sendall`` per segment out, one ``recv_into`` per tensor in.

``freescale.ft.catchup`` answers a fetcher's HTTP request (the token, the wait for a staged step, the
errors) with the snapshot's JSON header, the address of this stream and a one-time ticket; the fetcher
connects, sends the ticket and reads the payload here.  Why not the HTTP response itself: both
trainers' processes run their training thread beside the transfer, and an event loop (or
``http.client``'s buffered reader) takes the GIL back once per socket buffer, a few MB; with a
training thread holding it, each take waits up to the interpreter's switch interval (5 ms), which held
the rate near 0.5 GB/s on a busy 2-core machine.  Here the sender's ``sendall`` of each segment (a
large live tensor, or a run of the staging buffer: a few per payload) on a blocking socket is one
system call without the GIL, and the receiver reads each tensor with
``MSG_WAITALL`` straight into its landing place (the rank's own tensor where it fits): one release
of the GIL per 64 MB, no buffer, no load copy.  Timeouts are the kernel's (``SO_SNDTIMEO`` /
``SO_RCVTIMEO``), so the sockets stay blocking.  Nothing is unpickled: raw bytes, laid out by the header.

A payload is a list of segments (``Payload``): a staging buffer, or the source's own tensors served
in place (``SnapshotServer``'s live snapshots), one ``sendall`` each.  ``revoke`` and ``cut`` end
every transfer of a payload (its unused tickets released, its connections shut down): the source's
fence before it changes tensors that are being sent.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("freescale.ft.catchup")

DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int8, torch.uint8, torch.bool)}
"""The dtypes a snapshot carries, by name in its header."""
ALIGN = 64
"""Every tensor starts at a multiple of 64 bytes in the payload: any dtype can be viewed in place."""
PIECE_BYTES = 64 << 20
"""A tensor is read in pieces of at most 64 MB: a cancelled download stops within one piece."""
TICKET_TTL_S = 60.0
"""A ticket not used within this long is released (its buffer may be reused) and refused."""
TICKET_BYTES = 32
TICKET_WAIT_S = 2.0
"""A connection must send its ticket within this long."""
MAX_THREADS = 256
RATE_MIN_BYTES = 16 << 20
"""A transfer this large or larger measures the path's rate (a smaller one measures its latency)."""


@dataclass(eq=False)
class Payload:
    """What one ticket streams: ``segments`` of (offset, flat uint8 tensor in host memory), in offset
    order and not overlapping, zero bytes between them and up to ``total`` (padding inside a buffer
    segment is whatever the buffer held: the receiver discards padding)."""

    segments: list[tuple[int, torch.Tensor]]
    total: int
    part_of: Payload | None = None
    """The payload this one is a part of (``sub_payload``: its segments are views of that one's)."""

    def within(self, payload: Payload) -> bool:
        """Whether this is ``payload`` or a part of it (revoked and cut with it)."""
        return self is payload or self.part_of is payload

    @classmethod
    def of(cls, buffer: torch.Tensor) -> Payload:
        """One flat uint8 buffer, all of it."""
        return cls([(0, buffer)], buffer.numel())


def sub_payload(payload: Payload, entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Payload]:
    """Some of a payload's tensors (``entries``, header entries of it) laid end to end, each aligned: the header
    entries at their new offsets and the payload, its segments views of ``payload``'s (nothing copied).  A
    tensor's bytes are always in a segment (only padding lies between segments)."""
    chosen: list[dict[str, Any]] = []
    segments: list[tuple[int, torch.Tensor]] = []
    ends = [offset + segment.numel() for offset, segment in payload.segments]  # ascending: segments are in order
    at = 0
    for entry in sorted(entries, key=lambda e: e["offset"]):
        first, last = entry["offset"], entry["offset"] + entry["nbytes"]
        for offset, segment in payload.segments[bisect.bisect_right(ends, first):]:  # the first that ends after it
            if offset >= last:
                break
            lo, hi = max(offset, first), min(offset + segment.numel(), last)
            if lo < hi:
                segments.append((at + lo - first, segment[lo - offset:hi - offset]))
        chosen.append({**entry, "offset": at})
        at += -(-entry["nbytes"] // ALIGN) * ALIGN
    return chosen, Payload(segments, at, payload)


def _kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket, kernel-side timeouts: a stalled peer ends a send or a receive with an error."""
    sock.settimeout(None)
    timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


class PayloadStreamer:
    """The source side: a listener thread; each fetcher with a valid ticket gets the staged payload."""

    def __init__(self, host: str, advertise: str, timeout_s: float = 60.0) -> None:
        self._listener = socket.create_server((host, 0))
        self.address = f"{advertise}:{self._listener.getsockname()[1]}"
        self.timeout_s = timeout_s
        self._tickets: dict[str, tuple[Payload, int, float, Callable[[], None]]] = {}
        self._sending: dict[socket.socket, Payload] = {}
        """The connections streaming now, and what: ``cut`` shuts those of one payload down."""
        self._lock = threading.Lock()
        self.on_stream: Callable[[int], None] | None = None
        """Fault injection (tests): called with the snapshot's step as its bytes start to go out."""
        self.bytes_served = 0
        self.rate_bps: float | None = None
        """The rate of the last whole transfer of at least ``RATE_MIN_BYTES`` (its ``sendall`` calls: the
        fetcher's receive is in it, since the kernel's buffers are small beside such a payload)."""
        self._closed = False
        threading.Thread(target=self._accept, name="freescale-snapshot-stream", daemon=True).start()

    def offer(self, payload: Payload, step: int, done: Callable[[], None]) -> str:
        """A one-time ticket for ``payload`` (``done`` is called once it was sent, failed or expired)."""
        self.sweep()
        ticket = secrets.token_hex(TICKET_BYTES // 2)
        with self._lock:
            self._tickets[ticket] = (payload, step, time.monotonic(), done)
        return ticket

    def sweep(self) -> None:
        """Release the tickets nobody used in time (a fetcher that died before connecting)."""
        now = time.monotonic()
        self._release(lambda payload, offered: now - offered > TICKET_TTL_S)

    def revoke(self, payload: Payload) -> None:
        """Release the tickets of ``payload`` (or a part of it) that no fetcher has used yet (refused if used later)."""
        self._release(lambda mine, offered: mine.within(payload))

    def _release(self, which: Callable[[Payload, float], bool]) -> None:
        """Drop the unused tickets ``which(payload, offered_at)`` picks; their ``done`` runs outside the lock."""
        with self._lock:
            picked = [t for t, (payload, _, offered, _) in self._tickets.items() if which(payload, offered)]
            released = [self._tickets.pop(t)[3] for t in picked]
        for release in released:
            release()

    def cut(self, payload: Payload) -> bool:
        """Shut down every connection streaming ``payload`` or a part of it (a ``sendall`` blocked on a stalled fetcher
        returns at once; the fetcher sees a broken stream and tries again, elsewhere or later); True if
        there was one.  Under the lock: a sender leaves ``_sending`` before it closes its socket."""
        with self._lock:
            streaming = [conn for conn, sent in self._sending.items() if sent.within(payload)]
            for conn in streaming:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        return bool(streaming)

    def close(self) -> None:
        """Stop listening (the accept loop wakes up and ends) and release every ticket not used."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._release(lambda payload, offered: True)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if threading.active_count() > MAX_THREADS:  # a flood of connections: refuse, stay up
                conn.close()
                continue
            try:
                threading.Thread(target=self._send, args=(conn,), name="freescale-snapshot-send", daemon=True).start()
            except RuntimeError:  # no thread to be had: drop this one, keep accepting
                conn.close()

    def _send(self, conn: socket.socket) -> None:
        with conn:
            _kernel_timeout(conn, TICKET_WAIT_S)  # a connection that says nothing is dropped soon
            try:
                ticket = _recv_exactly(conn, TICKET_BYTES, "fetcher").decode("ascii", errors="replace")
            except (ConnectionError, OSError):
                return
            with self._lock:
                entry = self._tickets.pop(ticket, None)
                if entry is not None:
                    self._sending[conn] = entry[0]
            if entry is None:
                return  # unknown, used or revoked: close without a byte
            payload, step, offered, done = entry
            try:
                if time.monotonic() - offered > TICKET_TTL_S:
                    return
                _kernel_timeout(conn, self.timeout_s)
                if self.on_stream is not None:
                    self.on_stream(step)
                began = time.perf_counter()
                _send_segments(conn, payload)
                self.bytes_served += payload.total
                if payload.total >= RATE_MIN_BYTES:
                    self.rate_bps = payload.total / max(time.perf_counter() - began, 1e-6)
            except OSError as exc:  # the fetcher died or gave up mid-transfer, or the source cut it
                log.warning("snapshot stream: the transfer of step %d ended early (%s)", step, exc)
            finally:
                with self._lock:
                    del self._sending[conn]
                done()


def _send_segments(conn: socket.socket, payload: Payload) -> None:
    """Each segment with one ``sendall`` (a system call without the GIL), the zero gaps between."""
    at = 0
    for offset, segment in payload.segments:
        if offset > at:
            conn.sendall(bytes(offset - at))
        conn.sendall(memoryview(segment.numpy()))  # type: ignore[arg-type]  # numpy exports the buffer
        at = offset + segment.numel()
    if payload.total > at:
        conn.sendall(bytes(payload.total - at))


def landing(entry: dict[str, Any], own: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where a snapshot tensor goes: the rank's own tensor when it has the same dtype and shape and is
    contiguous in host memory (written in place), else a new tensor."""
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"snapshot: unknown dtype {entry['dtype']!r} for '{entry['name']}'")
    shape = [int(n) for n in entry["shape"]]
    if min(shape, default=0) < 0 or torch.Size(shape).numel() * dtype.itemsize != entry["nbytes"] or (
            entry["offset"] % ALIGN or entry["offset"] < 0):
        raise ValueError(f"snapshot: '{entry['name']}' has {entry['nbytes']} bytes at offset {entry['offset']} "
                         f"for shape {shape} of {entry['dtype']}")
    t = own.get(entry["name"])
    if t is not None and t.dtype == dtype and list(t.shape) == shape and t.is_contiguous() and t.device.type == "cpu":
        return t.detach()
    return torch.empty(shape, dtype=dtype)


def receive_payload(address: str, ticket: str, entries: list[dict[str, Any]], total: int,
                    land: Callable[[dict[str, Any]], torch.Tensor], timeout_s: float,
                    cancelled: threading.Event | None, sockets: list[socket.socket] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Connect to a source's stream, hand in the ticket and read each tensor into ``land(entry)``
    (``sockets`` gets the connection, for a canceller to shut it down)."""
    host, _, port = address.rpartition(":")
    tensors: dict[str, torch.Tensor] = {}
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        register_socket(sock, sockets, cancelled, address)
        _kernel_timeout(sock, timeout_s)
        sock.sendall(ticket.encode("ascii"))
        got = 0
        for entry in sorted(entries, key=lambda e: e["offset"]):
            if entry["offset"] < got or entry["offset"] + entry["nbytes"] > total:
                raise ValueError(f"snapshot source {address} sent overlapping or out-of-range tensors")
            _recv_exactly(sock, entry["offset"] - got, address)  # the alignment padding
            target = tensors[entry["name"]] = land(entry)
            if entry["nbytes"]:
                _recv_into(sock, memoryview(target.reshape(-1).view(torch.uint8).numpy()), address, cancelled)  # type: ignore[arg-type]
            got = entry["offset"] + entry["nbytes"]
        _recv_exactly(sock, total - got, address)
    return tensors


def register_socket(sock: socket.socket, sockets: list[socket.socket] | None, cancelled: threading.Event | None,
                    address: str) -> None:
    """Hand a new connection to a canceller (``sockets``), then give up if it already cancelled.

    A canceller sets ``cancelled`` first and then shuts down every socket in ``sockets``; appending
    first and checking second means one of the two always sees the other, so a connection that opened
    while the cancel ran is never left to block on a silent source until the read timeout."""
    if sockets is not None:
        sockets.append(sock)
    if cancelled is not None and cancelled.is_set():
        raise ConnectionError(f"snapshot source {address}: download abandoned (a newer catch-up started)")


def _recv_into(sock: socket.socket, view: memoryview, address: str, cancelled: threading.Event | None) -> None:
    done = 0
    while done < len(view):
        if cancelled is not None and cancelled.is_set():
            raise ConnectionError(f"snapshot source {address}: download abandoned (a newer catch-up started)")
        n = sock.recv_into(view[done:done + PIECE_BYTES], min(PIECE_BYTES, len(view) - done), socket.MSG_WAITALL)
        if not n:
            raise ConnectionError(f"snapshot source {address} closed the stream mid-transfer")
        done += n


def _recv_exactly(sock: socket.socket, n: int, peer: str) -> bytes:
    data = bytearray(n)
    if n:
        _recv_into(sock, memoryview(data), peer, None)
    return bytes(data)
