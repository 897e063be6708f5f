"""The lighthouse process's garbage collector, kept off its answers.

A full collection in a lighthouse serving 512 groups took up to 45 ms (``benchmarks/bench_lighthouse.py`` at 4,096
ranks, ``gc.callbacks`` timing each collection): one that lands during a vote delays every group's answer to it, a
twentieth of a run's answers at once, so it sets the vote's P99.  In its own process (``freescale lighthouse``)
the lighthouse therefore takes the collector over:

- no full collection starts on its own (the oldest generation's threshold is raised out of reach; the young
  generations are collected as usual: under a few ms at that size);
- at a quiet moment (no vote and no quorum request waiting) at most every ``COLLECT_EVERY_S``, it collects
  everything (what it froze the time before included: no cycle outlives the next quiet moment) and freezes what
  is left (``gc.freeze``), so the young collections in between never walk it.

Cyclic garbage waits that long, or ``FORCE_AFTER`` times that where the lighthouse is never quiet (then it collects
anyway); everything else is freed by reference counting at once, as always.  From Python 3.14 the collector is
incremental (no long full collections) and is left alone.
Where the lighthouse runs inside another process (the trainer's in-process lighthouse) the collector is that
process's and is left alone.
"""

from __future__ import annotations

import gc
import sys
import time

COLLECT_EVERY_S = 10.0
FORCE_AFTER = 6
INCREMENTAL = sys.version_info >= (3, 14)
"""Python's collector is incremental from 3.14: no pause to keep off the answers."""
PYTHON_GC_ENV = "FREESCALE_LIGHTHOUSE_PYTHON_GC"
"""Set to 1: the lighthouse process leaves Python's collector as it is (``bench_lighthouse.py --gc both``)."""
_NEVER = 1 << 30  # full collections only when asked for


class QuietCollector:
    """``take_over()`` once; ``tick(quiet)`` from the lighthouse's ticker."""

    def __init__(self, every_s: float = COLLECT_EVERY_S) -> None:
        self.every_s = every_s
        self.collections = 0
        self.last_s = 0.0
        """How long the last quiet collection took."""
        self._due = 0.0

    def take_over(self) -> None:
        if INCREMENTAL:
            return
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, _NEVER)
        self._collect()

    def tick(self, quiet: bool) -> None:
        if INCREMENTAL or self.collections == 0:
            return
        now = time.monotonic()
        if (quiet and now >= self._due) or now >= self._due + (FORCE_AFTER - 1) * self.every_s:
            self._collect()

    def _collect(self) -> None:
        started = time.perf_counter()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.last_s = time.perf_counter() - started
        self.collections += 1
        self._due = time.monotonic() + self.every_s


__all__ = ["COLLECT_EVERY_S", "FORCE_AFTER", "PYTHON_GC_ENV", "QuietCollector"]
