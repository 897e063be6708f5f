"""Shared-memory channels between the ranks of one host: the CPU transport of the SM-free all-to-all backend.

Each rank owns an inbox, one file under ``/dev/shm`` (``_folder``) that every rank of the group maps: one ring per sender
(``ring_bytes`` each) and each ring's two counters.  A ring has one producer (its sender) and one consumer
(the inbox's owner): the sender appends records at ``tail``, the owner consumes them at ``head``; both count
every byte ever written or read, so ``tail - head`` is what waits and a counter is written by one side only.
A record is a 32-byte header (the transfer's sequence number, the byte offset of this piece within the
sender's chunk for the owner, its length, a marker) and the bytes, padded to 64; a record never wraps: where
the room left before the ring's end is too small, the sender writes a wrap marker and goes on at 0.  Pieces
carry their place, so a sender may interleave transfers (a later, more urgent one first) and the owner
still puts every byte where it belongs.

Ordering: the sender writes the record, then the tail; the owner reads the tail, then the record, then
writes the head (after copying the bytes out).  Each write is a plain store through a tensor view; x86-64
keeps stores in order and loads in order (total store order), which is what this relies on.  Not yet run
on a weaker memory model (ARM), where the counters would need acquire/release fences.

The files are created, mapped by every rank, then unlinked (after a barrier on the store): once every rank
has mapped them nothing is left behind whatever way the processes end (a rank killed while the group is
being made leaves its ``freescale-a2a-*`` file).  Linux and x86-64 only (the ordering above): refused in one
line elsewhere.  The CUDA transport (``cuda_ipc_channels``) maps its header files the same way
(``map_group_files``).
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HEADER = 32
ALIGN = 64
_WRAP = -1
_RECORD = 0x5EED
_LINE = 8  # int64s per 64-byte cache line: each counter on a line of its own


@dataclass
class Record:
    """A record at the head of a ring: ``length`` bytes of transfer ``sequence`` at ``offset``."""

    sequence: int
    offset: int
    length: int
    payload: torch.Tensor
    size: int
    """Bytes the record takes in the ring (header, payload, padding)."""


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Inboxes:
    """This rank's inbox and a mapping of every peer's (module docstring).  Collective to build: every rank
    of the group, through ``store``."""

    def __init__(self, store: dist.Store, rank: int, world: int, ring_bytes: int,
                 timeout: timedelta = timedelta(seconds=300)) -> None:
        require_store_order()
        self.rank, self.world, self.ring_bytes = rank, world, _padded(ring_bytes)
        self._control = world * 2 * _LINE * 8
        size = self._control + world * self.ring_bytes
        self._maps, self.pids = map_group_files(store, rank, world, size, timeout)
        """Every rank's inbox mapped; each rank's process id (all on this host: ``gone`` checks them)."""
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._raw = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        """The same bytes through numpy: a counter's or a header's read or write costs ~0.2 us there, ~5 in torch."""
        self._counters = [np.frombuffer(m, dtype=np.int64, count=self._control // 8) for m in self._maps]
        self._peeked: dict[int, Record] = {}

    def gone(self) -> list[int]:
        """The ranks whose process has ended (a peer that dies never writes again: its transfers cannot end)."""
        return ended(self.pids)

    # ------------------------------------------------------------------ counters of the ring src -> owner
    def _tail(self, owner: int, src: int) -> int:
        return int(self._counters[owner][(2 * src) * _LINE])

    def _head(self, owner: int, src: int) -> int:
        return int(self._counters[owner][(2 * src + 1) * _LINE])

    def _ring(self, owner: int, src: int) -> torch.Tensor:
        start = self._control + src * self.ring_bytes
        return self._bytes[owner][start:start + self.ring_bytes]

    def _ring_np(self, owner: int, src: int) -> np.ndarray:
        start = self._control + src * self.ring_bytes
        return self._raw[owner][start:start + self.ring_bytes]

    # ------------------------------------------------------------------ the sender's side
    def send(self, dst: int, sequence: int, offset: int, payload: torch.Tensor) -> int:
        """Append as much of ``payload`` (contiguous uint8) as the ring to ``dst`` has room for, as one record;
        the bytes sent (0: the ring is full for now)."""
        ring, tail, head = self._ring_np(dst, self.rank), self._tail(dst, self.rank), self._head(dst, self.rank)
        free = self.ring_bytes - (tail - head)
        at = tail % self.ring_bytes
        room = self.ring_bytes - at
        if room < HEADER + ALIGN:  # too little before the end for a record: wrap (a marker, if it fits one)
            if free < room:
                return 0
            if room >= HEADER:
                _header(ring, at, _WRAP, 0, 0)
            tail, free, at, room = tail + room, free - room, 0, self.ring_bytes
            self._set_tail(dst, tail)
        length = min(len(payload), room - HEADER, free - HEADER)
        if length <= 0:
            return 0
        self._ring(dst, self.rank)[at + HEADER:at + HEADER + length].copy_(payload[:length])
        _header(ring, at, sequence, offset, length)
        self._set_tail(dst, tail + _padded(HEADER + length))
        return length

    def _set_tail(self, dst: int, value: int) -> None:
        self._counters[dst][(2 * self.rank) * _LINE] = value

    # ------------------------------------------------------------------ the owner's side
    def peek(self, src: int) -> Record | None:
        """The next record from ``src`` in this rank's inbox, or None; its payload is a view into the ring,
        valid until ``release(src)``."""
        if src in self._peeked:
            return self._peeked[src]
        ring, raw = self._ring(self.rank, src), self._ring_np(self.rank, src)
        while True:
            head, tail = self._head(self.rank, src), self._tail(self.rank, src)
            if tail == head:
                return None
            at = head % self.ring_bytes
            room = self.ring_bytes - at
            fields = raw[at:at + HEADER].view(np.int64).tolist() if room >= HEADER else [_WRAP, 0, 0, 0]
            if fields[0] == _WRAP:
                self._counters[self.rank][(2 * src + 1) * _LINE] = head + room
                continue
            sequence, offset, length, marker = fields
            if marker != _RECORD:
                raise RuntimeError(f"SM-free all-to-all: a damaged record from rank {src} (marker {marker:#x})")
            record = Record(sequence, offset, length, ring[at + HEADER:at + HEADER + length], _padded(HEADER + length))
            self._peeked[src] = record
            return record

    def release(self, src: int) -> None:
        """The record ``peek(src)`` gave is consumed: its room goes back to the sender."""
        record = self._peeked.pop(src)
        self._counters[self.rank][(2 * src + 1) * _LINE] = self._head(self.rank, src) + record.size


def require_store_order() -> None:
    """Refuse, in one line, a host whose stores may be seen out of order (the counters' protocol relies on x86-64's
    total store order: module docstring)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"SM-free all-to-all: the shared-memory channels rely on x86-64's store order; this host "
                           f"is {platform.machine()} (not yet supported: use pipeline.comm = 'nccl')")


def map_group_files(store: dist.Store, rank: int, world: int, size: int,
                    timeout: timedelta) -> tuple[list[mmap.mmap], list[int]]:
    """Collective (every rank of the group, through ``store``): this rank's file of ``size`` bytes created, every
    rank's mapped (all must be on this host), and the names unlinked once every rank mapped every file (module
    docstring).  Every rank's map and process id, by rank."""
    name = str(Path(_folder(world * size)) / f"freescale-a2a-{uuid.uuid4().hex}")
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # the pages now: a full tmpfs says ENOSPC here, not SIGBUS at a write
        own = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    store.set(f"inbox/{rank}", f"{socket.gethostname()}\n{os.getpid()}\n{name}")
    maps: list[mmap.mmap] = []
    pids: list[int] = []
    try:
        store.wait([f"inbox/{r}" for r in range(world)], timeout)
        for r in range(world):
            host, pid, path = store.get(f"inbox/{r}").decode().split("\n", 2)
            pids.append(int(pid))
            if host != socket.gethostname():
                raise RuntimeError(f"SM-free all-to-all: rank {r} is on host {host}, not {socket.gethostname()}: "
                                   "shared-memory channels join the ranks of one host only")
            maps.append(own if r == rank else _map(path, size))
        store.add("inbox/mapped", 1)
        deadline = time.monotonic() + timeout.total_seconds()
        while store.add("inbox/mapped", 0) < world:  # every rank mapped every file: the names can go
            if time.monotonic() > deadline:
                raise RuntimeError(f"SM-free all-to-all: the group's {world} ranks did not all map their inboxes")
            time.sleep(0.001)
    finally:
        os.unlink(name)
    return maps, pids


def ended(pids: list[int]) -> list[int]:
    """The ranks (indexes into ``pids``) whose process has ended (a zombie, ended but not reaped, too)."""
    from freescale.lifetime import alive

    return [r for r, pid in enumerate(pids) if not alive(pid)]


def _header(ring: np.ndarray, at: int, sequence: int, offset: int, length: int) -> None:
    ring[at:at + HEADER].view(np.int64)[:] = (sequence, offset, length, _RECORD)


def _folder(group_bytes: int) -> str:
    """Where the inboxes go: ``/dev/shm`` (memory) where it has room for the whole group's with a margin (a
    container's is often 64 MB, and a write past a full tmpfs kills the process with SIGBUS), else the temporary
    folder: a shared file mapping there works alike, its pages written back to disk now and then."""
    try:
        free = os.statvfs("/dev/shm")
        if free.f_bavail * free.f_frsize >= 2 * group_bytes:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
