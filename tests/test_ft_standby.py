"""The warm standby's lock: the active process holds it, a standby waits for it and runs as the next incarnation."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from freescale.ft.standby import hand_back, take_over


def test_standby_waits_for_the_active_one_and_takes_the_next_incarnation(tmp_path: Path) -> None:
    lock = str(tmp_path / "rank0.lock")
    active, incarnation = take_over(lock, 0)
    assert incarnation == 0
    result: dict[str, int] = {}
    standby = threading.Thread(target=lambda: result.update(zip(("fd", "incarnation"), take_over(lock, 0))))
    standby.start()
    standby.join(timeout=0.3)
    assert standby.is_alive(), "the standby must wait while the active process holds the lock"
    os.close(active)  # what the kernel does when the active process dies, however it dies
    standby.join(timeout=5)
    assert result["incarnation"] == 1
    os.close(result["fd"])
    fd, incarnation = take_over(lock, 0)  # the next one after that
    assert incarnation == 2
    hand_back(fd, finished=True)  # it finished the run: a standby that takes the lock now has nothing to do
    with pytest.raises(SystemExit) as ended:
        take_over(lock, 0)
    assert ended.value.code == 0
