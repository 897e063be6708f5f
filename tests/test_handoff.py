"""The prefetch thread's hand-over (``dataloader/handoff.py``): order, the bound, a stop, a failure handed at once."""

from __future__ import annotations

import threading
import time

import pytest

from freescale.dataloader.handoff import Handoff


def test_items_come_in_order_a_put_waits_for_room_and_a_stop_drops_it() -> None:
    handoff: Handoff[int] = Handoff(capacity=10)
    assert handoff.put_all(list(range(8)), lambda: False)
    assert handoff.put_all([], lambda: False) and len(handoff) == 8
    done = threading.Event()

    def produce() -> None:  # 16 > 10: waits until the consumer makes room (woken by it: the poll is 30 s)
        handoff.put_all(list(range(8, 16)), lambda: False, poll_s=30.0)
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(0.2)
    assert not done.is_set() and len(handoff) == 8
    assert [handoff.get() for _ in range(5)] == [0, 1, 2, 3, 4]  # 3 left + 8 > 10: still waiting
    time.sleep(0.2)
    assert not done.is_set()
    assert handoff.get() == 5  # 2 left + 8 fit
    assert done.wait(5)
    producer.join()
    assert [handoff.get() for _ in range(10)] == list(range(6, 16))
    with pytest.raises(TimeoutError):
        handoff.get(timeout=0.05)
    handoff.put_all([100], lambda: False)
    large = threading.Thread(target=lambda: handoff.put_all(list(range(20)), lambda: False, poll_s=30.0))
    large.start()  # larger than the buffer: waits for it to be empty, then goes in whole
    time.sleep(0.2)
    assert large.is_alive() and len(handoff) == 1
    assert handoff.get() == 100
    large.join(5)
    assert not large.is_alive() and len(handoff) == 20
    stop = threading.Event()
    stopped = threading.Thread(target=lambda: stop.set() if not handoff.put_all([99], stop.is_set) else None)
    stop_later = threading.Timer(0.1, stop.set)
    stop_later.start()
    stopped.start()
    stopped.join(5)
    assert not stopped.is_alive() and len(handoff) == 20  # stopped while waiting: nothing appended
    handoff.put_now(-1)  # a failure goes in whatever the buffer holds
    assert len(handoff) == 21
    handoff.clear()
    assert len(handoff) == 0
