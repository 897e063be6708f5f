"""The SM-free all-to-all as a ``torch.distributed`` backend: torchrec's sharded modules use it by being given its
process group, unchanged.

``register()`` adds the backend ``freescale_sm_free``; ``dist.new_group(backend="freescale_sm_free")`` makes a
``SmFreeProcessGroup``: a Python ``ProcessGroup`` whose ``alltoall_base`` (what ``dist.all_to_all_single``
calls: torchrec's input dist, output dist and their backward) moves the bytes itself, and which hands every
other collective to a gloo group built from the same store.  The transport on CPU is shared memory between
the ranks of one host (``kernels/shm_channels.py``): each rank writes its chunk for a peer straight into that
peer's inbox, a memcpy, and the peer copies it out into the output tensor.  (On CUDA the same role is the copy
engines' (``kernels/copy_engine.py``), not wired in here yet.)

What overlaps what: ``all_to_all_single(..., async_op=True)`` queues the transfer and returns at once; one
progress thread per group moves the queued transfers' bytes, piece by piece (at most ``chunk_bytes`` each), the
most urgent transfer first (``priority``: lower first, then the order issued), so a later urgent exchange
overtakes a long one at the next piece instead of waiting behind it; its copies release the GIL.  Pieces
carry their transfer's number and place, so every rank may order its sends by its own queue: numbering follows
the order the collectives were issued, the same on every rank, as c10d requires.  A transfer completes on a
rank when its pieces to every peer are written and every peer's pieces for it have arrived; its ``Work``
then completes (``wait``, ``get_future``).  No transfer waits for a barrier: the rings' counters are the only
synchronization.
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

from freescale.kernels.shm_channels import Inboxes

BACKEND = "freescale_sm_free"
RING_BYTES = 8 << 20
"""Each ring's size (one per ordered pair of ranks: the group holds world^2 of them), at most; less for large
groups (``_ring_bytes``)."""
CHUNK_BYTES = 1 << 20
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


class SmFreeProcessGroup(dist.ProcessGroup):
    """The backend's process group (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the Python constructor c10d documents)
        self._inner: Any = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        self._inboxes = Inboxes(dist.PrefixStore("shm", store), rank, size, _ring_bytes(size), timeout)
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
        world, sequence = self.size(), self._sequence
        self._sequence += 1
        source = input.contiguous()
        target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        send = _pieces(source, input_split_sizes, world, "input")
        receive = _pieces(target, output_split_sizes, world, "output")
        work = _Work(self, output, self._timeout, f"all-to-all #{sequence}")
        transfer = _Transfer(getattr(_priority, "level", 0), sequence, send, receive, work,
                             [0] * world, [0] * world, (output, target) if target is not output else None)
        me = self.rank()
        receive[me].copy_(send[me])  # this rank's own chunk
        transfer.sent[me], transfer.received[me] = len(send[me]), len(receive[me])
        with self._lock:
            for peer, offset, piece in self._early.pop(sequence, []):
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
                while not self._queue:
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
        first), take in what arrived, complete what is done.  Whether anything moved."""
        with self._lock:
            queue = list(self._queue)
        try:
            moved = self._send(queue, self._peers) | self._take(queue, self._peers)
        except Exception as exc:  # a damaged ring or a bug: every waiting transfer fails with it (a stop signal on
            # a waiting thread, Stopped or KeyboardInterrupt, goes up as it is: the process is ending)
            with self._lock:
                for transfer in self._queue:
                    transfer.work.finish(exc)
                self._queue.clear()
            return True
        with self._lock:
            for transfer in [t for t in self._queue if _done(t)]:
                self._queue.remove(transfer)
                if transfer.unpack is not None:
                    transfer.unpack[0].copy_(transfer.unpack[1])
                self.completed = [*self.completed[-999:], transfer.sequence]
                transfer.work.finish()
        return moved

    def _send(self, queue: list[_Transfer], peers: list[int]) -> bool:
        """To each peer, the next piece of the most urgent transfer with bytes left for it (lowest priority level,
        then the first issued): one piece per peer per pass, then the queue is looked at again, so a transfer
        issued later at a more urgent level goes ahead of the rest of a long one."""
        moved = False
        for peer in peers:
            transfer = next((t for t in queue if t.sent[peer] < len(t.send[peer])), None)
            if transfer is not None:
                at = transfer.sent[peer]
                n = self._inboxes.send(peer, transfer.sequence, at,
                                       transfer.send[peer][at:at + min(len(transfer.send[peer]) - at, CHUNK_BYTES)])
                transfer.sent[peer] += n
                moved |= n > 0
        return moved

    def _take(self, queue: list[_Transfer], peers: list[int]) -> bool:
        moved = False
        by_sequence = {t.sequence: t for t in queue}
        for peer in peers:
            while (record := self._inboxes.peek(peer)) is not None:
                transfer = by_sequence.get(record.sequence)
                if transfer is not None:
                    transfer.receive[peer][record.offset:record.offset + record.length].copy_(record.payload)
                    transfer.received[peer] += record.length
                else:
                    with self._lock:  # issued here later (or just now: checked under the lock)
                        issued = next((t for t in self._queue if t.sequence == record.sequence), None)
                        if issued is None:
                            self._early.setdefault(record.sequence, []).append(
                                (peer, record.offset, record.payload.clone()))
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
"""Every other collective c10d may call on the group (its name there: gloo's backend's), through the group's own
gloo process group (``all_gather_into_tensor`` and ``reduce_scatter_tensor`` reach a group as ``*_single``)."""


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


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> SmFreeProcessGroup:
    return SmFreeProcessGroup(store, rank, size, timeout)


def new_group() -> SmFreeProcessGroup:
    """Collective over the default group: a ``SmFreeProcessGroup`` of all its ranks."""
    register()
    group = dist.new_group(backend=BACKEND)
    assert isinstance(group, SmFreeProcessGroup)
    return group


def register() -> None:
    """Make ``dist.new_group(backend="freescale_sm_free")`` build a ``SmFreeProcessGroup`` (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
