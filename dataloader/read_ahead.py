"""Row groups read and decoded ahead of the reads, on a thread of their own.

The loader's prefetch thread plans a few steps, reads their rows and builds their batches, one after the other;
each row group its reads draw on for the first time is read and decoded right there (the Parquet decode: ~20% of
a format-2 epoch's time on one core; on a remote filesystem it also waits for the bytes).  ``ReadAhead`` takes
that off the prefetch thread's path::

    prefetch thread:  plan(k)  at(k)  read(k): take each row group it needs, check it  build(k)   plan(k+1) ...
    read-ahead:                   read + decode the row groups of steps k, k+1, ... in the order first needed

The thread makes one call a row group (``RowGroupFiles.read_table``: pyarrow reads and decodes without the GIL),
so it overlaps the prefetch thread's Python; the row checks and the numpy buffers stay on the prefetch thread (a
few dozen short calls holding the GIL: on this thread they contended with the prefetch thread's Python for it and
gained nothing, measured: docs/data.md).  The epoch's rows in planning order (``BatchPlanner.epoch_rows``: global
batch ``s`` is rows ``[s*G, (s+1)*G)``) say which row groups each coming step draws on, whatever rank plans which
of its rows, so the schedule needs no plan; a rank of many may decode a row group its share of a step happens not
to need (at a few hundred samples a rank a step, drawn from the shuffle window's row groups, it almost always does).
The next epoch's schedule (its shuffled rows and the pass over them, ~3.5 ms for 317k rows: 3 us a step of 256
were it made by the prefetch thread at the epoch's end) is made on this thread once the reads are halfway through
this epoch, when it has nothing to decode, and its row groups follow this epoch's.  An epoch whose order is not whole
at its first read (a fresh or resumed loader's: ``EpochOrder`` makes it a window at a time, as far as the plans need
it) is primed instead (``prime``): each read's shuffle windows' row groups, and the next window's, known from the row
groups' shuffle alone, decoded while the plans make their windows; with none to decode, this thread makes the rest
of the order a window at a time, and the first read after it is whole installs the epoch's schedule.

Nothing the source keeps changes on this thread: it reads through file handles of its own; the read that takes a
row group (``take``, under the source's read lock) checks and counts it as it would have decoded it, so the counts
and every error are what reading without it gives, at the same step: a read's error (a corrupt file) is kept and
raised by the read that needs that row group (never if no read does).  At most ``depth`` row groups wait decoded
and not yet taken (memory: ``depth`` Arrow tables of the columns the reads and their checks decode); those the
schedule no longer reaches (a restart elsewhere, steps that did not need them) are dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numba
import numpy as np

Decoded = TypeVar("Decoded")
log = logging.getLogger("freescale.dataloader")


CLOSE_WAIT_S = 10.0
"""How long ``close`` waits for the read in flight."""


class _Failed:
    """A decode's error, kept for the read that takes its row group."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Schedule:
    """An epoch's row groups in the order its steps first need them (``groups``), with that step (``first_steps``)."""

    def __init__(self, epoch: int, rows: np.ndarray, group_of: np.ndarray, step_rows: int) -> None:
        self.epoch = epoch
        groups, first_rows = _first_needed(np.ascontiguousarray(rows, dtype=np.int64), group_of)
        self.groups: list[int] = groups.tolist()
        self.first_steps = first_rows // step_rows
        self.exact = True
        """False for ``primed``'s: the row groups a read at ``step`` starts with, before the epoch's order exists."""

    @classmethod
    def primed(cls, epoch: int, step: int, groups: list[int]) -> _Schedule:
        """``groups``, all first needed at ``step``: what ``ReadAhead.prime`` decodes until ``at`` brings the
        epoch's schedule."""
        schedule = cls.__new__(cls)
        schedule.epoch, schedule.groups, schedule.exact = epoch, list(groups), False
        schedule.first_steps = np.full(len(groups), step, dtype=np.int64)
        return schedule

    def position(self, step: int) -> int:
        """The index of the first row group first needed at ``step`` or later."""
        return int(np.searchsorted(self.first_steps, step, side="left"))


class ReadAhead(Generic[Decoded]):
    """``decode(row_group)`` of the row groups the reads from ``at``'s step on will need, in that order (or, while the
    epoch's order is made, ``prime``'s, and with none to decode the order made on), while fewer than ``depth`` wait
    to be taken.

    ``starts``: each row group's first row (and the total at the end); ``step_rows``: rows a step plans (the global
    batch); ``held(row_group)``: whether the source already holds it decoded (checked without its lock: a wrong
    answer costs a decode, nothing else)."""

    def __init__(self, decode: Callable[[int], Decoded], starts: np.ndarray, step_rows: int, depth: int,
                 held: Callable[[int], bool]) -> None:
        if depth < 1 or step_rows < 1:
            raise ValueError(f"read-ahead of depth {depth} over steps of {step_rows} rows: both must be >= 1")
        self._decode, self._held = decode, held
        starts = np.asarray(starts, dtype=np.int64)
        groups = starts.size - 1
        self._group_of = np.repeat(np.arange(groups, dtype=np.int16 if groups < 2**15 else np.int32), np.diff(starts))
        """Each row's row group (2 bytes a row, 4 past 32,767 row groups; made once: the schedule's pass looks each
        row's up, 0.3 against 4.4 ms by a binary search for an epoch of 317k rows)."""
        self._step_rows, self.depth = step_rows, depth
        self._changed = threading.Condition()
        self._step = 0
        self._schedules: list[_Schedule] = []
        """This epoch's schedule and, once the thread made it (``_follow``), the next's."""
        self._order: list[int] = []
        """The row groups to decode, in order: this epoch's schedule, then the next's."""
        self._this_epoch = 0
        """How many of ``_order`` are this epoch's."""
        self._position: dict[int, int] = {}
        """A row group's place in this epoch's part of ``_order``."""
        self._next = 0
        """The place in ``_order`` the thread decodes next."""
        self._reached = 0
        """One past the furthest place a read took, or ``at`` said the reads are at."""
        self._ready: dict[int, Decoded | _Failed] = {}
        self._in_flight: int | None = None
        self._taken: set[int] = set()
        """Row groups a read took (or decoded itself) in this epoch: not decoded ahead again in it."""
        self._for_next: set[int] = set()
        """Row groups decoded for the next epoch (not stale when this epoch's reads pass them by)."""
        self._installs = 0
        """Schedules installed so far: a decode picked under an older one is not the next epoch's any more."""
        self._failed_epoch: int | None = None
        """An epoch whose rows could not be made on the thread (not tried there again: its reads meet the error)."""
        self._waiting = False
        """The thread waits for room (``depth`` ready) or for a schedule: the one thing that wakes it."""
        self._rows_of: Callable[[int], np.ndarray] = lambda epoch: np.zeros(0, dtype=np.int64)
        """An epoch's rows (``at``'s)."""
        self._more = False
        """An epoch follows the reads' (``at``'s): the thread makes its schedule."""
        self._advance: Callable[[], bool] | None = None
        """Makes the next window of a primed epoch's order (``prime``); None once it is whole."""
        self._advancing: int | None = None
        """The epoch ``_advance`` was armed for (not armed again for it)."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self.decoded = 0
        """Row groups read on this thread so far (taken or not)."""
        self.handed = 0
        """Row groups a read took from it (read ahead, not by the read itself)."""

    def at(self, epoch: int, step: int, rows_of: Callable[[int], np.ndarray], more: bool = False) -> None:
        """Reads now start at step ``step`` of epoch ``epoch``; ``rows_of(epoch)``: an epoch's rows in planning order
        (asked once an epoch); ``more``: an epoch follows this one.  This epoch's schedule is made here when it is
        new (one compiled pass over its rows); the next epoch's on the thread once the reads are halfway through this
        one and it has nothing to decode (its rows, an epoch's shuffle, and that pass: ~3.5 ms an epoch of 317k
        rows, off the reading thread), its row groups decoded after this epoch's."""
        with self._changed:
            known, now_more = self._schedules, more and not self._more
            self._rows_of, self._more = rows_of, more
            going_on = known[:1] != [] and known[0].epoch == epoch and known[0].exact and step >= self._step
            if going_on:
                self._step, reached = step, self._schedules[0].position(step)
                stale = [g for g in self._ready
                         if self._position.get(g, reached) < reached and g not in self._for_next]
                for group in stale:  # (the reads of the steps that first need it did not: not this rank's, as a rule)
                    del self._ready[group]
                self._reached = max(self._reached, reached)
                self._next = max(self._next, self._reached)
                if stale or now_more or self._to_follow() is not None:
                    self._wake()
        if not going_on:
            made = _has(known, epoch) or _Schedule(epoch, rows_of(epoch), self._group_of, self._step_rows)
            with self._changed:
                self._step = step
                self._install(made, step)
                self._wake()
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closed = False
            self._thread = threading.Thread(target=self._run, name="freescale-read-ahead", daemon=True)
            self._thread.start()

    def prime(self, epoch: int, step: int, groups: list[int], advance: Callable[[], bool]) -> None:
        """A read at step ``step`` of epoch ``epoch``, whose order (and so its schedule) is not made whole yet: decode
        ``groups`` (the row groups of its shuffle windows and the next, ``EpochOrder.groups_of_rows``) on the
        thread, and when it has none to decode, make the order on, ``advance()`` a window at a time (False once it is
        whole: the next read's ``at`` then installs the epoch's schedule, keeping what was decoded).  A fresh loader's
        first read waits for its window's order and its row groups (~0.3 ms, and decodes on both threads), not for
        the whole epoch's order then its row groups (~4 ms, then ~3).  Nothing if the epoch's schedule is known."""
        with self._changed:
            known = self._schedules[:1]
            arm = self._advancing != epoch and self._failed_epoch != epoch
            if arm:
                self._advance, self._advancing = advance, epoch
            if _has(self._schedules, epoch) is not None or (
                    known and known[0].epoch == epoch and known[0].groups == groups):
                if arm:
                    self._wake()
                return
            self._step = step
            self._install(_Schedule.primed(epoch, step, groups), step)
            self._wake()
        self._ensure_thread()

    def take(self, row_group: int) -> Decoded | None:
        """Row group ``row_group`` if it was decoded ahead (waiting for it while it is being decoded), else None
        (the caller decodes it); a decode's error is raised here."""
        with self._changed:
            while self._in_flight == row_group:
                self._changed.wait()
            self._taken.add(row_group)
            entry = self._ready.pop(row_group, None)
            self.handed += entry is not None
            position = self._position.get(row_group)
            if position is not None:
                self._reached = max(self._reached, position + 1)
            if entry is not None:
                self._wake()
        if isinstance(entry, _Failed):
            raise entry.exc
        return entry

    def close(self) -> None:
        """Stop the thread (after the read in flight, waiting for it up to ``CLOSE_WAIT_S``: a remote read that
        hangs is left to its daemon thread) and drop what was read (the next ``at`` starts again)."""
        self.stop()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
            self._thread = None
        with self._changed:
            self._ready.clear()
            self._for_next.clear()
            self._advance = self._advancing = None
            self._schedules, self._order = [], []
            self._taken.clear()

    def stop(self) -> None:
        """Tell the thread to end after the read in flight, without waiting for it (a loader's finalizer)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _wake(self) -> None:
        """Wake the thread if it waits (only then: a wake costs the reading thread a hand-over of the GIL)."""
        if self._waiting:
            self._changed.notify()

    # ----- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        """The thread: the next row group of the schedule read and decoded (one pyarrow call, without the GIL) while
        the reading thread builds batches; a read waiting for it in ``take`` is woken when it is done.  When it has
        nothing to decode: a primed epoch's order made on, a window at a time (``_advanced``); the next epoch's
        schedule made, once (``_follow``)."""
        try:
            while True:
                with self._changed:
                    group, following, advance = self._pick(), self._to_follow(), self._ordering()
                    while group is None and following is None and advance is None and not self._closed:
                        self._waiting = True
                        self._changed.wait()
                        self._waiting = False
                        group, following, advance = self._pick(), self._to_follow(), self._ordering()
                    if self._closed:
                        return
                    next_epochs, rows_of, installs = self._next > self._this_epoch, self._rows_of, self._installs
                if group is None:  # (then ``following`` or ``advance`` is not)
                    if following is not None:
                        self._follow(following, rows_of)
                    elif advance is not None:
                        self._advanced(advance)
                    continue
                try:
                    entry: Decoded | _Failed = self._decode(group)
                except Exception as exc:  # (raised by the read that takes it)
                    entry = _Failed(exc)
                with self._changed:
                    self._in_flight = None
                    self.decoded += 1
                    if next_epochs or group not in self._taken:  # (else a read that came first decoded it itself)
                        self._ready[group] = entry
                        if next_epochs and installs == self._installs:  # (else it is this epoch's now)
                            self._for_next.add(group)
                    self._changed.notify_all()
        finally:  # (however it ends, no read waits for a decode it will not finish: the read decodes it)
            with self._changed:
                self._in_flight = None
                self._changed.notify_all()

    def _advanced(self, advance: Callable[[], bool]) -> None:
        """``advance()`` called: once the order is whole, or if making it failed (the plans, making it themselves,
        meet the error: not tried here again in that epoch), not called again."""
        with self._changed:
            epoch = self._advancing
        try:
            more = advance()
        except Exception:
            log.exception("the read-ahead could not make epoch %s's order on (the reads meet the error themselves)",
                          epoch)
            more = False
            with self._changed:
                self._failed_epoch = epoch
        if not more:
            with self._changed:
                if self._advance is advance:
                    self._advance = None

    def _ordering(self) -> Callable[[], bool] | None:
        """``prime``'s ``advance`` while the schedule is primed (its epoch's order not whole).  With ``_changed``
        held."""
        primed = self._schedules and not self._schedules[0].exact and self._schedules[0].epoch == self._advancing
        return self._advance if primed else None

    def _to_follow(self) -> int | None:
        """The epoch whose schedule the thread makes next: the one after this, once the reads are halfway through
        this one (not at its start, where the reads wait for their first row groups: measured, docs/data.md) and the
        thread has nothing to decode now (this epoch's row groups all taken up, or ``depth`` of them ready), none
        following yet.  With ``_changed`` held."""
        if not self._more or len(self._schedules) != 1 or not self._schedules[0].exact or (
                2 * self._reached < self._this_epoch) or (
                self._next < len(self._order) and len(self._ready) < self.depth) or (
                self._failed_epoch == self._schedules[0].epoch + 1):
            return None
        return self._schedules[0].epoch + 1

    def _follow(self, epoch: int, rows_of: Callable[[int], np.ndarray]) -> None:
        """Epoch ``epoch``'s schedule made (outside the lock: its rows and one compiled pass, mostly without the
        GIL) and appended to this epoch's, unless the reads moved meanwhile.  If its rows cannot be made, nothing
        is read ahead into it (the reads ask for them themselves and meet the error there)."""
        try:
            made: _Schedule | None = _Schedule(epoch, rows_of(epoch), self._group_of, self._step_rows)
        except Exception:
            made = None
        with self._changed:
            if len(self._schedules) != 1 or self._schedules[0].epoch != epoch - 1:
                return  # (a new schedule was installed meanwhile)
            if made is None:
                self._failed_epoch = epoch
                return
            self._schedules = [self._schedules[0], made]
            self._order = self._order + made.groups

    def _install(self, schedule: _Schedule, step: int) -> None:
        """``schedule`` (an epoch's) followed from ``step`` on.  With ``_changed`` held."""
        if not self._schedules or schedule.epoch != self._schedules[0].epoch:  # (a primed one's taken are kept)
            self._taken.clear()
        self._schedules = [schedule]
        self._order = list(schedule.groups)
        self._this_epoch = len(schedule.groups)
        self._position = {group: i for i, group in enumerate(schedule.groups)}
        self._next = self._reached = schedule.position(step)
        self._for_next.clear()
        self._installs += 1
        coming = set(self._order[self._next:])
        for group in [g for g in self._ready if g not in coming]:  # (the reads moved elsewhere)
            del self._ready[group]

    def _pick(self) -> int | None:
        """The next row group of ``_order`` to decode (neither ready, held, nor taken if this epoch's), while fewer
        than ``depth`` wait ready; marked in flight.  With ``_changed`` held."""
        while self._next < len(self._order) and len(self._ready) < self.depth:
            group = self._order[self._next]
            self._next += 1
            if group in self._ready or (self._next <= self._this_epoch and group in self._taken) or self._held(group):
                continue
            self._in_flight = group
            return group
        return None


def _has(schedules: list[_Schedule], epoch: int) -> _Schedule | None:
    """Epoch ``epoch``'s schedule among ``schedules``, if made already (not merely primed)."""
    return next((schedule for schedule in schedules if schedule.epoch == epoch and schedule.exact), None)


@numba.njit(nogil=True, cache=True)
def _first_needed(rows: np.ndarray, group_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row groups of ``rows`` (``group_of``: each row's) in the order they first appear, and where.  One pass."""
    count = int(group_of[-1]) + 1 if group_of.size else 0
    seen = np.zeros(count, dtype=np.bool_)
    groups, first = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
    found = 0
    for i in range(rows.size):
        group = group_of[rows[i]]
        if not seen[group]:
            seen[group] = True
            groups[found], first[found] = group, i
            found += 1
            if found == count:
                break
    return groups[:found], first[:found]


def warm_up() -> None:
    """Compile (or load from numba's cache) ``_first_needed`` before any thread."""
    for group_dtype in (np.int16, np.int32):
        _first_needed(np.array([1, 0], dtype=np.int64), np.array([0, 1], dtype=group_dtype))


__all__ = ["ReadAhead", "warm_up"]
