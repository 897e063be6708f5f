"""The order of a split's rows in each epoch, the same on every rank (``BatchPlanner``'s input).

Row groups are shuffled, then rows are shuffled inside windows of ``window_row_groups`` row groups: global
enough to mix, local enough that a step touches few row groups.  Seeded by ``(seed, epoch)``.
"""

from __future__ import annotations

import threading

import numpy as np

KEPT_EPOCHS = 2
"""Whole epochs' orders kept (8 bytes a row each): the one the reads are in and the next (the read-ahead thread makes
it before the planner reaches it, ``read_ahead.py``); beside them, and any being made, as many made in part (an
epoch's last windows may hold no step's rows: without a read-ahead to finish it, an order stays partly made)."""


ADVANCE_WAIT_S = 1.0
"""How long ``advance`` waits at most for another thread's next window (a bound: it is woken at each)."""


class _Progress:
    """An epoch's order as it is made: ``rows`` final up to ``made`` (the rest not made yet: never read); the
    random draws go on where the last window's ended (``rng``), at row group ``next`` of ``groups``."""

    __slots__ = ("groups", "made", "making", "next", "offsets", "rng", "rows", "sizes")

    def __init__(self, order: EpochOrder, epoch: int) -> None:
        self.rows = np.empty(order.num_rows, dtype=np.int64)
        self.made, self.making, self.next = 0, False, 0
        self.rng = np.random.default_rng([order.seed, epoch])
        self.groups = order.groups(epoch, self.rng)
        self.sizes = order.row_group_rows[self.groups]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])


class EpochOrder:
    """Deterministic order of the split's rows in each epoch (module docstring).  Asked from two threads (the
    planner's and the read-ahead's): an epoch's order is made once, a window at a time as far as the asker needs
    (the random draws are sequential: the row groups' shuffle, then each window's rows in turn), the rest by later
    askers or ``advance``; another epoch's order is taken meanwhile without waiting."""

    def __init__(self, row_group_rows: np.ndarray, *, seed: int, shuffle: bool, window_row_groups: int) -> None:
        self.row_group_rows = row_group_rows.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.row_group_rows)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        self.seed, self.shuffle, self.window = seed, shuffle, max(1, window_row_groups)
        self._epochs: dict[int, _Progress] = {}
        """Epochs made whole or in part (as many as ``KEPT_EPOCHS`` says), oldest first."""
        self._changed = threading.Condition()

    def complete(self, epoch: int) -> bool:
        """Whether epoch ``epoch``'s order is made whole."""
        with self._changed:
            progress = self._epochs.get(epoch)
            return progress is not None and progress.made == self.num_rows

    def groups(self, epoch: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """Epoch ``epoch``'s row groups in order: the order's first draw (from ``rng``, else a generator of its own)."""
        if not self.shuffle:
            return np.arange(self.row_group_rows.size)
        return (rng or np.random.default_rng([self.seed, epoch])).permutation(self.row_group_rows.size)

    def groups_of_rows(self, epoch: int, first: int, end: int) -> list[int]:
        """The row groups of the shuffle windows that rows ``[first, end)`` of epoch ``epoch``'s order fall in, and
        of the window after them, without the order: the row groups' shuffle alone (its first draw, microseconds)
        says which windows those are; where each row comes in them is the rows' shuffle.  A read-ahead decodes them
        while the order is made (``ReadAhead.prime``)."""
        with self._changed:
            progress = self._epochs.get(epoch)
        if progress is not None:  # (its row groups' shuffle drawn already: not drawn again at every read)
            groups, ends = progress.groups, progress.offsets[1:]
        else:
            groups = self.groups(epoch)
            ends = np.cumsum(self.row_group_rows[groups])
        low = int(np.searchsorted(ends, first, side="right")) // self.window * self.window
        high = (int(np.searchsorted(ends, max(first, end - 1), side="right")) // self.window + 2) * self.window
        return groups[low:high].tolist()

    def forget(self) -> None:
        """Keep no epoch's order (the next asked is made again: the same), but one being made (kept)."""
        with self._changed:
            for epoch in [e for e, progress in self._epochs.items() if not progress.making]:
                del self._epochs[epoch]

    def __call__(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s whole order (what is not made yet made on this thread)."""
        return self.rows_until(epoch, self.num_rows)

    def rows_until(self, epoch: int, end: int) -> np.ndarray:
        """Epoch ``epoch``'s order with at least its first ``end`` rows made (read no further: the rest may not
        be): the windows up to ``end`` not made yet are made on this thread (or waited for while another makes
        them).  A planner's first steps of an epoch of 317k rows wait ~0.3 ms for their window, not ~4 ms for all."""
        progress = self._take(epoch, end)
        if progress.made < end:
            self._make(epoch, progress, end)
        return progress.rows

    def advance(self, epoch: int) -> bool:
        """One more window of epoch ``epoch``'s order made; while another thread makes it, that thread's next window
        (or its end) waited for instead, nothing made here (a caller looping on this never spins); whether any is
        left to make after it (a thread with nothing else to do finishes the order this way, a window at a time,
        before the reads need it)."""
        with self._changed:
            other = self._epochs.get(epoch)
            if other is not None and other.making:
                made, being_made = other.made, other
                self._changed.wait_for(lambda: not being_made.making or being_made.made > made, ADVANCE_WAIT_S)
                return being_made.made < self.num_rows
        progress = self._take(epoch, self.num_rows)
        if progress.made < self.num_rows:
            self._make(epoch, progress, progress.made + 1)
        return progress.made < self.num_rows

    def _take(self, epoch: int, end: int) -> _Progress:
        """Epoch ``epoch``'s progress (created if new), marked as being made by this thread unless its first ``end``
        rows are made (waiting while another thread makes it)."""
        with self._changed:
            while True:
                progress = self._epochs.get(epoch)
                if progress is None:
                    progress = self._epochs[epoch] = _Progress(self, epoch)
                if progress.made >= end:
                    return progress
                if not progress.making:
                    progress.making = True
                    self._evict(progress)
                    return progress
                self._changed.wait()

    def _evict(self, newest: _Progress) -> None:
        """The oldest orders beyond ``KEPT_EPOCHS`` whole ones and as many made in part dropped, never ``newest`` nor
        one being made (a dropped one is made again, the same, if asked).  With ``_changed`` held."""
        whole = [e for e, p in self._epochs.items() if p.made == self.num_rows and p is not newest]
        partial = [e for e, p in self._epochs.items() if p.made < self.num_rows and not p.making and p is not newest]
        if not newest.making:  # (counted, never dropped: the last)
            (whole if newest.made == self.num_rows else partial).append(-1)
        for epoch in whole[:max(0, len(whole) - KEPT_EPOCHS)] + partial[:max(0, len(partial) - KEPT_EPOCHS)]:
            del self._epochs[epoch]

    def _make(self, epoch: int, progress: _Progress, end: int) -> None:
        """``progress``'s windows made until its first ``end`` rows are, in place (the same orders as indexing by a
        permutation of each window), each published as it is made; this thread's mark then lifted.  On a failure
        the epoch's progress is dropped (the next asker starts it again and meets the error itself)."""
        try:
            groups, sizes, offsets, window = progress.groups, progress.sizes, progress.offsets, self.window
            firsts = self.starts[groups] - offsets[:-1]  # (a row group's rows: their place in the order + this)
            while progress.made < end and progress.next < groups.size:
                start, stop = progress.next, min(progress.next + window, groups.size)
                low, high = int(offsets[start]), int(offsets[stop])
                rows = progress.rows[low:high]
                rows[:] = np.arange(low, high, dtype=np.int64) + np.repeat(firsts[start:stop], sizes[start:stop])
                if self.shuffle:
                    progress.rng.shuffle(rows)
                with self._changed:
                    progress.made, progress.next = high, stop
                    self._changed.notify_all()
        except BaseException:
            with self._changed:
                if self._epochs.get(epoch) is progress:
                    del self._epochs[epoch]
            raise
        finally:
            with self._changed:
                progress.making = False
                if self._epochs.get(epoch) is progress:
                    self._evict(progress)
                self._changed.notify_all()


__all__ = ["EpochOrder"]
