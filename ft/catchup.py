"""Non-blocking catch-up: a recovering replica copies a peer's state while everyone keeps training.

A restarted replica group finds the quorum ahead of its own step.  Instead of
making the healthy groups stop and send it a checkpoint (torchft's healing
blocks the source until the transfer ends):

1. **Stage (source, at a step boundary)**: every up-to-date participant that
   the lighthouse's commit answer tells that a group waits to join (``"stage"``),
   that sees a recovering one in its quorum with nothing usable staged, or whose
   snapshot server has a fetcher waiting for a newer step than it holds, stages
   its state (parameters, optimizer state, anything the caller includes) right
   after the step commits.  Tensors in host memory are served **live**, from the
   tensors themselves (no copy): the transfer overlaps the source's next forward
   and backward, which only read them, and the fence before its next update
   (``wait_staged``) waits for the transfer to end, then withdraws the snapshot.
   Tensors elsewhere (a GPU's) are copied into a reused host buffer on a
   staging thread, also overlapping the forward and backward, fenced the same
   way.  ``SnapshotServer`` hands the staged state to whoever asks.
2. **Join with weight 0 (recovering)**: from its first quorum on, the
   recovering replica takes part in every FTAR with zero gradients and weight
   0, so the others' averages are unchanged, and records each committed
   step's averaged gradients.
3. **Fetch, load, replay** (``freescale.ft.snapshot_fetch``): on a side thread, from its first quorum on, it downloads the
   snapshot (step ``k``, the step before that quorum's) from a source, trying the next source
   if one dies mid-transfer, straight into its own tensors where they fit; then loads the rest
   and re-applies the recorded averaged gradients of steps ``k+1 ..`` with the same optimizer.
   Optimizer steps are deterministic, so its state is then bit-identical to the others', and it
   contributes from the next step on.

Wire format: ``GET /v1/snapshot?min_step=k`` answers, once a snapshot of step >= ``k`` is staged,
a JSON header ``{step, payload_bytes, tensors: [{name, dtype, shape, offset, nbytes}], stream,
ticket}`` (with ``&only=shards``: the sharded tensors' shards alone, laid end to end: what a rank serving a
lost rank's position takes from that position's peer); the fetcher connects to ``stream``, sends the one-time ``ticket`` and reads the raw bytes
(``freescale.ft.snapshot_stream``: why not in the HTTP response).  Nothing is unpickled.  A shared
token, when set, is required as ``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from aiohttp import web

from freescale.ft.serving import LoopThread, token_ok
from freescale.ft.snapshot_state import is_shard
from freescale.ft.snapshot_stream import ALIGN, DTYPES, Payload, PayloadStreamer, sub_payload

log = logging.getLogger("freescale.ft.catchup")


LIVE_FENCE_WAIT_S = 1.0
"""How long a source's fence waits for a transfer of its live state to end.  The transfer had the
source's whole forward, backward and exchange to run; one that outlasts them by more than this (a
stalled fetcher, a state too large for the step) is cut, and that source copies from then on."""


@dataclass(eq=False)
class _Staged:
    step: int
    entries: list[dict[str, Any]]
    """The header's tensor entries (name, dtype, shape, offset, nbytes)."""
    payload: Payload
    buffer: torch.Tensor | None
    """The staging buffer the copied tensors are in (host memory, pinned when on a GPU), if any."""
    live: bool
    """Some segments are the source's own tensors: withdrawn at the fence, before they change."""
    users: int = 0
    """Tickets handed out for it and not yet streamed, released or cut."""


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """The header's entries (name, dtype, shape, offset, nbytes) and the payload's size."""
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, t in tensors.items():
        if str(t.dtype) not in DTYPES:
            raise ValueError(f"snapshot: tensor '{name}' has unsupported dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset,
                        "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def copy_into(buffer: torch.Tensor, copies: list[tuple[torch.Tensor, int]]) -> None:
    """Each tensor's bytes to its offset in ``buffer`` (blocking; GPU tensors through the current stream)."""
    for t, at in copies:
        nbytes = t.numel() * t.element_size()
        buffer[at:at + nbytes].view(t.dtype).copy_(t.detach().reshape(-1))


ASSUMED_RATE_BPS = 1e9
"""A source's guess at its transfer rate before it has measured one (loopback measured 1.1-2.4 GB/s here)."""

def expected_live_cut(payload_bytes: int, rate_bps: float, window_s: float | None, fence_wait_s: float) -> bool:
    """Would a live transfer of ``payload_bytes`` at ``rate_bps`` be cut: not end within ``window_s`` (about a
    step: the time until the fence; None, no estimate: no) plus the fence's ``fence_wait_s``?  Then the source
    copies up front instead.  Short of that it serves live: the fence may wait up to ``fence_wait_s`` for the
    transfer, but a copy would stall that fence too (the copy must end before the update) and make the
    fetcher wait for the copy and then the transfer; a cut costs the whole wait, the retry and the copy after
    it (``bench_live_choice.py``)."""
    return window_s is not None and payload_bytes / rate_bps > window_s + fence_wait_s


LIVE_MIN_BYTES = 1 << 20
"""Host tensors of at least 1 MiB are served live; smaller ones (step counters, biases, ``meta.json``)
are copied with the padding around them into runs of the staging buffer, so a payload has few
segments and its stream few ``sendall`` calls (each takes the GIL back)."""


class PayloadPlan(NamedTuple):
    """How a snapshot's payload is made (``plan_payload``)."""

    live: list[tuple[int, torch.Tensor]]
    """(payload offset, the tensor's own bytes): served from where they are."""
    runs: list[tuple[int, int, int]]
    """(payload offset, length, buffer offset): the stretches between live tensors, from the buffer."""
    copies: list[tuple[torch.Tensor, int]]
    """(tensor, buffer offset): what the staging thread copies into the buffer."""
    buffer_bytes: int


def plan_payload(entries: list[dict[str, Any]], tensors: list[torch.Tensor], live: bool, total: int) -> PayloadPlan:
    """Which tensors go out live and how the rest is laid out in the staging buffer.  Live only when
    ``live`` and every tensor is in host memory (a state on a GPU is copied whole: its copy would be
    fenced anyway) and then only contiguous ones of ``LIVE_MIN_BYTES`` or more."""
    on_host = live and all(t.device.type == "cpu" for t in tensors)
    plan = PayloadPlan([], [], [], 0)
    cursor = size = 0  # payload bytes covered so far; buffer bytes used so far
    run_start = 0
    for entry, t in sorted(zip(entries, tensors), key=lambda pair: pair[0]["offset"]):
        if on_host and entry["nbytes"] >= LIVE_MIN_BYTES and t.is_contiguous() and t.layout == torch.strided:
            if entry["offset"] > cursor:  # the run before it: smaller tensors and padding
                plan.runs.append((cursor, entry["offset"] - cursor, run_start))
                size = run_start + entry["offset"] - cursor
            plan.live.append((entry["offset"], t.detach().reshape(-1).view(torch.uint8)))
            cursor = entry["offset"] + entry["nbytes"]
            run_start = -(-size // ALIGN) * ALIGN + cursor % ALIGN  # the buffer keeps the payload's alignment
        elif entry["nbytes"]:
            plan.copies.append((t, run_start + entry["offset"] - cursor))
    if total > cursor:
        plan.runs.append((cursor, total - cursor, run_start))
        size = run_start + total - cursor
    return plan._replace(buffer_bytes=size)


class SnapshotServer:
    """Serves the latest staged snapshot over HTTP from a daemon thread (aiohttp).

    ``live``: serve tensors in host memory from where they are (no copy; the fence waits for the
    transfer).  False copies every tensor, as a GPU's are always copied."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "", advertise: str = "",
                 live: bool = True, fence_wait_s: float = LIVE_FENCE_WAIT_S) -> None:
        self.host, self.port, self.token = host, port, token
        self.advertise = advertise or host
        """The name peers reach it by (``host`` may be every interface: ``freescale.ft.serving.advertised_host``)."""
        self.live, self.fence_wait_s = live, fence_wait_s
        self.address = ""
        self._staged: _Staged | None = None
        self._lock = threading.Condition()
        self._background = LoopThread("freescale-snapshot")
        self._streamer: PayloadStreamer | None = None
        self.can_serve = True
        """False while this replica is catching up itself: fetchers are told at once to try
        another source instead of waiting for a snapshot that will not come."""
        self.on_stream: Callable[[int], None] | None = None
        """Fault injection (tests): called with the snapshot's step as its bytes start to go out."""
        self.wanted_step: int | None = None
        """Smallest step a waiting fetcher asked for and that is not staged yet: the trainer
        stages at its next committed step >= this (on-demand staging)."""
        self.choice: dict[str, Any] = {}
        """How the last staging chose between serving live and copying (``expected_live_cut``): ``live`` is
        whether anything went out live (False for a state on a GPU, or one of tensors under 1 MiB only)."""
        self.cut_transfers = 0
        """Transfers of live state cut at the fence (each turned this server to copying)."""
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freescale-stage")
        self._copying: Future[float] | None = None
        self._copying_step = -1
        self._buffers: list[torch.Tensor] = []
        """Staging buffers kept for reuse: the one staged now and a spare (one still being sent is
        dropped from here and freed when its send ends)."""
        self._streams: dict[int, int] = {}
        """Transfers in flight per buffer (its data pointer): a buffer being streamed is not reused."""

    def stage(self, step: int, tensors: dict[str, torch.Tensor], window_s: float | None = None) -> float:
        """Stage the state of committed ``step`` for serving; returns the seconds this (the training)
        thread spent.  Live tensors are served at once; the others are copied on the staging thread.
        Either way the caller's next forward and backward, which only read the state, overlap it: the
        caller calls ``wait_staged`` before it next changes a tensor of ``tensors`` (its next update, a
        load).  ``window_s``: about how long until that fence (the caller's step time); a transfer that
        would be cut there is copied up front instead (``expected_live_cut``)."""
        start = time.perf_counter()
        self.wait_staged()
        if self._streamer is not None:
            self._streamer.sweep()  # buffers of tickets nobody used become reusable
        entries, total = layout(tensors)
        sources = list(tensors.values())
        live, figures = self._wants_live(total, window_s)
        plan = plan_payload(entries, sources, live, total)
        self.choice = {"live": bool(plan.live), **figures}  # (a state on a GPU is copied whatever the choice)
        on_gpu = any(t.is_cuda for t in sources)
        buffer = self._buffer_for(plan.buffer_bytes, pinned=on_gpu) if plan.buffer_bytes else None
        segments = plan.live + [(offset, buffer[at:at + length]) for offset, length, at in plan.runs if buffer is not None]
        staged = _Staged(step, entries, Payload(sorted(segments, key=lambda s: s[0]), total), buffer, bool(plan.live))
        if not plan.copies:
            with self._lock:
                self._staged = staged
            return time.perf_counter() - start
        after = torch.cuda.Event() if on_gpu else None
        if after is not None:
            after.record()  # the committed update, queued on the training thread's stream

        assert buffer is not None  # copies are in runs

        def copy() -> float:
            began = time.perf_counter()
            if after is None:
                copy_into(buffer, plan.copies)
            else:
                stream = torch.cuda.Stream(device=next(t.device for t in sources if t.is_cuda))
                with torch.cuda.stream(stream):
                    stream.wait_event(after)
                    copy_into(buffer, plan.copies)
                stream.synchronize()
            with self._lock:
                self._staged = staged
            return time.perf_counter() - began

        self._copying, self._copying_step = self._stager.submit(copy), step
        return time.perf_counter() - start

    def _wants_live(self, payload_bytes: int, window_s: float | None) -> tuple[bool, dict[str, Any]]:
        """Serve this staging live (``expected_live_cut``, at this source's measured rate)?  With the figures
        the choice rests on (the caller logs them)."""
        measured = self._streamer.rate_bps if self._streamer is not None else None
        rate = measured or ASSUMED_RATE_BPS
        live = self.live and not expected_live_cut(payload_bytes, rate, window_s, self.fence_wait_s)
        return live, {"expected_transfer_s": round(payload_bytes / rate, 4), "rate_measured": measured is not None,
                      "window_s": None if window_s is None else round(window_s, 4)}

    def wait_staged(self) -> float:
        """The fence before the state changes: the staging copy started by ``stage`` is done, and no
        transfer reads live tensors any more.  A live snapshot is withdrawn (a later fetcher gets a
        later step's); the tickets handed out for it get ``fence_wait_s`` to connect and finish (a
        fetcher connects within moments of its header, however short the step).  Then a ticket still
        unused is revoked (its fetcher asks again), and a transfer still running is cut: this source
        copies from then on.  Returns the seconds it took (0.0 when nothing was in flight)."""
        copying, self._copying = self._copying, None
        copy_s = copying.result() if copying is not None else 0.0
        with self._lock:
            staged = self._staged
            if staged is None or not staged.live:
                return copy_s
            self._staged = None  # no new fetcher gets it
            if staged.users == 0:
                return copy_s
            start = time.perf_counter()
            self._lock.wait_for(lambda: staged.users == 0, timeout=self.fence_wait_s)
        assert self._streamer is not None
        self._streamer.revoke(staged.payload)
        if self._streamer.cut(staged.payload):
            self.live = False  # its transfers outlast a step: copy from now on, never wait on the network
            self.cut_transfers += 1
            log.warning("snapshot: a transfer of step %d outlasted the step by %.1f s: cut; this source copies "
                        "its state from now on", staged.step, self.fence_wait_s)
        with self._lock:  # a sender shut down mid-sendall returns at once
            if not self._lock.wait_for(lambda: staged.users == 0, timeout=10.0):
                raise RuntimeError("snapshot: a cut transfer of live state did not stop within 10 s: its bytes "
                                   "could still be read while they change")
        return copy_s + time.perf_counter() - start

    def _buffer_for(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A staging buffer of ``nbytes``: a view of a kept one that is large enough, not staged now and
        not being sent (so a recovery's staging rarely pays for fresh pages), else a new one."""
        with self._lock:
            staged = self._staged.buffer if self._staged is not None else None
            ptr = staged.data_ptr() if staged is not None else None
            for buffer in self._buffers:
                if (buffer.numel() >= nbytes and buffer.data_ptr() != ptr and buffer.is_pinned() == pinned
                        and not self._streams.get(buffer.data_ptr())):
                    return buffer[:nbytes]
            buffer = torch.empty(nbytes + nbytes // 16, dtype=torch.uint8, pin_memory=pinned)  # room to grow
            served = [b for b in self._buffers if b.data_ptr() == ptr]
            self._buffers = [*served[-1:], buffer]
            return buffer[:nbytes]

    def wants(self, step: int) -> bool:
        """Should the state of committed ``step`` be staged for a waiting fetcher?"""
        with self._lock:
            return self.wanted_step is not None and step >= self.wanted_step and (
                self._staged is None or self._staged.step < self.wanted_step)

    @property
    def staged_step(self) -> int | None:
        with self._lock:
            return self._staged.step if self._staged else None

    @property
    def staging_step(self) -> int | None:
        """The step staged, or being copied to be (``staged_step`` shows a copied snapshot once its copy is done)."""
        copying = self._copying
        if copying is not None and not copying.done():
            return self._copying_step
        return self.staged_step

    def start(self) -> str:
        """Serve from a daemon thread; returns ``host:port``."""
        runner: dict[str, web.AppRunner] = {}

        async def start() -> str:
            app = web.Application(client_max_size=4096)
            app.router.add_get("/v1/snapshot", self._serve)
            runner["app"] = web.AppRunner(app, access_log=None)
            await runner["app"].setup()
            await web.TCPSite(runner["app"], self.host, self.port).start()
            return f"{self.advertise}:{runner['app'].addresses[0][1]}"

        async def cleanup() -> None:
            await runner["app"].cleanup()

        self.address = str(self._background.run(start, cleanup))
        self._streamer = PayloadStreamer(self.host, self.advertise)
        self._streamer.on_stream = self._on_stream
        return self.address

    def stop(self) -> None:
        self._background.stop()
        if self._streamer is not None:
            self._streamer.close()

    @property
    def bytes_served(self) -> int:
        return self._streamer.bytes_served if self._streamer is not None else 0

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        if not token_ok(request, self.token):
            return web.json_response({"error": "missing or wrong token"}, status=401)
        try:
            min_step = int(request.query.get("min_step", "0"))
            wait_s = min(float(request.query.get("wait_s", "30")), 120.0)
        except ValueError:
            return web.json_response({"error": "min_step and wait_s must be numbers"}, status=400)
        copied = request.query.get("copied") == "1"
        only = request.query.get("only", "")
        if only not in ("", "shards"):
            return web.json_response({"error": f"only: 'shards' or nothing, got {only!r}"}, status=400)
        if copied:
            self.live = False  # the training thread's next stage copies (a plain flag: read there)
        deadline = time.monotonic() + wait_s
        if not self.can_serve:
            return web.json_response({"error": "this replica is catching up itself"}, status=503)
        while True:
            with self._lock:
                staged = self._staged
                if staged is not None and staged.step >= min_step and not (copied and staged.live):
                    if self.wanted_step is not None and self.wanted_step <= staged.step:
                        self.wanted_step = None
                    entries, payload = sub_payload(staged.payload, [e for e in staged.entries if is_shard(e["name"])]) \
                        if only else (staged.entries, staged.payload)
                    ticket = self._hand_out(staged, payload)
                    break
                wanted = max(min_step, staged.step + 1) if copied and staged is not None and staged.live else min_step
                self.wanted_step = wanted if self.wanted_step is None else min(self.wanted_step, wanted)
            if time.monotonic() >= deadline:
                return web.json_response({"error": f"no snapshot at step >= {min_step} yet"}, status=503)
            await asyncio.sleep(0.005)
        assert self._streamer is not None
        return web.json_response({"step": staged.step, "payload_bytes": payload.total, "tensors": entries,
                                  "stream": self._streamer.address, "ticket": ticket})

    def _on_stream(self, step: int) -> None:
        if self.on_stream is not None:
            self.on_stream(step)

    def _hand_out(self, staged: _Staged, payload: Payload) -> str:
        """A ticket for ``payload``, all or part of ``staged``'s (the caller holds the lock: the fence sees it, or it
        sees no snapshot)."""
        assert self._streamer is not None
        staged.users += 1
        ptr = staged.buffer.data_ptr() if staged.buffer is not None else None
        if ptr is not None:
            self._streams[ptr] = self._streams.get(ptr, 0) + 1  # not reused while streamed
        return self._streamer.offer(payload, staged.step, lambda: self._stream_done(staged, ptr))

    def _stream_done(self, staged: _Staged, ptr: int | None) -> None:
        with self._lock:
            staged.users -= 1
            if ptr is not None:
                self._streams[ptr] -= 1
                if not self._streams[ptr]:
                    del self._streams[ptr]
            self._lock.notify_all()
