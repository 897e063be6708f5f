"""``CopyThread``: a read's history copy made on a thread of its own while the prefetch thread builds its batches.

The last copy of a read (format 2: each sample's most recent items, out of the slots into the KJT values,
``gather.copy_tails_steps``) is a compiled loop that releases the GIL: ~15-19 us a step of 256 samples at histories
of 200 on this 2-core VM, a third of the prefetch thread's time a step.  Handed to this thread, it overlaps the Python
the prefetch thread runs meanwhile (the batches' tensors and KJTs, the steps' infos, the next read's plan)::

    prefetch thread:  read rows  start(copy)  tensors, KJTs, infos, plan next  finish  hand out  read rows ...
    copy thread:                    copy (no GIL) ------------------------->

Its gain needs a core free for it the moment it is woken.  On a machine whose cores are all busy (several rank
processes on two cores), a woken thread may wait milliseconds for one and for the GIL, and the prefetch thread would
wait for it.  So it is used only while it pays: ``finish`` makes the copy itself when the thread has not started it
yet, and after a read where that happened, or where the wait was longer than twice the copy itself, the next
``INLINE_READS`` reads copy on the prefetch thread (no thread woken), then the thread is tried again.  On this VM,
one loader alone: 32-34 of 472 reads copied on the prefetch thread, the rest on this one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from freescale.dataloader.gather import copy_tails_steps

INLINE_READS = 2
"""Reads copied on the caller's thread after one where the copy thread did not pay."""

Jobs = list[tuple[np.ndarray, ...]]
"""``copy_tails_steps`` arguments, one tuple a copy."""


class Copying:
    """One read's copy, started on the copy thread (``CopyThread.start``)."""

    def __init__(self, owner: CopyThread, jobs: Jobs) -> None:
        self.owner, self.jobs = owner, jobs
        self.ran_s: float | None = None
        """How long the copy took on the copy thread."""
        self.future: Future[None] = owner.executor().submit(self._run)

    def _run(self) -> None:
        start = time.perf_counter()
        copy_all(self.jobs)
        self.ran_s = time.perf_counter() - start

    def finish(self) -> None:
        """Return once the copy is made: waiting for the thread, or making it here if the thread has not started it."""
        waited_from = time.perf_counter()
        if self.future.cancel():
            copy_all(self.jobs)
            self.owner.paid(False)
            return
        self.future.result()
        self.owner.paid(self.ran_s is not None and time.perf_counter() - waited_from < 2 * self.ran_s)


class CopyThread:
    """The copy thread (module docstring), started at the first copy; ``close`` ends it (a later copy starts it
    again).  Its copies are started and finished within a read holding the source's read lock (the prefetch
    thread's, or a caller's ``batch_of``): one at a time."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._inline_left = 0
        self.started = self.inline = 0
        """Copies handed to the thread, and copies made on the caller's thread instead (either way: reads)."""

    def start(self, jobs: Jobs) -> Copying | None:
        """``jobs`` started on the thread; None: made here already (none, or the thread does not pay at the moment)."""
        if not jobs:
            return None
        if self._inline_left > 0:
            self._inline_left -= 1
            copy_all(jobs)
            self.inline += 1
            return None
        self.started += 1
        return Copying(self, jobs)

    def aside(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the thread, nobody waiting for it (a copy started after it waits for it, or is made on
        the caller's thread: ``finish``)."""
        self.executor().submit(job)

    def paid(self, paid: bool) -> None:
        """Whether the last copy handed to the thread shortened its read (else the next reads copy here)."""
        if not paid:
            self._inline_left = INLINE_READS

    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="freescale-copy")
        return self._executor

    def close(self) -> None:
        """End the thread (after the copy in flight)."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


def copy_all(jobs: Jobs) -> None:
    """``copy_tails_steps`` of each of ``jobs``."""
    for src, ends, lengths, out, bounds, starts in jobs:
        copy_tails_steps(src, ends, lengths, out, bounds, starts)


__all__ = ["INLINE_READS", "CopyThread", "Copying", "copy_all"]
