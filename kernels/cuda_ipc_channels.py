"""CUDA IPC channels between the ranks of one node: the CUDA transport of the SM-free all-to-all backend.

**Not yet run on a GPU** (written for one; ``benchmarks/gpu_sm_free_backend.py`` is its first check).  The pure
parts, the header protocol and the handle encoding, are tested on CPU (``tests/test_cuda_ipc_channels.py``).

The same role as ``shm_channels.Inboxes`` (``send`` / ``peek`` / ``release`` / ``gone``), with the bytes in GPU
memory and only the headers in host memory:

- each rank (the *owner*) allocates one landing buffer on its GPU, ``world x ring_bytes``: one ring per sender.  Its
  CUDA IPC handle (the fields of ``UntypedStorage._share_cuda_``, one share per peer since each counts one user
  in torch's shared reference counter, encoded as JSON with the bytes in hex: no pickle) goes through the
  group's store, and every peer opens it (``UntypedStorage._new_shared_cuda``), so a
  sender holds a tensor over its ring in every peer's buffer.  Within one GPU across processes this is allowed
  too: two ranks on one device is what the GPU check runs;
- each owner also has a host control file (``shm_channels.map_group_files``: ``/dev/shm``, mapped by every rank,
  unlinked once mapped): per sender a ring of ``slots`` fixed headers (sequence, offset, position in the GPU ring,
  length) and three counters, each on its own cache line: ``published`` (written by the sender), ``taken`` and
  ``freed`` (written by the owner).  All counters count from the start, so ``published - taken`` headers and
  ``tail - freed`` ring bytes are in use, and each counter has one writer (x86-64's store order, as in
  ``shm_channels``).

A piece: the sender enqueues a device-to-device ``copy_`` straight into the owner's ring on its side stream (a
``cudaMemcpyAsync``: a copy engine's work, not the SMs', so it overlaps the compute kernels on the caller's
stream) and records an event behind it; ``settle`` publishes the header once the host sees that event complete.
So the owner never reads bytes still in flight, with no interprocess event: the host-observed completion is the
synchronization (an IPC event per piece would let the owner's stream wait without the host, but each must be
opened in the peer, ``cudaIpcOpenEventHandle``, per piece; the backend's progress is host-driven anyway, and
polling ``query`` keeps several pieces in flight per peer where ``synchronize`` would serialize them).  The owner's
``peek`` gives a view into its ring; the backend copies it out on the same side stream (it makes its passes inside
``stream``), and ``release`` gives the header slot back at once and the ring bytes once the event behind that copy
completes (``settle`` again).  A piece never wraps: at the ring's end it is cut, the next starts at 0.

Whether the driver runs a same-device ``cudaMemcpyAsync`` (two ranks on one GPU) on a copy engine or as a copy
kernel is not ours to choose: the GPU check measures it (the victim's slowdown beside the exchange).  Across GPUs
of one node the peer's buffer is on the peer's device and torch's ``copy_`` takes the peer-to-peer path: not yet
run either.  torch's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) share memory
through file descriptors (pidfd_getfd), which needs ptrace rights between the ranks: not tried.
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist

from freescale.kernels.shm_channels import Record, ended, map_group_files, require_store_order

ALIGN = 256
"""Pieces start at multiples of this in a ring (a copy engine's aligned bursts)."""
SLOTS = 1024
"""Headers per sender in an owner's control file (32 bytes each)."""
_SLOT = 4  # int64s per header: sequence, offset, position, length
_LINE = 8  # int64s per 64-byte cache line
_PUBLISHED, _TAKEN, _FREED = 0, 1, 2
_COUNTERS = 3


class Mark(Protocol):
    """A point on a stream: ``query`` says whether the work before it has run (``torch.cuda.Event``)."""

    def query(self) -> bool: ...


class _Done:
    """A mark already passed: what a channel without a stream hands out (the CPU test of the protocol)."""

    def query(self) -> bool:
        return True


_DONE = _Done()


class IpcHandle(NamedTuple):
    """What ``UntypedStorage._share_cuda_`` gives and ``UntypedStorage._new_shared_cuda`` takes, field by field."""

    device: int
    handle: bytes
    """The CUDA IPC handle of the allocation that holds the storage."""
    size_bytes: int
    offset_bytes: int
    """Where the storage starts in that allocation."""
    ref_counter: bytes
    """The name of torch's shared counter of the storage's users in other processes."""
    ref_counter_offset: int
    event: bytes
    """An IPC event handle recorded when shared (the receiver's stream waits on it where ``event_sync_required``)."""
    event_sync_required: bool


def encode_handle(fields: tuple[Any, ...]) -> str:
    """``_share_cuda_``'s tuple as JSON text for the store (the bytes in hex; no pickle)."""
    h = IpcHandle(*fields)
    return json.dumps({"device": int(h.device), "handle": bytes(h.handle).hex(), "size_bytes": int(h.size_bytes),
                       "offset_bytes": int(h.offset_bytes), "ref_counter": bytes(h.ref_counter).hex(),
                       "ref_counter_offset": int(h.ref_counter_offset), "event": bytes(h.event).hex(),
                       "event_sync_required": bool(h.event_sync_required)})


def decode_handle(text: str) -> IpcHandle:
    """``encode_handle``'s text back to the fields, each of the type ``_new_shared_cuda`` checks."""
    d = json.loads(text)
    return IpcHandle(int(d["device"]), bytes.fromhex(d["handle"]), int(d["size_bytes"]), int(d["offset_bytes"]),
                     bytes.fromhex(d["ref_counter"]), int(d["ref_counter_offset"]), bytes.fromhex(d["event"]),
                     bool(d["event_sync_required"]))


def control_words(world: int, slots: int) -> int:
    """int64s in one owner's control file: per sender its counters' lines, then per sender its headers."""
    return world * (_COUNTERS * _LINE + slots * _SLOT)


class CudaChannels:
    """This rank's landing buffer and a view of every peer's (module docstring).  Built by ``connect`` (collective,
    CUDA); the constructor takes the shared pieces as they are, so the protocol runs on CPU tensors in a test
    (``stream`` None: copies on the current device, every mark already passed).  Not yet run on a GPU."""

    def __init__(self, rank: int, world: int, controls: list[np.ndarray], rings: list[torch.Tensor], ring_bytes: int,
                 slots: int, stream: torch.cuda.Stream | None, pids: list[int]) -> None:
        if ring_bytes % ALIGN or ring_bytes <= 0:
            raise ValueError(f"SM-free all-to-all: a CUDA ring of {ring_bytes} bytes is not a multiple of {ALIGN}")
        self.rank, self.world, self.ring_bytes, self.slots = rank, world, ring_bytes, slots
        self.stream = stream
        """The side stream every copy of the transport runs on (the backend's passes run inside it)."""
        self.pids = pids
        self._controls = controls
        heads = _COUNTERS * _LINE * world

        def headers(owner: int, src: int) -> np.ndarray:
            start = heads + src * slots * _SLOT
            return controls[owner][start:start + slots * _SLOT].reshape(slots, _SLOT)

        self._out_headers = [headers(dst, rank) for dst in range(world)]
        self._in_headers = [headers(rank, src) for src in range(world)]
        self._out_rings = [rings[dst][rank * ring_bytes:(rank + 1) * ring_bytes] for dst in range(world)]
        self._in_rings = [rings[rank][src * ring_bytes:(src + 1) * ring_bytes] for src in range(world)]
        # The sender's side, per peer: ring bytes handed out (tail), headers handed out and published.
        self._tail, self._reserved, self._published = [0] * world, [0] * world, [0] * world
        self._pending: list[deque[tuple[Mark, tuple[int, int, int, int]]]] = [deque() for _ in range(world)]
        """Per peer: pieces enqueued whose copy the host has not seen complete (mark, header)."""
        # The owner's side, per sender: headers taken, where the next piece must start.
        self._taken, self._expected = [0] * world, [0] * world
        self._releases: list[deque[tuple[Mark, int]]] = [deque() for _ in range(world)]
        """Per sender: pieces copied out whose copy the host has not seen complete (mark, ring bytes freed then)."""
        self._peeked: dict[int, Record] = {}

    # ------------------------------------------------------------------ counters of the ring src -> owner
    def _read(self, owner: int, src: int, which: int) -> int:
        return int(self._controls[owner][(_COUNTERS * src + which) * _LINE])

    def _write(self, owner: int, src: int, which: int, value: int) -> None:
        self._controls[owner][(_COUNTERS * src + which) * _LINE] = value

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Inside: the side stream is the current one (without a stream: nothing changes)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _mark(self) -> Mark:
        """A mark behind the work enqueued so far on the side stream."""
        if self.stream is None:
            return _DONE
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def gone(self) -> list[int]:
        """The ranks whose process has ended (``shm_channels.ended``)."""
        return ended(self.pids)

    # ------------------------------------------------------------------ the sender's side
    def send(self, dst: int, sequence: int, offset: int, payload: torch.Tensor) -> int:
        """Enqueue the copy of as much of ``payload`` (contiguous uint8, on this rank's device) as ``dst``'s ring has
        room for, into that ring; the bytes taken (0: no room, or no header slot, for now).  The header goes out
        when the copy has run (``settle``)."""
        if self._reserved[dst] - self._read(dst, self.rank, _TAKEN) >= self.slots:
            return 0
        tail = self._tail[dst]
        free = self.ring_bytes - (tail - self._read(dst, self.rank, _FREED))
        at = tail % self.ring_bytes
        n = min(len(payload), self.ring_bytes - at, free)
        if n <= 0:
            return 0
        with self.on_stream():
            self._out_rings[dst][at:at + n].copy_(payload[:n], non_blocking=True)
            mark = self._mark()
        self._pending[dst].append((mark, (sequence, offset, tail, n)))
        self._tail[dst] = tail + _padded(n)
        self._reserved[dst] += 1
        return n

    def settle(self) -> bool:
        """Publish the headers of the pieces whose copy has run, and give back the ring bytes of the pieces whose
        copy-out has run, each in order; whether anything was."""
        moved = False
        for dst, pending in enumerate(self._pending):
            while pending and pending[0][0].query():
                fields = pending.popleft()[1]
                published = self._published[dst]
                self._out_headers[dst][published % self.slots] = fields  # the header, then the counter
                self._published[dst] = published + 1
                self._write(dst, self.rank, _PUBLISHED, published + 1)
                moved = True
        for src, releases in enumerate(self._releases):
            while releases and releases[0][0].query():
                self._write(self.rank, src, _FREED, releases.popleft()[1])
                moved = True
        return moved

    def idle(self) -> bool:
        """Nothing waits for ``settle``: every header is published and every ring byte read given back."""
        return not any(self._pending) and not any(self._releases)

    def fence(self) -> Mark:
        """A mark behind every copy enqueued so far on the side stream (a transfer's: it has landed when passed)."""
        with self.on_stream():
            return self._mark()

    def issued(self) -> Mark:
        """A mark on the caller's current stream (of this channel's device): the point an all-to-all was issued."""
        if self.stream is None:
            return _DONE
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        return event

    # ------------------------------------------------------------------ the owner's side
    def peek(self, src: int) -> Record | None:
        """The next published piece from ``src``, or None; its payload is a view into this rank's ring, valid until
        the copy out of it, enqueued on ``stream`` before ``release(src)``, has run."""
        if src in self._peeked:
            return self._peeked[src]
        taken = self._taken[src]
        if self._read(self.rank, src, _PUBLISHED) == taken:
            return None
        sequence, offset, position, length = self._in_headers[src][taken % self.slots].tolist()
        at = position % self.ring_bytes
        if position != self._expected[src] or not 0 < length <= self.ring_bytes - at:
            raise RuntimeError(f"SM-free all-to-all: a damaged header from rank {src} ({length} bytes at "
                               f"{position}, expected at {self._expected[src]})")
        record = Record(sequence, offset, length, self._in_rings[src][at:at + length], _padded(length))
        self._peeked[src] = record
        return record

    def release(self, src: int) -> None:
        """The piece ``peek(src)`` gave is being copied out (enqueued on ``stream``): its header slot goes back now,
        its ring bytes once that copy has run (``settle``)."""
        record = self._peeked.pop(src)
        self._taken[src] += 1
        self._write(self.rank, src, _TAKEN, self._taken[src])
        self._expected[src] += record.size
        with self.on_stream():
            self._releases[src].append((self._mark(), self._expected[src]))


def connect(store: dist.Store, rank: int, world: int, device: torch.device, ring_bytes: int, slots: int = SLOTS,
            timeout: timedelta = timedelta(seconds=300)) -> CudaChannels:
    """Collective (every rank of the group, through ``store``, all on this host): allocate this rank's landing
    buffer on ``device``, share it, open every peer's, map the control files.  Not yet run on a GPU."""
    require_store_order()
    ring_bytes = _padded(ring_bytes)
    maps, pids = map_group_files(store, rank, world, control_words(world, slots) * 8, timeout)
    controls = [np.frombuffer(m, dtype=np.int64) for m in maps]
    own = torch.zeros(world * ring_bytes, dtype=torch.uint8, device=device)
    for peer in range(world):  # a share per peer: each share counts one user in torch's shared ref counter
        if peer != rank:
            store.set(f"ipc/{rank}/{peer}", encode_handle(own.untyped_storage()._share_cuda_()))
    store.wait([f"ipc/{r}/{rank}" for r in range(world) if r != rank], timeout)
    rings = [own if r == rank else _open(decode_handle(store.get(f"ipc/{r}/{rank}").decode()), world * ring_bytes, r)
             for r in range(world)]
    torch.cuda.synchronize(device)  # the zeros written, the peers' share-time events waited for
    return CudaChannels(rank, world, controls, rings, ring_bytes, slots, torch.cuda.Stream(device=device), pids)


def _open(handle: IpcHandle, nbytes: int, rank: int) -> torch.Tensor:
    """A peer's landing buffer, opened in this process (uint8 over the whole of it)."""
    storage = torch.UntypedStorage._new_shared_cuda(*handle)
    if storage.nbytes() < nbytes:
        raise RuntimeError(f"SM-free all-to-all: rank {rank}'s CUDA buffer is {storage.nbytes()} bytes, not {nbytes}")
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", handle.device)).set_(storage)


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
