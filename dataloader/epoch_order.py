"""The order of a split's rows in each epoch, the same on every rank (``BatchPlanner``'s input).

Row groups are shuffled, then rows are shuffled inside windows of ``window_row_groups`` row groups: global
enough to mix, local enough that a step touches few row groups.  Seeded by ``(seed, epoch)``.
"""

from __future__ import annotations

import numpy as np


class EpochOrder:
    """Deterministic order of the split's rows in each epoch (module docstring)."""

    def __init__(self, row_group_rows: np.ndarray, *, seed: int, shuffle: bool, window_row_groups: int) -> None:
        self.row_group_rows = row_group_rows.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.row_group_rows)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        self.seed, self.shuffle, self.window = seed, shuffle, max(1, window_row_groups)
        self._cached: tuple[int, np.ndarray] | None = None

    def forget(self) -> None:
        """Keep no epoch's order (the next asked is made again: the same)."""
        self._cached = None

    def __call__(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, epoch])
        groups = rng.permutation(self.row_group_rows.size)
        sizes = self.row_group_rows[groups]
        # Row ids of the permuted row groups, concatenated (vectorized).
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        rows = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1] - self.starts[groups], sizes)
        for start in range(0, groups.size, self.window):
            lo, hi = offsets[start], offsets[min(start + self.window, groups.size)]
            rows[lo:hi] = rows[lo:hi][rng.permutation(hi - lo)]
        self._cached = (epoch, rows)
        return rows


__all__ = ["EpochOrder"]
