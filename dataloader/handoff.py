"""``Handoff``: the prefetch thread's batches to the training thread, a read's several at once.

A ``queue.Queue`` hands items over one at a time: a consumer that takes batches faster than they are made waits
after each, and each ``put`` wakes it, a hand-over of the GIL and a context switch a batch (format 2 at batch 256
through the prefetch thread on a 2-core VM: ~100 us a step with a queue, ~85 with this; docs/data.md).  Here the
producer puts a read's batches together (``put_all``) and the consumer takes them one by one from the same buffer
without waiting, so it is woken once a read.  The buffer holds at most ``capacity`` items, or one put's items when it is empty (a put is
never refused for being larger than the buffer), so the producer runs at most that far ahead.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    """A bounded buffer between one producer and one consumer (module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._items: deque[T] = deque()
        self._changed = threading.Condition(threading.Lock())
        self._wanted = 0
        """Items a waiting ``put_all`` brings (0: none waits): a ``get`` wakes it only once they fit."""

    def put_all(self, items: list[T], stopped: Callable[[], bool], poll_s: float = 0.05) -> bool:
        """Append ``items`` once they fit (or the buffer is empty); False, and nothing appended, if ``stopped()``
        first (checked every ``poll_s`` while waiting)."""
        with self._changed:
            while self._items and len(self._items) + len(items) > self.capacity:
                if stopped():
                    return False
                self._wanted = len(items)
                self._changed.wait(poll_s)
                self._wanted = 0
            if stopped():
                return False
            self._items.extend(items)
            self._changed.notify_all()
        return True

    def put_now(self, item: T) -> None:
        """Append ``item`` whatever the buffer holds (the producer's failure, which it must not wait to hand over)."""
        with self._changed:
            self._items.append(item)
            self._changed.notify_all()

    def get(self, timeout: float | None = None) -> T:
        """The oldest item, waiting for one up to ``timeout`` seconds (None: for ever); ``TimeoutError`` if none
        came."""
        with self._changed:
            if not self._items and not self._changed.wait_for(lambda: bool(self._items), timeout):
                raise TimeoutError("no item within the timeout")
            item = self._items.popleft()
            if self._wanted and (not self._items or len(self._items) + self._wanted <= self.capacity):
                self._changed.notify_all()
            return item

    def __len__(self) -> int:
        """Items waiting (read without the lock: may be stale)."""
        return len(self._items)

    def clear(self) -> None:
        """Drop every item and wake a waiting producer."""
        with self._changed:
            self._items.clear()
            self._changed.notify_all()


__all__ = ["Handoff"]
