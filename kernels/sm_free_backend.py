"""The SM-free all-to-all as a ``torch.distributed`` backend: torchrec's sharded modules use it by being given its
process group, unchanged.

``register()`` adds the backend ``freescale_sm_free``; ``dist.new_group(backend="freescale_sm_free")`` makes a
``SmFreeProcessGroup``: a Python ``ProcessGroup`` whose ``alltoall_base`` (what ``dist.all_to_all_single``
calls: torchrec's input dist, output dist and their backward) moves the bytes itself, and which hands every
other collective to a group built from the same store (gloo on CPU, NCCL on CUDA).  The transport is chosen by the group's device
(``new_group(device)``).  On CPU it is shared memory between the ranks of one host (``kernels/shm_channels.py``):
each rank writes its chunk for a peer straight into that peer's inbox, a memcpy, and the peer copies it out into
the output tensor.  On CUDA (**not yet run on a GPU**) it is CUDA IPC between the ranks of one node
(``kernels/cuda_ipc_channels.py``): the same pieces, copied by ``cudaMemcpyAsync`` on a side stream (copy engines,
not SMs) straight into the peer's GPU landing buffer, with the headers in host shared memory.

What overlaps what: ``all_to_all_single(..., async_op=True)`` queues the transfer and returns at once; one
progress thread per group moves the queued transfers' bytes, piece by piece (at most ``chunk_bytes`` each), the
most urgent transfer first (``priority``: lower first, then the order issued), so a later urgent exchange
overtakes a long one at the next piece instead of waiting behind it; its copies release the GIL.  Pieces
carry their transfer's number and place, so every rank may order its sends by its own queue: numbering follows
the order the collectives were issued, the same on every rank, as c10d requires.  A transfer completes on a
rank when its pieces to every peer are written and every peer's pieces for it have arrived; its ``Work``
then completes (``wait``, ``get_future``).  No transfer waits for a barrier: the rings' counters are the only
synchronization.

On CUDA (not yet run on a GPU) the caller's stream and the side stream meet only through the host: at issue an
event is recorded on the caller's current stream, and the transfer's bytes start moving (its own chunk, its pieces
out and in) once the progress thread sees that event passed, so its inputs are written and its output is free; no
stream ever waits on another (a side-stream wait for the caller's stream would hold every later piece of every
transfer behind the caller's compute).  Every copy of the transport runs on its side stream (the passes run inside
it), and a transfer completes when an event recorded there after its last copy has passed: ``wait`` returns with
the output written, for any stream.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from freescale.kernels.cuda_ipc_channels import CudaChannels, Mark
from freescale.kernels.shm_channels import Inboxes

BACKEND = "freescale_sm_free"
RING_BYTES = 8 << 20
"""Each ring's size (one per ordered pair of ranks: the group holds world^2 of them), at most; less for large
groups (``_ring_bytes``)."""
CHUNK_BYTES = 1 << 20
CUDA_RING_BYTES = 32 << 20
"""On CUDA, each sender's ring in a rank's GPU landing buffer (world of them per rank)."""
CUDA_CHUNK_BYTES = 4 << 20
"""On CUDA, the largest piece: some 10-20 us of a copy engine's time against some tens of microseconds of Python to
issue, publish and take it (estimates, not measured yet: the GPU check's GB/s will say); a more urgent transfer
waits behind at most one per peer."""
_YIELDS = 200
"""Passes with nothing moved that only yield the core before the progress thread sleeps between passes (a sleep
costs 60-100 us of latency on Linux; a yield on an idle core costs nothing)."""
_LIVENESS_S = 0.5
"""A waiter looks this often whether a peer's process has ended (then its transfer cannot end)."""
_priority = threading.local()


@contextlib.contextmanager
def priority(level: int) -> Iterator[None]:
    """The all-to-alls issued on this thread inside are moved at ``level`` (lower first; default 0)."""
    previous = getattr(_priority, "level", 0)
    _priority.level = level
    try:
        yield
    finally:
        _priority.level = previous


class _Work(dist.Work):
    """One transfer's handle: done when this rank's share of the exchange is."""

    def __init__(self, group: SmFreeProcessGroup, output: torch.Tensor, timeout: timedelta, what: str) -> None:
        super().__init__()
        self._group = group
        self._event, self._output = threading.Event(), output
        self._error: Exception | None = None
        self._future: Future[list[torch.Tensor]] = Future()
        self._timeout, self._what = timeout, what

    def finish(self, error: Exception | None = None) -> None:
        self._error = error
        self._event.set()
        if error is None:
            self._future.set_result([self._output])
        else:
            self._future.set_exception(error)  # type: ignore[arg-type]  # (torch's stub types it as the result)

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Until done: making the group's passes itself while the progress thread is not (``step``)."""
        limit = (timeout if timeout and timeout.total_seconds() > 0 else self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        checked = time.monotonic()
        while not self._event.is_set():
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"SM-free all-to-all: {self._what} timed out after {limit:g} s (a peer stuck)")
            if now - checked > _LIVENESS_S:
                checked = now
                gone = self._group.peers_gone()
                if gone:  # as gloo's closed connection would say it: the peer's failure, in one line
                    raise RuntimeError(f"SM-free all-to-all: {self._what}: rank(s) {gone} of the group are gone "
                                       "(their process ended)")
            if self._group._stepping.acquire(blocking=False):
                try:
                    moved = self._group.step()
                finally:
                    self._group._stepping.release()
                if not moved and not self._event.is_set():
                    os.sched_yield()
            else:
                self._event.wait(0.0002)
        if self._error is not None:
            raise RuntimeError(f"SM-free all-to-all: {self._what} failed: {self._error}") from self._error
        return True

    def get_future(self) -> Future[list[torch.Tensor]]:
        return self._future


@dataclass(order=True)
class _Transfer:
    priority: int
    sequence: int
    send: list[torch.Tensor] = field(compare=False)
    """Per peer: this rank's bytes for it (contiguous uint8 views)."""
    receive: list[torch.Tensor] = field(compare=False)
    """Per peer: where its bytes go in the output (uint8 views)."""
    work: _Work = field(compare=False)
    sent: list[int] = field(compare=False, default_factory=list)
    received: list[int] = field(compare=False, default_factory=list)
    unpack: tuple[torch.Tensor, torch.Tensor] | None = field(compare=False, default=None)
    """(The output, the contiguous copy the bytes land in) where the output is not contiguous."""
    ready: Mark | None = field(compare=False, default=None)
    """CUDA: the point on the caller's stream where it was issued (None on CPU)."""
    active: bool = field(compare=False, default=True)
    """Whether its bytes may move (CUDA: once ``ready`` has passed; on CPU from the start)."""
    fence: Mark | None = field(compare=False, default=None)
    """CUDA: recorded on the side stream behind its last copy (it has landed when passed)."""


class SmFreeProcessGroup(dist.ProcessGroup):
    """The backend's process group (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 device: torch.device | str = "cpu", channels: CudaChannels | None = None) -> None:
        """``device``: whose tensors the group moves, and so its transport; ``channels``: a CUDA transport built
        already instead of ``cuda_ipc_channels.connect`` (the CPU test runs the CUDA bookkeeping over CPU tensors)."""
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the Python constructor c10d documents)
        self.device = _device(device)
        self._inner: Any = _inner_group(store, rank, size, timeout, self.device)
        self._cuda = channels
        self._inboxes: Inboxes | CudaChannels
        if self._cuda is None and self.device.type == "cuda":
            from freescale.kernels.cuda_ipc_channels import connect

            self._cuda = connect(dist.PrefixStore("cuda_ipc", store), rank, size, self.device, CUDA_RING_BYTES,
                                 timeout=timeout)
        if self._cuda is not None:
            self._inboxes, self._chunk = self._cuda, CUDA_CHUNK_BYTES
        else:
            self._inboxes = Inboxes(dist.PrefixStore("shm", store), rank, size, _ring_bytes(size), timeout)
            self._chunk = CHUNK_BYTES
        self._timeout, self._sequence = timeout, 0
        self._queue: list[_Transfer] = []
        self._early: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        """Pieces of transfers this rank has not issued yet: sequence -> (peer, offset, bytes)."""
        self._lock = threading.Condition()
        self.completed: list[int] = []
        """The transfers' numbers in the order they completed on this rank (the last 1,000)."""
        self._peers = [(rank + k) % size for k in range(1, size)]
        self._stepping = threading.Lock()
        """Held by whoever makes a pass: the progress thread, or a waiter helping."""
        self._thread = threading.Thread(target=self._progress, name="freescale-sm-free", daemon=True)
        self._thread.start()

    def peers_gone(self) -> list[int]:
        """The group's ranks whose process has ended (``shm_channels.Inboxes.gone``)."""
        return self._inboxes.gone()

    def getBackendName(self) -> str:
        return BACKEND

    # ------------------------------------------------------------------ the all-to-all
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        if self._cuda is not None and (input.device != self.device or output.device != self.device):
            raise ValueError(f"SM-free all-to-all: this group moves {self.device} tensors, got {input.device} in "
                             f"and {output.device} out (make a group per device)")
        world, sequence = self.size(), self._sequence
        self._sequence += 1
        source = input.contiguous()
        target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        send = _pieces(source, input_split_sizes, world, "input")
        receive = _pieces(target, output_split_sizes, world, "output")
        ready = self._cuda.issued() if self._cuda is not None else None  # (behind ``contiguous``'s copy, if any)
        work = _Work(self, output, self._timeout, f"all-to-all #{sequence}")
        transfer = _Transfer(getattr(_priority, "level", 0), sequence, send, receive, work,
                             [0] * world, [0] * world, (output, target) if target is not output else None,
                             ready, ready is None)
        me = self.rank()
        if ready is None:  # (CUDA: when the caller's stream gets there, ``_activate``)
            receive[me].copy_(send[me])  # this rank's own chunk
            transfer.sent[me], transfer.received[me] = len(send[me]), len(receive[me])
        with self._lock:
            for peer, offset, piece in self._early.pop(sequence, []) if ready is None else []:
                receive[peer][offset:offset + len(piece)].copy_(piece)
                transfer.received[peer] += len(piece)
            self._queue.append(transfer)
            self._queue.sort()
            self._lock.notify()
        return work

    def _progress(self) -> None:
        """The progress thread: passes (``step``) while transfers are queued; between passes with nothing moved
        it yields its core, then sleeps briefly."""
        idle = 0
        while True:
            with self._lock:
                while not self._queue and (self._cuda is None or self._cuda.idle()):
                    self._lock.wait()
            if not self._stepping.acquire(blocking=False):  # a waiter is making the pass
                time.sleep(0.00005)
                continue
            try:
                moved = self.step()
            finally:
                self._stepping.release()
            idle = 0 if moved else idle + 1
            if idle > _YIELDS:  # a while with nothing arriving: sleep between looks
                time.sleep(0.00005)
            elif idle:  # a peer's piece is likely on its way: give the core away, look again at once
                os.sched_yield()

    def step(self) -> bool:
        """One pass (under ``_stepping``, by the progress thread or by a thread waiting for a transfer, which
        saves two thread hand-offs on a short exchange): send the queued transfers' next pieces (most urgent
        first), take in what arrived, complete what is done.  Whether anything moved.  On CUDA the pass runs on
        the transport's side stream: every copy it enqueues goes there."""
        if self._cuda is None:
            return self._pass()
        with self._cuda.on_stream():
            return self._pass()

    def _pass(self) -> bool:
        with self._lock:
            queue = list(self._queue)
        landed: set[int] = set()
        try:
            if self._cuda is not None:
                self._activate(queue)
            moved = self._send(queue, self._peers) | self._take(queue, self._peers)
            if self._cuda is not None:
                moved |= self._cuda.settle()
                landed = {t.sequence for t in queue if self._landed(t, self._cuda)}
        except Exception as exc:  # a damaged ring or a bug: every waiting transfer fails with it (a stop signal on
            # a waiting thread, Stopped or KeyboardInterrupt, goes up as it is: the process is ending)
            with self._lock:
                for transfer in self._queue:
                    transfer.work.finish(exc)
                self._queue.clear()
            return True
        with self._lock:
            for transfer in [t for t in self._queue if _done(t) and (self._cuda is None or t.sequence in landed)]:
                self._queue.remove(transfer)
                if transfer.unpack is not None:
                    transfer.unpack[0].copy_(transfer.unpack[1])
                self.completed = [*self.completed[-999:], transfer.sequence]
                transfer.work.finish()
        return moved

    def _activate(self, queue: list[_Transfer]) -> None:
        """CUDA: the transfers whose caller's stream has passed the point they were issued at may move: their own
        chunk and the pieces that came early are copied in (on the side stream: the pass's)."""
        me = self.rank()
        for transfer in queue:
            if transfer.active or transfer.ready is None or not transfer.ready.query():
                continue
            transfer.receive[me].copy_(transfer.send[me])
            transfer.sent[me], transfer.received[me] = len(transfer.send[me]), len(transfer.receive[me])
            with self._lock:
                early = self._early.pop(transfer.sequence, [])
                transfer.active = True
            for peer, offset, piece in early:
                transfer.receive[peer][offset:offset + len(piece)].copy_(piece)
                transfer.received[peer] += len(piece)

    @staticmethod
    def _landed(transfer: _Transfer, channels: CudaChannels) -> bool:
        """CUDA: every copy of a transfer whose pieces are all enqueued has run.  The first time it is all enqueued,
        the unpack into a non-contiguous output is enqueued too, then the fence behind it all."""
        if not (transfer.active and _done(transfer)):
            return False
        if transfer.fence is None:
            if transfer.unpack is not None:
                transfer.unpack[0].copy_(transfer.unpack[1])
                transfer.unpack = None
            transfer.fence = channels.fence()
        return transfer.fence.query()

    def _send(self, queue: list[_Transfer], peers: list[int]) -> bool:
        """To each peer, the next piece of the most urgent transfer with bytes left for it (lowest priority level,
        then the first issued): one piece per peer per pass, then the queue is looked at again, so a transfer
        issued later at a more urgent level goes ahead of the rest of a long one."""
        moved = False
        for peer in peers:
            transfer = next((t for t in queue if t.active and t.sent[peer] < len(t.send[peer])), None)
            if transfer is not None:
                at = transfer.sent[peer]
                n = self._inboxes.send(peer, transfer.sequence, at,
                                       transfer.send[peer][at:at + min(len(transfer.send[peer]) - at, self._chunk)])
                transfer.sent[peer] += n
                moved |= n > 0
        return moved

    def _take(self, queue: list[_Transfer], peers: list[int]) -> bool:
        moved = False
        by_sequence = {t.sequence: t for t in queue}
        for peer in peers:
            while (record := self._inboxes.peek(peer)) is not None:
                transfer = by_sequence.get(record.sequence)
                if transfer is not None and not transfer.active:
                    break  # (CUDA: its output may be in use on the caller's stream yet: the piece waits in the ring)
                if transfer is not None:
                    transfer.receive[peer][record.offset:record.offset + record.length].copy_(record.payload)
                    transfer.received[peer] += record.length
                else:
                    with self._lock:  # issued here later (or just now: checked under the lock)
                        issued = next((t for t in self._queue if t.sequence == record.sequence), None)
                        if issued is None or not issued.active:  # (CUDA: ``_activate`` takes them)
                            self._early.setdefault(record.sequence, []).append(
                                (peer, record.offset, record.payload.clone()))
                            issued = None
                    if issued is not None:
                        issued.receive[peer][record.offset:record.offset + record.length].copy_(record.payload)
                        issued.received[peer] += record.length
                self._inboxes.release(peer)
                moved = True
        return moved


_DELEGATED = {name: name for name in (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "alltoall", "broadcast", "barrier", "monitored_barrier", "gather", "scatter", "reduce", "send", "recv",
    "recv_anysource")} | {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base"}
"""Every other collective c10d may call on the group (its name there: the inner group's), through the group's own
inner group (``_inner_group``; ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` reach a group as
``*_single``)."""


def _delegate(name: str, inner: str) -> Any:
    def call(self: SmFreeProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, inner)(*args, **kwargs)
    call.__name__ = name
    return call


for _name, _inner in _DELEGATED.items():
    setattr(SmFreeProcessGroup, _name, _delegate(_name, _inner))


def _ring_bytes(world: int) -> int:
    """8 MiB rings up to 5 ranks; above that, 256 MiB of rings in all for the host (at least 1 MiB each)."""
    return max(1 << 20, min(RING_BYTES, (256 << 20) // (world * world)))


def _done(transfer: _Transfer) -> bool:
    return (all(s == len(p) for s, p in zip(transfer.sent, transfer.send))
            and all(r == len(p) for r, p in zip(transfer.received, transfer.receive)))


def _pieces(tensor: torch.Tensor, splits: list[int], world: int, what: str) -> list[torch.Tensor]:
    """``tensor``'s bytes cut by ``splits`` (rows of dim 0; none: equal parts), one uint8 view per rank."""
    rows = tensor.size(0) if tensor.dim() else 1
    if not splits:
        if rows % world:
            raise ValueError(f"SM-free all-to-all: {what} of {rows} rows does not split evenly over {world} ranks")
        splits = [rows // world] * world
    if len(splits) != world or sum(splits) != rows:
        raise ValueError(f"SM-free all-to-all: {what} splits {list(splits)} do not cut {rows} rows into {world} parts")
    flat = tensor.view(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    row_bytes = len(flat) // rows if rows else 0
    pieces, at = [], 0
    for n in splits:
        pieces.append(flat[at:at + n * row_bytes])
        at += n * row_bytes
    return pieces


def _inner_group(store: dist.Store, rank: int, size: int, timeout: timedelta, device: torch.device) -> Any:
    """The group every collective but the all-to-all goes to: gloo on CPU; on CUDA NCCL (gloo lacks CUDA
    reduce-scatter and all-gather, which torchrec's row-wise and data-parallel tables call), whose communicator is
    made at its first collective (not yet run on a GPU)."""
    if device.type != "cuda":
        return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)


def _device(device: torch.device | str) -> torch.device:
    """``device`` with its index (a bare ``cuda``: the current device's)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"SM-free all-to-all: no transport for {device} tensors (cpu: shared memory, cuda: CUDA IPC)")
    return device


@dataclass(frozen=True)
class Options:
    """``dist.new_group(backend="freescale_sm_free", pg_options=Options(device))``: the device whose tensors the
    group moves (its transport: ``cpu`` shared memory, ``cuda`` CUDA IPC); without options: ``cpu``."""

    device: torch.device


def _create(options: Any, pg_options: Any) -> SmFreeProcessGroup:
    """c10d's extended creator call: ``options`` has the store, rank, size and timeout; ``pg_options`` is what
    ``dist.new_group`` was given as ``pg_options``."""
    device = pg_options.device if isinstance(pg_options, Options) else torch.device("cpu")
    return SmFreeProcessGroup(options.store, options.group_rank, options.group_size, options.timeout, device)


def new_group(device: torch.device | str = "cpu") -> SmFreeProcessGroup:
    """Collective over the default group: a ``SmFreeProcessGroup`` of all its ranks, moving ``device`` tensors (on
    CUDA each rank passes its own device; the ranks must share one node: CUDA IPC)."""
    register()
    group = dist.new_group(backend=BACKEND, pg_options=Options(_device(device)))
    assert isinstance(group, SmFreeProcessGroup)
    return group


def register() -> None:
    """Make ``dist.new_group(backend="freescale_sm_free")`` build a ``SmFreeProcessGroup`` (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
