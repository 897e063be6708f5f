"""Format 2's decoded row groups, each in a slot of one buffer per column: a batch gathers from one buffer.

A batch of format 2 draws its samples from several row groups at once (about 8 at batch 256 with the default
shuffle window).  Kept apart, every row group costs each column of the batch its own handful of numpy calls and
a concatenation: ~20 per row group, most of the loader's time after the decode itself
(``benchmarks/bench_loader.py``).  Here each cached row group is copied once, as it is decoded, into a slot of a
buffer per column (values; each user's start in them, shifted by the slot's base; user ids; the bad-row mask), so
any set of samples, from any row groups held, is read by one gather per column in one call.

The slots are an LRU over row groups like the cache they replace (``RowGroupFiles``: each row group decoded at
most once while held).  A slot holds up to ``users`` users (the largest row group's) and, per list column, the
largest row group's declared interactions (its users' ``length``): a good user's lists hold exactly its declared
length (the row checks make any other a bad row), and a bad user's lists, of any length, are not copied (its
samples are never read).  Memory: ``count`` times the largest row group, where the cache held its row groups at
their own sizes (the buffers are zeros until written: a slot commits the pages its occupants filled).  ``ensure``
never evicts a row group the same call needs: the caller asks for at most ``count`` row groups at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from freescale.dataloader.gather import gather_tails

LoadedRowGroup = tuple[dict[str, np.ndarray], np.ndarray | None]
"""A decoded row group's numpy buffers (``SequenceSource.arrays_of``: a list column's values and its offsets as
``name@``; the user ids) and its bad-row mask (None: every row good)."""


class UserSlots:
    """``count`` slots of ``users`` users each; list columns ``lists`` of up to ``capacity`` values per slot."""

    def __init__(self, count: int, row_groups: int, users: int, capacity: int, lists: list[str], user_column: str) -> None:
        self.count, self.users, self.lists, self.user_column = max(1, count), max(1, users), lists, user_column
        self.capacity = {name: max(1, capacity) for name in lists}
        self.slot_of = np.full(row_groups, -1, dtype=np.int64)
        """Row group -> the slot holding it, or -1."""
        self._held = np.full(self.count, -1, dtype=np.int64)
        self._used = np.zeros(self.count, dtype=np.int64)
        self._tick = 0
        self.values: dict[str, np.ndarray] = {}
        """Per list column, (slots x capacity[, width]) values (made at the first row group, in its dtype: the
        files' schemas are checked alike)."""
        self.starts = {name: np.zeros(self.count * self.users, dtype=np.int64) for name in lists}
        """Per list column, each (slot, user)'s first value, as a flat index into ``values[name]``."""
        self.user_ids = np.zeros(0, dtype=np.int64)
        self.bad = np.zeros(self.count * self.users, dtype=bool)

    def ensure(self, needed: np.ndarray, load: Callable[[int], LoadedRowGroup]) -> np.ndarray:
        """The slot of each of ``needed`` (distinct row groups, at most ``count``), loading the missing ones into
        the least recently used slots that this call does not need."""
        if needed.size > self.count:
            raise ValueError(f"{needed.size} row groups at once, {self.count} slots")
        self._tick += 1
        held = self.slot_of[needed]
        self._used[held[held >= 0]] = self._tick
        for group in needed[held < 0].tolist():
            slot = int(np.argmin(self._used))  # (free slots have 0; this call's have the current tick)
            if self._held[slot] >= 0:
                self.slot_of[self._held[slot]] = -1
                self._held[slot] = -1  # (a load that fails leaves the slot free)
            arrays, bad = load(group)
            self._put(slot, arrays, bad)
            self._held[slot], self.slot_of[group], self._used[slot] = group, slot, self._tick
        return self.slot_of[needed]

    def forget(self) -> None:
        """Every slot free (its buffers kept: the next loads write over them)."""
        self.slot_of[:] = -1
        self._held[:] = -1
        self._used[:] = 0

    def flat(self, name: str) -> np.ndarray:
        """Column ``name``'s values, every slot's back to back (a view)."""
        values = self.values[name]
        return values.reshape(-1, *values.shape[2:])

    def _put(self, slot: int, arrays: dict[str, np.ndarray], bad: np.ndarray | None) -> None:
        """Row group ``arrays`` into ``slot``: its good users' lists back to back (a bad user's lists, of any
        length, are left out: its samples are never read), each user's start, its ids and its bad-row mask."""
        ids = arrays[self.user_column]
        n = ids.size
        if n > self.users:
            raise ValueError(f"a row group of {n} users, slots of {self.users}")
        first = slot * self.users
        if not self.user_ids.size:
            self.user_ids = np.zeros(self.count * self.users, dtype=ids.dtype)
        self.user_ids[first:first + n] = ids
        self.bad[first:first + n] = False if bad is None else bad
        dropped = bad if bad is not None and bad.any() else None
        for name in self.lists:
            values, offsets = arrays[name], arrays[name + "@"]
            if dropped is not None:
                lengths = np.where(dropped, 0, np.diff(offsets))
                values = gather_tails([(values, offsets[1:], lengths)])
                offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            if values.shape[0] > self.capacity[name]:
                raise ValueError(f"row group of {values.shape[0]} '{name}' values, slots of {self.capacity[name]}")
            if name not in self.values:
                self.values[name] = np.zeros((self.count, self.capacity[name], *values.shape[1:]), dtype=values.dtype)
            self.values[name][slot, :values.shape[0]] = values
            self.starts[name][first:first + n] = offsets[:-1] + slot * self.capacity[name]


__all__ = ["LoadedRowGroup", "UserSlots"]
