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


def test_slots_hold_the_least_recently_used_row_groups_and_grow_without_moving_any_value() -> None:
    lengths = {0: [2, 3], 1: [1, 1, 4], 2: [5], 3: [2, 2, 2]}
    loads: list[int] = []

    def load(group: int) -> tuple[dict[str, np.ndarray], None]:
        loads.append(group)
        return _row_group(group, lengths[group])

    slots = UserSlots(count=2, row_groups=4, users=3, capacity=5, lists=["items"], user_column="user_id")

    def value(group: int, user: int, position: int) -> int:
        slot = int(slots.ensure(np.array([group]), load)[0])
        return int(slots.flat("items")[slots.starts["items"][slot * slots.users + user] + position])

    assert value(0, 1, 2) == 1000 * 0 + 2 + 2 and value(1, 2, 3) == 1000 + 2 + 3
    assert slots.user_ids[slots.slot_of[1] * slots.users + 2] == 102
    assert value(0, 0, 1) == 1 and loads == [0, 1]  # held: not loaded again
    assert value(3, 2, 1) == 3000 + 4 + 1 and loads == [0, 1, 3]  # evicts 1, the least recently used
    assert slots.slot_of[1] == -1 and slots.slot_of[0] >= 0
    lengths[2] = [9]  # past the 5 values a slot holds: every slot grows, row group 3's values stay where they were
    assert value(2, 0, 8) == 2008 and slots.capacity["items"] >= 9
    assert value(3, 1, 0) == 3002 and loads == [0, 1, 3, 2]
    both = slots.ensure(np.array([2, 3]), load)  # one gather over two row groups
    rows = both * slots.users + np.array([0, 2])
    assert slots.flat("items")[slots.starts["items"][rows] + np.array([3, 1])].tolist() == [2003, 3005]
    with pytest.raises(ValueError, match="3 row groups at once, 2 slots"):
        slots.ensure(np.array([0, 1, 2]), load)
