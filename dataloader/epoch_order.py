"""The order of a split's rows in each epoch, the same on every rank (``BatchPlanner``'s input).

Row groups are shuffled, then rows are shuffled inside windows of ``window_row_groups`` row groups: global
enough to mix, local enough that a step touches few row groups.  Seeded by ``(seed, epoch)``.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any, cast

import numpy as np

from freescale.dataloader.schema import DataError

KEPT_EPOCHS = 2
"""Whole epochs' orders kept (8 bytes a row each): the one the reads are in and the next (the read-ahead thread makes
it before the planner reaches it, ``read_ahead.py``); beside them, and any being made or failed, as many made in part
(an epoch's last windows may hold no step's rows: without a read-ahead to finish it, an order stays partly made)."""


ORDER_VERSION = 1
"""How an epoch's order is drawn (a saved draws' state restores only the same way's)."""

ADVANCE_WAIT_S = 1.0
"""How long ``advance`` waits at most for another thread's next window (a bound: it is woken at each)."""


class _Cursor:
    """Where one run of windows is: the random draws go on from ``rng``, at row group ``next`` (of the epoch's
    ``groups``), up to row group ``stop``; its rows final from where it began up to ``made``."""

    __slots__ = ("made", "next", "rng", "stop")

    def __init__(self, rng: np.random.Generator, next_group: int, made: int, stop: int) -> None:
        self.rng, self.next, self.made, self.stop = rng, next_group, made, stop


class _Progress:
    """An epoch's order as it is made: windows from its start (``low``) and, for an order resumed mid-epoch
    (``EpochOrder.restore``), windows from the resumed window on (``high``, the draws restored where they were);
    ``rows`` final where a cursor made them (nothing else is ever read)."""

    __slots__ = ("failure", "firsts", "groups", "high", "low", "making", "offsets", "resumed", "rows", "sizes",
                 "states")

    def __init__(self, order: EpochOrder, epoch: int) -> None:
        self.rows = np.empty(order.num_rows, dtype=np.int64)
        rng = np.random.default_rng([order.seed, epoch])
        self.groups = order.groups(epoch, rng)
        self.sizes = order.row_group_rows[self.groups]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.firsts = order.starts[self.groups] - self.offsets[:-1]  # (a row group's rows: their place + this)
        self.low, self.high = _Cursor(rng, 0, 0, self.groups.size), cast(_Cursor | None, None)
        self.making = False
        self.resumed: dict[str, Any] | None = None
        """The draws' state ``high`` was restored with (the low run's, reaching it, must agree)."""
        self.states: dict[int, dict[str, Any]] = {0: dict(rng.bit_generator.state)}
        """The draws' state before each window (by its first row group; recorded as the window before it is made):
        what a saved position restores."""
        self.failure: DataError | None = None
        """A resumed order found not to be the seed's: raised to every asker of the epoch."""

    def final(self, first: int, end: int) -> bool:
        """Whether rows ``[first, end)`` are made."""
        if end <= self.low.made:
            return True
        if self.high is None:
            return False
        start = int(self.offsets[self.low.stop])
        return (first >= start or self.low.made >= start) and end <= self.high.made

    def whole(self) -> bool:
        return self.low.next >= self.low.stop and (self.high is None or self.high.next >= self.high.stop)

    def made_rows(self) -> tuple[int, int]:
        """Where each run is (a change says a window was made)."""
        return self.low.made, self.high.made if self.high is not None else -1

    def cursor_for(self, first: int) -> _Cursor | None:
        """The cursor whose next window brings rows from ``first`` on closer (the resumed run's first, when
        ``first`` is past where it began or the run from the start reached it)."""
        high, low = self.high, self.low
        if high is not None and high.next < high.stop and (first >= self.offsets[low.stop] or low.next >= low.stop):
            return high
        if low.next < low.stop:
            return low
        return high if high is not None and high.next < high.stop else None


class EpochOrder:
    """Deterministic order of the split's rows in each epoch (module docstring).  Asked from two threads (the
    planner's and the read-ahead's): an epoch's order is made once, a window at a time as far as the asker needs
    (the random draws are sequential: the row groups' shuffle, then each window's rows in turn), the rest by later
    askers or ``advance``; another epoch's order is taken meanwhile without waiting.  A saved position carries the
    draws' state at its window (``state_at``): a resumed loader makes its order from there (``restore``), not from
    the epoch's start, and the windows before it after."""

    def __init__(self, row_group_rows: np.ndarray, *, seed: int, shuffle: bool, window_row_groups: int) -> None:
        self.row_group_rows = row_group_rows.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.row_group_rows)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        self.seed, self.shuffle, self.window = seed, shuffle, max(1, window_row_groups)
        self._sizes_crc = zlib.crc32(self.row_group_rows.tobytes())
        self._epochs: dict[int, _Progress] = {}
        """Epochs made whole or in part (as many as ``KEPT_EPOCHS`` says), oldest first."""
        self._changed = threading.Condition()

    def complete(self, epoch: int) -> bool:
        """Whether epoch ``epoch``'s order is made whole."""
        with self._changed:
            progress = self._epochs.get(epoch)
            return progress is not None and progress.whole()

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

    def state_at(self, epoch: int, row: int) -> dict[str, Any] | None:
        """The draws' state before the window holding row ``row`` of epoch ``epoch``'s order, as JSON, with what
        identifies the order (its seed, window, row groups' sizes and shuffle, numpy's version): a loader's saved
        position, from which ``restore`` makes the order (after a restore, its window's at once).  None for an
        unshuffled order, a window whose previous one is not made here, or an order found not to be the seed's."""
        with self._changed:
            progress = self._epochs.get(epoch)
            if progress is None or not self.shuffle or not progress.groups.size:
                return None
            if progress.failure is not None:  # (its draws are not the seed's: never passed on)
                return None
            group = min(int(np.searchsorted(progress.offsets, row, side="right")) - 1, progress.groups.size - 1)
            group = group // self.window * self.window
            state = progress.states.get(group)
        if state is None:
            return None
        return {"epoch": epoch, "row_group": group, "rng": _encoded(state), **self._identity(progress.groups)}

    def restore(self, saved: dict[str, Any]) -> bool:
        """Epoch ``saved["epoch"]``'s order made from the saved window on (``state_at``'s), the windows before it
        after (from the epoch's start, as ever): a resumed loader's first steps wait for their window, not for
        every window before them.  Whether it was taken: not when the epoch is made here already, nor for another
        order's state (another seed, window, row groups, or numpy, whose draws may differ: made from the start)."""
        epoch, group = int(saved["epoch"]), int(saved["row_group"])
        if not self.shuffle or group % self.window or not 0 < group < self.row_group_rows.size:
            return False
        progress = _Progress(self, epoch)  # (in place of one that failed, below: this process meets a good save again)
        if any(saved.get(key) != value for key, value in self._identity(progress.groups).items()):
            return False
        rng = np.random.default_rng()
        rng.bit_generator.state = _decoded(saved["rng"])
        if rng.bit_generator.state["state"]["inc"] != progress.low.rng.bit_generator.state["state"]["inc"]:
            return False  # (PCG64's stream is fixed by its seed: another epoch's or seed's draws)
        with self._changed:
            known = self._epochs.get(epoch)
            if known is not None and known.failure is None:
                return False
            progress.high = _Cursor(rng, group, int(progress.offsets[group]), progress.groups.size)
            progress.low.stop, progress.resumed = group, dict(rng.bit_generator.state)
            progress.states[group] = dict(progress.resumed)
            self._epochs[epoch] = progress
            self._evict(progress)
        return True

    def _identity(self, groups: np.ndarray) -> dict[str, Any]:
        """What a saved draws' state belongs to: the seed, the window, the row groups' sizes and their shuffle (a
        digest each), numpy's version (its shuffle's draws are not promised alike across versions)."""
        return {"order_version": ORDER_VERSION, "seed": self.seed, "window_row_groups": self.window,
                "numpy": np.__version__,
                "sizes_crc": self._sizes_crc,
                "groups_crc": zlib.crc32(np.ascontiguousarray(groups, dtype=np.int64).tobytes())}

    def forget(self) -> None:
        """Keep no epoch's order (the next asked is made again: the same), but one being made or failed (kept)."""
        with self._changed:
            for epoch in [e for e, p in self._epochs.items() if not p.making and p.failure is None]:
                del self._epochs[epoch]

    def __call__(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s whole order (what is not made yet made on this thread)."""
        return self.rows_until(epoch, self.num_rows)

    def rows_until(self, epoch: int, end: int, first: int = 0) -> np.ndarray:
        """Epoch ``epoch``'s order with at least its rows ``[first, end)`` made (read no others: they may not be):
        the windows up to ``end`` not made yet are made on this thread (or waited for while another makes them).  A
        planner's first steps of an epoch of 317k rows wait ~0.3 ms for their window, not ~4 ms for all."""
        progress = self._take(epoch, first, end)
        if not progress.final(first, end):
            self._make(epoch, progress, first, end)
        return progress.rows

    def advance(self, epoch: int) -> bool:
        """One more window of epoch ``epoch``'s order made; while another thread makes it, that thread's next window
        (or its end) waited for instead, nothing made here (a caller looping on this never spins); whether any is
        left to make after it (a thread with nothing else to do finishes the order this way, a window at a time,
        before the reads need it).  A resumed order found not to be the seed's raises its error here too."""
        with self._changed:
            other = self._epochs.get(epoch)
            if other is not None and other.making:
                made, being_made = other.made_rows(), other
                self._changed.wait_for(lambda: not being_made.making or being_made.made_rows() != made, ADVANCE_WAIT_S)
                return not being_made.whole()
        progress = self._take(epoch, self.num_rows, self.num_rows + 1)
        if not progress.whole():
            self._make(epoch, progress, self.num_rows, self.num_rows + 1, windows=1)
        return not progress.whole()

    def _take(self, epoch: int, first: int, end: int) -> _Progress:
        """Epoch ``epoch``'s progress (created if new), marked as being made by this thread unless its rows
        ``[first, end)`` are made (waiting while another thread makes it)."""
        with self._changed:
            while True:
                progress = self._epochs.get(epoch)
                if progress is None:
                    progress = self._epochs[epoch] = _Progress(self, epoch)
                if progress.failure is not None:
                    raise DataError(*progress.failure.args)  # (a new one each time: no traceback piled up)
                if progress.final(first, end) or progress.whole():
                    return progress
                if not progress.making:
                    progress.making = True
                    self._evict(progress)
                    return progress
                self._changed.wait()

    def _evict(self, newest: _Progress) -> None:
        """The oldest orders beyond ``KEPT_EPOCHS`` whole ones and as many made in part dropped, never ``newest``, one
        being made, nor a failed one (not counted: its error is raised to every asker until a good save is restored);
        a dropped one is made again, the same, if asked.  With ``_changed`` held."""
        kept = [(e, p) for e, p in self._epochs.items() if p is not newest and p.failure is None]  # (a failed: raised)
        whole = [e for e, p in kept if p.whole()]
        partial = [e for e, p in kept if not p.whole() and not p.making]
        if not newest.making:  # (counted, never dropped: the last)
            (whole if newest.whole() else partial).append(-1)
        for epoch in whole[:max(0, len(whole) - KEPT_EPOCHS)] + partial[:max(0, len(partial) - KEPT_EPOCHS)]:
            del self._epochs[epoch]

    def _make(self, epoch: int, progress: _Progress, first: int, end: int, windows: int | None = None) -> None:
        """``progress``'s windows made until its rows ``[first, end)`` are (at most ``windows`` of them), each
        published as it is made; this thread's mark then lifted (it holds it).  On a failure the epoch's progress
        is dropped (the next asker starts it again and meets the error itself), but a resumed order found not to be
        the seed's, which is kept to raise it to every asker."""
        try:
            made = 0
            while (windows is None or made < windows) and not progress.final(first, end):
                cursor = progress.cursor_for(first)
                if cursor is None:
                    break
                self._window(progress, cursor)
                made += 1
        except BaseException:
            with self._changed:
                if self._epochs.get(epoch) is progress and progress.failure is None:
                    del self._epochs[epoch]
            raise
        finally:
            with self._changed:
                progress.making = False
                if self._epochs.get(epoch) is progress:
                    self._evict(progress)
                self._changed.notify_all()

    def _window(self, progress: _Progress, cursor: _Cursor) -> None:
        """``cursor``'s next window made in place (the same orders as indexing by a permutation of the window) and
        published.  The run from the epoch's start reaching where a resumed one began must have drawn alike."""
        start, stop = cursor.next, min(cursor.next + self.window, cursor.stop)
        low, high = int(progress.offsets[start]), int(progress.offsets[stop])
        rows = progress.rows[low:high]
        rows[:] = np.arange(low, high, dtype=np.int64) + np.repeat(progress.firsts[start:stop],
                                                                     progress.sizes[start:stop])
        if self.shuffle:
            cursor.rng.shuffle(rows)
            progress.states.setdefault(stop, dict(cursor.rng.bit_generator.state))  # (the next window's, made or not)
            if cursor is progress.low and stop == cursor.stop and progress.resumed is not None and (
                    cursor.rng.bit_generator.state != progress.resumed):
                with self._changed:  # (every asker of this epoch meets it: no order switched mid-epoch)
                    progress.failure = DataError(
                        f"the epoch's order resumed at row group {stop} of its shuffle is not the one its seed makes: "
                        "the saved position's rows were not the ones trained before it; resume from another save")
                raise progress.failure
        with self._changed:
            cursor.made, cursor.next = high, stop
            self._changed.notify_all()


def _encoded(state: dict[str, Any]) -> dict[str, Any]:
    """A PCG64 state as JSON (its 128-bit numbers as hex)."""
    inner = state["state"]
    return {"bit_generator": state["bit_generator"], "state": hex(inner["state"]), "inc": hex(inner["inc"]),
            "has_uint32": int(state["has_uint32"]), "uinteger": int(state["uinteger"])}


def _decoded(saved: dict[str, Any]) -> dict[str, Any]:
    if saved.get("bit_generator") != "PCG64":
        raise DataError(f"a saved order's draws come from {saved.get('bit_generator')!r}, not PCG64")
    return {"bit_generator": "PCG64", "state": {"state": int(saved["state"], 16), "inc": int(saved["inc"], 16)},
            "has_uint32": int(saved["has_uint32"]), "uinteger": int(saved["uinteger"])}


__all__ = ["EpochOrder"]
