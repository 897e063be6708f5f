"""``BufferPool``: the batches' largest buffer reused once no batch holds it any more.

Each read of several steps writes every step's KJT values into one buffer (``assemble.py``: a few MB at batch 256,
histories of 200).  Allocated afresh per read on the prefetch thread and freed on the training thread when its
batches die, such a buffer cost the thread page faults at every read (format 2 at batch 256: 1-6 a step against
~1 with the pool; its time 1.08x the pool's at the median of paired rounds, 0.92-1.20x: within this machine's
noise; docs/data.md).  The pool hands out views of a few buffers it keeps and takes one back once the view it
handed out is gone: the tensors made from it (``torch.from_numpy`` keeps the view alive while any tensor sharing
its memory lives) and everything built of them.  A buffer still held (a batch kept by the training loop, a
pipeline's batches in flight) is never written: the pool allocates another, and keeps at most ``keep`` of them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np

_GROWTH = 1.25
"""A new buffer's room over the size asked (the next reads' sizes vary by a few percent)."""


class BufferPool:
    """Reusable flat buffers (module docstring); thread-safe."""

    def __init__(self, keep: int = 6) -> None:
        self.keep = keep
        self._buffers: list[tuple[np.ndarray, Callable[[], np.ndarray | None]]] = []
        """Each buffer and what answers the view of it handed out last while that view lives (None once it is gone)."""
        self._lock = threading.Lock()
        self.allocated = 0
        """Buffers allocated so far (kept or not): how often the pool found none free."""

    def take(self, size: int, dtype: np.dtype | type) -> np.ndarray:
        """An uninitialised array of ``size`` elements of ``dtype``: a view of a kept buffer no earlier view of which
        is alive, else of a new one (kept if fewer than ``keep`` are).  Only numpy slices of it made and dropped by
        the caller, and tensors made from it (``torch.from_numpy``), may outlive the call: a numpy view of it kept
        past its own life would not hold the buffer."""
        dtype = np.dtype(dtype)
        with self._lock:
            for i, (buffer, handed) in enumerate(self._buffers):
                if buffer.dtype == dtype and buffer.size >= size and handed() is None:
                    view = buffer[:size]
                    self._buffers[i] = (buffer, weakref.ref(view))
                    return view
            self.allocated += 1
            buffer = np.empty(max(int(size * _GROWTH), 1), dtype=dtype)
            view = buffer[:size]
            if len(self._buffers) < self.keep:
                self._buffers.append((buffer, weakref.ref(view)))
            elif self._buffers:  # (full: the smallest free one makes room for this larger one)
                free = [i for i, (_, handed) in enumerate(self._buffers) if handed() is None]
                if free:
                    self._buffers[min(free, key=lambda i: self._buffers[i][0].size)] = (buffer, weakref.ref(view))
            return view

    def reserve(self, size: int, dtype: np.dtype | type, count: int) -> int:
        """Up to ``count`` more free buffers of ``size`` elements of ``dtype`` (within ``keep``), each written once
        here, so the pages a read's copy will write are mapped already: a fresh buffer's first writes fault every 4
        KB (~2.5 us each on a 2-core VM: ~1.5 ms for a read of 16 steps of format 2, ~10 ms over a loader's first
        reads), and this runs on an idle thread (``copy_thread.py``) at a loader's start; the writes release the
        GIL.  How many were added."""
        dtype = np.dtype(dtype)
        added = 0
        for _ in range(count):
            with self._lock:
                if len(self._buffers) >= self.keep:
                    break
            buffer = np.empty(size, dtype=dtype)
            buffer.fill(0)
            with self._lock:
                if len(self._buffers) >= self.keep:
                    break
                self._buffers.append((buffer, _none))
                self.allocated += 1
            added += 1
        return added


def _none() -> None:
    """A reserved buffer's "view handed out": none."""
    return None


__all__ = ["BufferPool"]
