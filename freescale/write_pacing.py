"""A background save's CPU use, kept to a share of one core while the training runs.

A checkpoint's write is CPU work on the rank's host: DCP's planning and pickled collectives, ``torch.save``'s
copy of every tensor into the page cache (kernel time in ``write``), reading the bytes back to hash them.  On
a host whose cores the training keeps busy, that work lands on the training's steps however low the writer's
thread priority is: it shares the cores, the memory bandwidth and the GIL.  Done at full speed it makes a
few steps much slower (2x a step for the whole write, ``benchmarks/bench_saves.py``); paced, the same work
is spread thinly over many more steps, each a little slower.

``Pacer`` measures the writer thread's own CPU time (``time.thread_time``: user and kernel time of that thread
only) against the wall time since the write began, and at each pause point sleeps until the thread has used
no more than ``share`` of the elapsed time.  Pause points come every ``PIECE`` bytes written or hashed
(``PacedFileSystem``, ``checkpoint_integrity``), so the work between two sleeps is a fraction of a
millisecond and the training's thread never waits long for the GIL or a core.  Work without pause points
(DCP's planning, the layout conversion) is paid back at the next one.

Pacing stops (``release``) as soon as the training waits for the write: the last step's save, a save that
cannot be skipped, a stop (``CheckpointWriter.wait``/``abandon``): then the write runs at full speed.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem

PIECE = 256 << 10
"""Bytes written or hashed between two pause points (about 0.05-0.1 ms of a core)."""
_LONGEST_SLEEP_S = 0.5
_CREDIT_S = 0.02
"""Wall time unused by the writer (it waited) that it may catch up on at full speed."""


class Pacer:
    """Keeps the calling thread's CPU time under ``share`` of the wall time since ``begin`` (module docstring).
    ``share`` 0 or >= 1 never sleeps.  ``arm`` before a write is handed over and ``release`` from any thread;
    ``begin``, ``pause``, ``planned`` and ``end`` on the writer's thread."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._released = threading.Event()
        self._cpu0 = self._wall0 = self._began = 0.0
        self.slept_s = self.cpu_s = 0.0
        """The last write's seconds slept, and its thread's CPU seconds (``end``; its log record reports them)."""
        self.start_cpu_s = self.start_s = 0.0
        """The last write's start, until its files began to be written (``planned``): its thread's CPU seconds
        (the state's structure, its conversion, DCP's planning) and the seconds it took."""

    @property
    def active(self) -> bool:
        return 0 < self.share < 1 and not self._released.is_set()

    def arm(self) -> None:
        """A write is handed to the writer's thread (called before it is): paced until ``release``."""
        self._released.clear()

    def begin(self) -> None:
        """The write starts on this thread: its CPU time and wall time count from now (a ``release`` made since
        ``arm`` holds: the training may be waiting for this write already)."""
        self._cpu0, self._wall0, self.slept_s, self.cpu_s = time.thread_time(), time.perf_counter(), 0.0, 0.0
        self._began, self.start_cpu_s, self.start_s = self._wall0, 0.0, 0.0

    def planned(self) -> None:
        """The write's files begin to be written (on its thread): its start's CPU and seconds noted."""
        self.start_cpu_s, self.start_s = time.thread_time() - self._cpu0, time.perf_counter() - self._began

    def pause(self) -> None:
        """Sleep until this thread's CPU time since ``begin`` is at most ``share`` of the wall time.  Time the
        thread spent waiting (DCP's collectives, a slower rank) earns at most ``_CREDIT_S`` of it: a long wait
        is no licence for a burst after it."""
        if not self.active:
            return
        now, used = time.perf_counter(), (time.thread_time() - self._cpu0) / self.share
        self._wall0 = max(self._wall0, now - used - _CREDIT_S)
        behind = used - (now - self._wall0)
        if behind > 0:
            start = time.perf_counter()
            self._released.wait(min(behind, _LONGEST_SLEEP_S))
            self.slept_s += time.perf_counter() - start

    def end(self) -> None:
        """The write is done (on its thread): its CPU time noted."""
        self.cpu_s = time.thread_time() - self._cpu0

    def release(self) -> None:
        """The training waits for the write: no more sleeping (until the next ``arm``)."""
        self._released.set()


class PacedStream(io.RawIOBase):
    """A file DCP writes through: each ``write`` is cut into ``PIECE`` byte pieces with a pause after each."""

    def __init__(self, raw: Any, pacer: Pacer) -> None:
        super().__init__()
        self.raw, self.pacer = raw, pacer

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), PIECE):
            self.raw.write(view[at:at + PIECE])
            self.pacer.pause()
        return len(view)

    def tell(self) -> int:
        return int(self.raw.tell())

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self.raw.seek(offset, whence))

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return int(self.raw.fileno())


class PacedFileSystem(FileSystem):
    """DCP's local file system whose files opened for writing are ``PacedStream``s."""

    def __init__(self, pacer: Pacer) -> None:
        super().__init__()
        self.pacer = pacer

    @contextlib.contextmanager
    def create_stream(self, path: str | Any, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode or not self.pacer.active:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as raw:
            paced = PacedStream(raw, self.pacer)
            yield paced
            raw.flush()


class PacedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with a pause before each of its steps and before each item it hands to the
    writer (``resolve_data``): DCP's planning is Python holding the GIL, a burst at the write's start."""

    def __init__(self, pacer: Pacer, enable_plan_caching: bool = False) -> None:
        super().__init__(enable_plan_caching=enable_plan_caching)
        self.pacer = pacer

    def create_local_plan(self) -> Any:
        self.pacer.pause()
        return super().create_local_plan()

    def create_global_plan(self, all_plans: Any) -> Any:
        self.pacer.pause()
        return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan: Any) -> Any:
        self.pacer.pause()
        finished = super().finish_plan(new_plan)
        self.pacer.planned()
        return finished

    def resolve_data(self, write_item: Any) -> Any:
        self.pacer.pause()
        return super().resolve_data(write_item)


_SHORT_GIL_TURN_S = 0.0005


@contextlib.contextmanager
def light_write() -> Iterator[None]:
    """While a write runs, two process-wide settings, put back after it.  Python's switch interval at 0.5 ms (from
    5): the writer's Python (DCP's planning, its pickled collectives, the layout conversion) holds the GIL in
    stretches, and a training thread that wants it back (after every torch op, which releases it) waits up to one
    interval each time (the steps while a save was written: 1.5-2x a step at 5 ms, 1.2-1.5x at 0.5 ms on a busy
    2-core host, ``benchmarks/bench_saves.py``).  No CRC-32 in ``torch.save``'s zip records (DCP writes each tensor
    with it; 14 ms of CPU per 34 MB): ``checkpoint_integrity`` hashes every item already.  A ``torch.save`` on
    another thread meanwhile writes none either; ``torch.load`` does not need it."""
    from torch.utils.serialization import config as serialization

    previous, crc = sys.getswitchinterval(), serialization.save.compute_crc32
    sys.setswitchinterval(min(previous, _SHORT_GIL_TURN_S))
    serialization.save.compute_crc32 = False
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
        serialization.save.compute_crc32 = crc


def lower_priority() -> None:
    """Nice 10 for this thread (Linux: per thread).  Not ``SCHED_IDLE``: no faster steps while it wrote
    (``benchmarks/bench_saves.py``, 2 ranks on 2 cores), and where the training's threads keep every core busy
    (intra-op threads) it starved the write for seconds."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not allowed: the write just competes evenly
        pass
