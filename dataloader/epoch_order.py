"""The order of a split's rows in each epoch, the same on every rank (``BatchPlanner``'s input).

Row groups are shuffled, then rows are shuffled inside windows of ``window_row_groups`` row groups: global
enough to mix, local enough that a step touches few row groups.  Seeded by ``(seed, epoch)``.
"""

from __future__ import annotations

import threading

import numpy as np

KEPT_EPOCHS = 2
"""Epochs' orders kept (8 bytes a row each): the one the reads are in and the next (the read-ahead thread makes it
before the planner reaches it, ``read_ahead.py``)."""


class EpochOrder:
    """Deterministic order of the split's rows in each epoch (module docstring).  Asked from two threads (the
    planner's and the read-ahead's): an epoch's order is made once, by the first to ask, without a lock (the other
    thread takes another epoch's meanwhile, or waits for this one's)."""

    def __init__(self, row_group_rows: np.ndarray, *, seed: int, shuffle: bool, window_row_groups: int) -> None:
        self.row_group_rows = row_group_rows.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.row_group_rows)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        self.seed, self.shuffle, self.window = seed, shuffle, max(1, window_row_groups)
        self._kept: dict[int, np.ndarray] = {}
        """The last ``KEPT_EPOCHS`` epochs' orders made, oldest first."""
        self._making: dict[int, threading.Event] = {}
        """Epochs being made, by another thread than the one asking: set once made (or failed)."""
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Keep no epoch's order (the next asked is made again: the same)."""
        with self._lock:
            self._kept.clear()

    def __call__(self, epoch: int) -> np.ndarray:
        while True:
            with self._lock:
                rows = self._kept.get(epoch)
                if rows is not None:
                    return rows
                making = self._making.get(epoch)
                mine = making is None
                if making is None:
                    making = self._making[epoch] = threading.Event()
            if not mine:  # (another thread makes it: wait for it, then take it, or make it if it failed)
                making.wait()
                continue
            try:
                rows = self._made(epoch) if self.shuffle else np.arange(self.num_rows, dtype=np.int64)
                with self._lock:
                    self._kept[epoch] = rows
                    while len(self._kept) > KEPT_EPOCHS:
                        del self._kept[next(iter(self._kept))]
                return rows
            finally:
                with self._lock:
                    del self._making[epoch]
                making.set()

    def _made(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        groups = rng.permutation(self.row_group_rows.size)
        sizes = self.row_group_rows[groups]
        # Row ids of the permuted row groups, concatenated (vectorized).
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        rows = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1] - self.starts[groups], sizes)
        for start in range(0, groups.size, self.window):  # (in place: as indexing by a permutation of the window)
            rng.shuffle(rows[offsets[start]:offsets[min(start + self.window, groups.size)]])
        return rows


__all__ = ["EpochOrder"]
