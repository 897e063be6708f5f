"""The batch planner (``dataloader/planner.py``): the same plan on every rank, through live-rank changes, resumes,
windows, read locality, rank speeds, and several steps planned at once."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.dataloader import planner as planner_module
from freescale.dataloader.cost import CostModel
from freescale.dataloader.epoch_order import EpochOrder
from freescale.dataloader.partition import lpt_steps
from freescale.dataloader.planner import BatchPlanner
from freescale.dataloader.schema import DataError


def make_planner(lengths: np.ndarray, window: int, seed: int = 0, locality: bool = False,
                 batch: int = 64) -> BatchPlanner:
    order = EpochOrder(np.full(lengths.size // 100, 100), seed=seed, shuffle=True, window_row_groups=3)
    return BatchPlanner(lengths, order, cost_model=CostModel(1e-3, 1.0, 1.0), partitioner="lpt",
                        global_batch_size=batch, window=window, locality=locality)


def test_a_read_local_window_gives_each_rank_one_run_of_storage_at_balanced_cost() -> None:
    rng = np.random.default_rng(4)
    lengths = np.clip(np.rint(19.1 + 43.2 * rng.lognormal(0, 1.608, 64 * 160)), 1, 256).astype(np.int64)
    ranks, window = 8, 16
    planner = make_planner(lengths, window, locality=True, batch=512)
    plans = [planner.plan(0, s, tuple(range(ranks))) for s in range(window)]
    window_rows = np.sort(np.concatenate([np.concatenate(p.rows) for p in plans]))
    assert window_rows.size == len(set(window_rows.tolist())) == window * 512
    costs = planner.costs(planner.cost_model, window_rows)
    per_rank = [np.sort(np.concatenate([p.rows[r] for p in plans])) for r in range(ranks)]
    groups = [np.unique(np.searchsorted(planner.order.starts, rows, side="right") - 1) for rows in per_rank]
    present = np.unique(np.searchsorted(planner.order.starts, window_rows, side="right") - 1)
    for r, mine in enumerate(groups):  # one run of the window's row groups, shared with a neighbour at its ends only
        lo = int(np.searchsorted(present, mine[0]))
        assert np.array_equal(mine, present[lo:lo + mine.size])
        if r:
            assert groups[r - 1][-1] <= mine[0]
    totals = np.array([planner.costs(planner.cost_model, rows).sum() for rows in per_rank])
    assert totals.max() - totals.min() <= 2 * costs.max()  # each cut within half a sample of its share
    assert max(p.imbalance() for p in plans) < 1.06  # each rank's run split into steps by LPT
    locality_off = make_planner(lengths, window, batch=512)
    spread = [np.concatenate([locality_off.plan(0, s, tuple(range(ranks))).rows[0] for s in range(window)])]
    spread_groups = np.unique(np.searchsorted(planner.order.starts, spread[0], side="right") - 1)
    assert spread_groups.size > 4 * groups[0].size  # without it, rank 0 draws on the whole window


@pytest.mark.parametrize("window", [1, 4])
def test_planner_exactly_once_with_live_rank_changes(window: int) -> None:
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.zipf(1.2, 2000), 1, 1024)
    planner = make_planner(lengths, window)
    live_by_step = {0: (0, 1, 2, 3), 5: (0, 2, 3), 6: (0, 1, 2, 3, 4), 13: (1, 2)}
    live, seen = (0, 1, 2, 3), []
    for step in range(planner.steps_per_epoch):
        live = live_by_step.get(step, live)
        plan = planner.plan(0, step, live)
        assert plan.live_ranks == live
        seen.extend(np.concatenate(plan.rows).tolist())
    assert len(seen) == len(set(seen)) == planner.steps_per_epoch * 64
    epoch1 = np.concatenate(planner.plan(1, 0, live).rows)
    assert not np.array_equal(np.sort(epoch1), np.sort(np.concatenate(make_planner(lengths, window).plan(0, 0, live).rows)))


def test_planner_resumes_mid_window_identically() -> None:
    lengths = np.clip(np.random.default_rng(2).zipf(1.1, 3000), 1, 2048)
    straight = make_planner(lengths, 8)
    a = [straight.plan(0, s, (0, 1, 2) if s < 3 else (0, 2)) for s in range(6)]
    first = make_planner(lengths, 8)
    for s in range(4):
        first.plan(0, s, (0, 1, 2) if s < 3 else (0, 2))
    resumed = make_planner(lengths, 8)
    resumed.load_window_state(first.window_state(0, 4))
    for s in (4, 5):
        got = resumed.plan(0, s, (0, 2))
        assert all(np.array_equal(x, y) for x, y in zip(got.rows, a[s].rows))


def test_window_groups_heavy_samples_and_shortens_the_epoch() -> None:
    rng = np.random.default_rng(3)
    lengths = np.clip(np.rint(19.1 + 43.2 * rng.lognormal(0, 1.608, 64 * 200)), 1, 4096).astype(np.int64)
    total_time = {}
    for window in (1, 16):
        planner = make_planner(lengths, window)
        steps = [planner.plan(0, s, tuple(range(8))) for s in range(planner.steps_per_epoch)]
        total_time[window] = sum(p.loads().max() for p in steps)  # every step lasts as long as its slowest rank
        assert sum(p.global_size for p in steps) == planner.steps_per_epoch * 64
    assert total_time[16] < 0.95 * total_time[1], total_time


@settings(max_examples=25, deadline=None)
@given(window=st.sampled_from([1, 4]), seed=st.integers(0, 2**16),
       changes=st.lists(st.tuples(st.integers(0, 25), st.integers(0, 4), st.floats(0.1, 4.0)), max_size=6),
       requeue_at=st.integers(1, 25))
def test_planner_with_capacities_changing_between_steps_trains_every_sample_once_and_alike(
        window: int, seed: int, changes: list[tuple[int, int, float]], requeue_at: int) -> None:
    """Ranks' speeds set at drawn steps (one rank slower or faster each time; live ranks changing and rows
    requeued too): every sample of the epoch is planned exactly once, and two planners given the same calls
    plan the same steps."""
    lengths = np.clip(np.random.default_rng(seed).zipf(1.2, 2000), 1, 1024)
    planners = [make_planner(lengths, window, seed=seed) for _ in range(2)]
    live_by_step = {0: (0, 1, 2, 3), 7: (0, 2, 3), 9: (0, 1, 2, 3, 4)}
    speeds: dict[int, float] = {}
    live, seen = (0, 1, 2, 3), []
    for step in range(planners[0].steps_per_epoch):
        live = live_by_step.get(step, live)
        for at, rank, speed in changes:
            if at == step:
                speeds[rank] = speed
                for planner in planners:
                    planner.set_capacities(dict(speeds), 0, step)
        plans = [planner.plan(0, step, live) for planner in planners]
        assert np.array_equal(plans[0].rows.index, plans[1].rows.index)
        assert np.array_equal(plans[0].rows.offsets, plans[1].rows.offsets)
        assert plans[0].imbalance() >= plans[0].bound() - 1e-9
        if step == requeue_at and plans[0].rows.index.size > 3:
            lost = plans[0].rows[0]  # rank 0's share was not trained: carried into the next step
            for planner in planners:
                planner.requeue(0, step + 1, lost)
            seen.extend(np.concatenate([plans[0].rows[i] for i in range(1, len(live))]).tolist())
        else:
            seen.extend(plans[0].rows.index.tolist())
    assert sorted(seen) == sorted(set(seen)) and len(seen) == planners[0].steps_per_epoch * 64


def test_a_slow_rank_gets_its_share_from_the_step_named_and_the_state_carries_it() -> None:
    lengths = np.clip(np.random.default_rng(7).zipf(1.2, 4000), 1, 1024)
    planner = make_planner(lengths, 1, batch=256)
    ranks = (0, 1, 2, 3)
    before = planner.plan(0, 0, ranks)
    planner.set_capacities({2: 0.5}, 0, 1)
    after = planner.plan(0, 1, ranks)
    share = after.loads() / after.loads().sum()
    assert abs(share[2] - 0.5 / 3.5) < 0.02 and before.capacities is None
    assert after.capacities is not None and after.imbalance() < 1.05
    planner.set_capacities({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, 0, 2)  # all alike again: the plain plan
    plain = make_planner(lengths, 1, batch=256).plan(0, 2, ranks)
    assert np.array_equal(planner.plan(0, 2, ranks).rows.index, plain.rows.index)
    with pytest.raises(ValueError, match="capacities: rank 1 has speed 0.0"):
        planner.set_capacities({1: 0.0}, 0, 3)
    window = make_planner(lengths, 4, batch=256)
    window.set_capacities({3: 0.25}, 0, 0)
    plans = [window.plan(0, s, ranks) for s in range(4)]
    state = window.window_state(0, 2)
    assert state["capacities"] == [[3, 0.25]]
    resumed = make_planner(lengths, 4, batch=256)
    resumed.load_window_state(state)
    for s in (2, 3):
        assert np.array_equal(resumed.plan(0, s, ranks).rows.index, plans[s].rows.index)
    total = sum(p.loads() for p in plans)
    assert abs(total[3] / total.sum() - 0.25 / 3.25) < 0.02  # over the window, in proportion


@pytest.mark.parametrize("equal_count", [False, True])
def test_steps_planned_together_equal_steps_planned_one_at_a_time(equal_count: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan_steps`` (the prefetching loader's) against ``plan``: across live-rank changes, a carry, a new cost
    model and ranks of other speeds from a step on (those windows planned one by one)."""
    together_calls: list[int] = []
    monkeypatch.setattr(planner_module, "lpt_steps", lambda costs, steps, *args: together_calls.append(steps) or
                        lpt_steps(costs, steps, *args))
    rng = np.random.default_rng(5)
    lengths = np.clip(np.rint(rng.lognormal(3, 1.2, 3_000)), 1, 300).astype(np.int64)
    planners = []
    for _ in range(2):
        order = EpochOrder(np.full(30, 100), seed=3, shuffle=True, window_row_groups=3)
        planner = BatchPlanner(lengths, order, cost_model=CostModel(1e-3, 1.0, 1.0), partitioner="lpt",
                               global_batch_size=48, equal_count=equal_count)
        planner.windows_kept = 64
        planner.requeue(0, 9, np.array([5, 17, 230]))
        planner.set_cost_model(CostModel(2e-3, 1.0, 0.5), 0, 20)
        planner.set_capacities({1: 2.0}, 0, 40)
        planners.append(planner)
    one, together = planners
    plans = []
    for first, count, ranks in [(0, 8, (0, 1, 2)), (8, 8, (0, 1, 2)), (16, 8, (0, 2)), (24, 8, (0, 1, 2, 3)),
                                (32, 8, (0, 1, 2)), (40, 8, (0, 1, 2)), (48, 6, (1, 2))]:
        plans += together.plan_steps(0, first, count, ranks)
        for step, plan in zip(range(first, first + count), plans[-count:]):
            alone = one.plan(0, step, ranks)
            assert plan.live_ranks == alone.live_ranks and plan.carried == alone.carried and plan.model == alone.model
            assert np.array_equal(plan.rows.index, alone.rows.index) and np.array_equal(plan.rows.offsets, alone.rows.offsets)
            assert np.array_equal(plan.costs.index, alone.costs.index)
    assert together_calls == [8, 8, 8, 8]  # (not 16-23: a new model at 20; not from 40: ranks of other speeds)
    assert sorted(np.concatenate([p.rows.index for p in plans]).tolist()) == sorted(
        np.concatenate([one.epoch_rows(0)[:54 * 48], [5, 17, 230]]).tolist())


def test_the_last_steps_of_an_epoch_planned_together_equal_them_planned_alone() -> None:
    """``plan_steps`` to the epoch's last step, with the planner's own count of windows kept; past it, refused."""
    lengths = np.clip(np.rint(np.random.default_rng(2).lognormal(3, 1.0, 1_000)), 1, 200).astype(np.int64)
    one, together = (BatchPlanner(lengths, EpochOrder(np.full(10, 100), seed=1, shuffle=True, window_row_groups=2),
                                  cost_model=CostModel(1e-3, 1.0, 1.0), partitioner="lpt", global_batch_size=64)
                     for _ in range(2))
    last = together.steps_in(0)
    for plan, step in zip(together.plan_steps(0, last - 6, 6, (0, 1, 2)), range(last - 6, last), strict=True):
        alone = one.plan(0, step, (0, 1, 2))
        assert np.array_equal(plan.rows.index, alone.rows.index) and np.array_equal(plan.rows.offsets, alone.rows.offsets)
    with pytest.raises(IndexError, match="outside the epoch"):
        together.plan_steps(0, last - 2, 3, (0, 1, 2))


def test_the_epoch_order_is_made_once_per_epoch_and_one_epoch_made_does_not_hold_up_another() -> None:
    import threading
    import time

    made: list[int] = []
    release = threading.Event()

    class SlowOrder(EpochOrder):
        def _make(self, epoch: int, progress: Any, first: int, end: int, windows: int | None = None) -> None:
            made.append(epoch)
            if epoch == 1:  # (the read-ahead thread making the next epoch's)
                assert release.wait(10)
            super()._make(epoch, progress, first, end, windows)

    order = SlowOrder(np.full(12, 50), seed=4, shuffle=True, window_row_groups=3)
    first = order(0)
    results: list[np.ndarray] = []
    makers = [threading.Thread(target=lambda: results.append(order(1))) for _ in range(2)]
    for thread in makers:
        thread.start()
    deadline = time.monotonic() + 10
    while made != [0, 1]:  # (one maker inside epoch 1's order, held there)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert order(0) is first  # (epoch 1 is being made meanwhile: epoch 0's is taken without waiting)
    release.set()
    for thread in makers:
        thread.join(10)
    assert made == [0, 1] and results[0] is results[1]  # (made once, the second asker waited for it)
    reference = EpochOrder(np.full(12, 50), seed=4, shuffle=True, window_row_groups=3)
    assert np.array_equal(results[0], reference(1)) and np.array_equal(first, reference(0))
    assert sorted(first.tolist()) == list(range(600)) and not np.array_equal(first, results[0])
    order(2)  # (two epochs kept: the oldest dropped, made again when asked)
    assert order(0) is not first and np.array_equal(order(0), first)
    # Made a window at a time as far as asked: the first rows usable before the rest is shuffled, the rest made by
    # ``advance`` (or the next ask), the same order in the end.
    partial = EpochOrder(np.full(12, 50), seed=4, shuffle=True, window_row_groups=3)
    head = partial.rows_until(2, 120)
    assert np.array_equal(head[:150], reference(2)[:150]) and not partial.complete(2)  # (one window: 150 rows)
    assert partial.groups_of_rows(2, 0, 120) == EpochOrder.groups(partial, 2)[:6].tolist()  # (its window, the next)
    steps = 0
    while partial.advance(2):
        steps += 1
    assert steps == 2 and partial.complete(2) and partial(2) is head and np.array_equal(head, reference(2))
    # The order is the one the earlier code made (windows indexed by a permutation, not shuffled in place): runs
    # resumed from older saves read the same rows.
    for epoch in range(3):
        assert np.array_equal(earlier_order([50] * 12, 4, epoch, 3, True), reference(epoch))


def earlier_order(sizes: list[int], seed: int, epoch: int, window: int, shuffle: bool) -> np.ndarray:
    """An epoch's order as the earlier code made it (whole, each window indexed by a permutation)."""
    rows_of = np.asarray(sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(rows_of)])
    if not shuffle:
        return np.arange(starts[-1])
    rng = np.random.default_rng([seed, epoch])
    groups = rng.permutation(rows_of.size)
    offsets = np.concatenate([[0], np.cumsum(rows_of[groups])])
    rows = np.arange(offsets[-1]) - np.repeat(offsets[:-1] - starts[groups], rows_of[groups])
    for start in range(0, rows_of.size, window):
        lo, hi = offsets[start], offsets[min(start + window, rows_of.size)]
        rows[lo:hi] = rows[lo:hi][rng.permutation(hi - lo)]
    return rows


@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12), window=st.integers(0, 14), shuffle=st.booleans(),
       ends=st.lists(st.integers(0, 500), max_size=4), seed=st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_an_order_made_as_far_as_asked_is_the_earlier_codes_and_its_row_groups_are_known_before(
        sizes: list[int], window: int, shuffle: bool, ends: list[int], seed: int) -> None:
    order = EpochOrder(np.array(sizes), seed=seed, shuffle=shuffle, window_row_groups=window)
    reference = earlier_order(sizes, seed, 1, max(1, window), shuffle)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for end in ends:  # (ends anywhere, windows of no rows among them)
        end = min(end, reference.size)
        first = end // 2
        needed = set((np.searchsorted(starts, reference[first:end], side="right") - 1).tolist())
        assert needed <= set(order.groups_of_rows(1, first, end))  # (before and after the rows are made)
        assert np.array_equal(order.rows_until(1, end)[:end], reference[:end])
        assert needed <= set(order.groups_of_rows(1, first, end))
    while order.advance(1):
        pass
    assert order.complete(1) and np.array_equal(order(1), reference)


def test_an_order_whose_making_failed_is_made_again_alike_and_orders_made_in_part_are_bounded() -> None:
    from freescale.dataloader.epoch_order import KEPT_EPOCHS

    class Boom:
        bit_generator = np.random.default_rng(0).bit_generator

        def shuffle(self, rows: np.ndarray) -> None:
            raise MemoryError("no room")

    class Failing(EpochOrder):
        fail = True

        def _make(self, epoch: int, progress: Any, first: int, end: int, windows: int | None = None) -> None:
            if self.fail and progress.low.made > 0:  # (after its first window)
                self.fail, progress.low.rng = False, Boom()
            super()._make(epoch, progress, first, end, windows)

    order = Failing(np.full(12, 50), seed=4, shuffle=True, window_row_groups=3)
    reference = earlier_order([50] * 12, 4, 0, 3, True)
    assert np.array_equal(order.rows_until(0, 100)[:150], reference[:150])
    with pytest.raises(MemoryError):
        order.rows_until(0, 400)
    assert np.array_equal(order(0), reference) and order.complete(0)  # (made again from its start)
    for epoch in range(20):  # (each made in part: its last windows hold no step this loop asks for)
        order.rows_until(epoch + 1, 256)
    assert sum(not order.complete(e) for e in order._epochs) == KEPT_EPOCHS and sorted(order._epochs) == [0, 19, 20]
    for epoch in range(5):
        order(epoch)
    assert sorted(order._epochs) == [3, 4, 19, 20]  # (two whole, the newest; two in part)


def test_advance_waits_for_the_thread_making_the_order_and_forget_keeps_an_order_being_made() -> None:
    import threading
    import time

    gate, entered = threading.Event(), threading.Event()

    class Held(EpochOrder):
        def _make(self, epoch: int, progress: Any, first: int, end: int, windows: int | None = None) -> None:
            if end == self.num_rows and threading.current_thread().name == "maker":
                entered.set()
                assert gate.wait(10)
            super()._make(epoch, progress, first, end, windows)

    order = Held(np.full(12, 50), seed=4, shuffle=True, window_row_groups=3)
    maker = threading.Thread(target=order, args=(0,), name="maker")
    maker.start()
    assert entered.wait(10)
    order.forget()  # (the order being made is kept)
    threading.Timer(0.2, gate.set).start()
    started = time.monotonic()
    order.advance(0)  # (waits for the maker's next window, without making one: not a spin)
    assert time.monotonic() - started >= 0.15
    maker.join(10)
    assert order.complete(0) and np.array_equal(order(0), earlier_order([50] * 12, 4, 0, 3, True))


def test_a_position_saved_with_its_windows_draws_resumes_the_same_order_from_there() -> None:
    sizes = [50, 0, 30, 50, 70, 50, 10, 50, 50, 40, 50, 50, 20, 50]
    made = EpochOrder(np.array(sizes), seed=7, shuffle=True, window_row_groups=3)
    reference = earlier_order(sizes, 7, 2, 3, True)
    assert np.array_equal(made(2), reference)
    ends = np.cumsum(np.array(sizes)[made.groups(2)])  # (each row group's end in the order)
    first_window = made.state_at(2, 5)
    assert first_window is not None and first_window["row_group"] == 0 and not made.restore(first_window)
    for row in (160, 400, 529):
        saved = json.loads(json.dumps(made.state_at(2, row)))  # (as a checkpoint keeps it)
        window_start = int(ends[saved["row_group"] - 1])  # (the rows of the windows before it)
        assert window_start <= row and saved["row_group"] % 3 == 0 and saved["row_group"] > 0
        resumed = EpochOrder(np.array(sizes), seed=7, shuffle=True, window_row_groups=3)
        assert resumed.restore(saved) and not resumed.restore(saved)  # (once: the epoch is made there then)
        rows = resumed.rows_until(2, row + 1, window_start)
        assert np.array_equal(rows[window_start:row + 1], reference[window_start:row + 1])
        assert resumed._epochs[2].low.made == 0  # (nothing before its window made)
        while resumed.advance(2):  # (then the rest, and the windows before it from the start, drawn alike)
            pass
        assert resumed.complete(2) and np.array_equal(resumed(2), reference)
    saved = made.state_at(2, 400)
    assert saved is not None
    for other, changed in ((EpochOrder(np.array(sizes), seed=8, shuffle=True, window_row_groups=3), saved),
                           (EpochOrder(np.array(sizes[::-1]), seed=7, shuffle=True, window_row_groups=3), saved),
                           (EpochOrder(np.array(sizes), seed=7, shuffle=True, window_row_groups=3),
                            dict(saved, numpy="1.0.0"))):  # (another seed, row groups, numpy: made from the start)
        assert not other.restore(changed) and not other._epochs
    fresh = EpochOrder(np.array(sizes), seed=7, shuffle=True, window_row_groups=3)
    fresh.rows_until(2, 1)  # (its first window only: the next one's draws are known, not yet made)
    second_window = int(ends[2])  # (its first row)
    assert fresh.state_at(2, second_window) == made.state_at(2, second_window) is not None
    assert fresh.state_at(2, second_window)["row_group"] == 3 and fresh.state_at(2, int(ends[5])) is None  # type: ignore[index]
    # A state that passes every check but is not the seed's (a bug's): once the run from the epoch's start reaches it,
    # every ask of that epoch fails, the read-ahead's and the plans' alike; the order is never switched mid-epoch.
    wrong = EpochOrder(np.array(sizes), seed=7, shuffle=True, window_row_groups=3)
    assert wrong.restore(dict(saved, rng=made.state_at(2, 160)["rng"]))  # type: ignore[index]
    with pytest.raises(DataError, match="not the one its seed makes"):
        while wrong.advance(2):
            pass
    for ask in (lambda: wrong.rows_until(2, 600, 500), lambda: wrong(2), lambda: wrong.advance(2)):
        with pytest.raises(DataError, match="not the one its seed makes"):
            ask()
    wrong.forget()
    assert not wrong.complete(2) and 2 in wrong._epochs and wrong.state_at(2, 400) is None  # (never saved again)
    assert wrong.restore(saved) and np.array_equal(wrong(2), reference)  # (a good save loaded: that epoch goes on)
    just_resumed = EpochOrder(np.array(sizes), seed=7, shuffle=True, window_row_groups=3)
    assert just_resumed.restore(saved) and just_resumed.state_at(2, 400) == saved  # (saved again before any window)
    refused = EpochOrder(np.array(sizes), seed=7, shuffle=True, window_row_groups=3)
    earlier = {key: saved[key] for key in ("epoch", "row_group", "rng")}  # (an identity missing: an earlier save)
    assert not refused.restore(earlier) and not refused.restore(dict(saved, epoch=3))  # (another epoch's stream)
    assert not refused.restore(dict(saved, row_group=saved["row_group"] + 1)) and not refused._epochs
