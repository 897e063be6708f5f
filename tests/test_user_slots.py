"""Format 2's row-group slots (``dataloader/user_slots.py``): LRU over row groups, growth, one gather for many."""

from __future__ import annotations

import numpy as np
import pytest

from freescale.dataloader.user_slots import UserSlots


def _row_group(group: int, lengths: list[int]) -> tuple[dict[str, np.ndarray], None]:
    """Users ``100 * group + u`` with lists of ``lengths``; value ``1000 * group + i`` at flat index i."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = 1000 * group + np.arange(offsets[-1], dtype=np.int64)
    return {"user_id": 100 * group + np.arange(len(lengths), dtype=np.int64), "items": values,
            "items@": offsets}, None


def test_slots_hold_the_least_recently_used_row_groups_and_gather_many_at_once() -> None:
    lengths = {0: [2, 3], 1: [1, 1, 4], 2: [5], 3: [2, 2, 2]}
    loads: list[int] = []

    def load(group: int) -> tuple[dict[str, np.ndarray], None]:
        loads.append(group)
        return _row_group(group, lengths[group])

    slots = UserSlots(count=2, row_groups=4, users=3, capacity=6, lists=["items"], user_column="user_id")

    def value(group: int, user: int, position: int) -> int:
        slot = int(slots.ensure(np.array([group]), load)[0])
        return int(slots.flat("items")[slots.starts["items"][slot * slots.users + user] + position])

    assert value(0, 1, 2) == 1000 * 0 + 2 + 2 and value(1, 2, 3) == 1000 + 2 + 3
    assert slots.user_ids[slots.slot_of[1] * slots.users + 2] == 102
    assert value(0, 0, 1) == 1 and loads == [0, 1]  # held: not loaded again
    assert value(3, 2, 1) == 3000 + 4 + 1 and loads == [0, 1, 3]  # evicts 1, the least recently used
    assert slots.slot_of[1] == -1 and slots.slot_of[0] >= 0
    assert value(2, 0, 4) == 2004 and loads == [0, 1, 3, 2]  # evicts 0
    both = slots.ensure(np.array([2, 3]), load)  # one gather over two row groups
    rows = both * slots.users + np.array([0, 2])
    assert slots.flat("items")[slots.starts["items"][rows] + np.array([3, 1])].tolist() == [2003, 3005]
    with pytest.raises(ValueError, match="3 row groups at once, 2 slots"):
        slots.ensure(np.array([0, 1, 2]), load)


def test_a_bad_users_lists_are_left_out_and_a_failed_load_leaves_the_slot_free() -> None:
    """A bad user's lists (of any length) are not copied: the good users' values still fit the slot sized from
    the declared lengths, each at its own start.  A load that raises frees its slot for the next."""
    slots = UserSlots(count=1, row_groups=3, users=3, capacity=5, lists=["items"], user_column="user_id")
    arrays, _ = _row_group(0, [2, 9, 3])  # user 1's list is far longer than any slot holds
    slots.ensure(np.array([0]), lambda g: (arrays, np.array([False, True, False])))
    starts = slots.starts["items"][[0, 2]]
    assert slots.flat("items")[starts].tolist() == [0, 11] and slots.bad[:3].tolist() == [False, True, False]

    def broken(group: int) -> tuple[dict[str, np.ndarray], None]:
        raise OSError("corrupt")

    with pytest.raises(OSError):
        slots.ensure(np.array([1]), broken)
    assert slots.slot_of.tolist() == [-1, -1, -1]
    slots.ensure(np.array([2]), lambda g: _row_group(2, [1]))
    assert slots.slot_of.tolist() == [-1, -1, 0]

