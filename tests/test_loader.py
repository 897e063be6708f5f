"""BalancedLoader: exactly once, resumable, live-rank changes, prefetch, two real processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from freescale.dataloader.cost import CostModel
from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.loader import BalancedLoader, StepInfo
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, DataError
from freescale.dataloader.source import ParquetSource
from tests.test_data import table_with, write_dataset

FEATURES = [HISTORY_ITEMS, CANDIDATE_ITEM]


def make(path: Path, rank: int = 0, world_size: int = 2, **cfg: object) -> BalancedLoader:
    config = DataConfig(path=str(path), batch_size=32, max_seq_len=64, window=1)
    for key, value in cfg.items():
        setattr(config, key, value)
    return build_loader(config, "train", rank=rank, world_size=world_size, sparse_features=FEATURES,
                        derived_cost=CostModel(1e-3, 1.0, 1.0), seed=3)


def consume(loader: BalancedLoader, steps: int) -> list[np.ndarray]:
    rows = []
    for _ in range(steps):
        batch = loader.next_batch()
        assert loader.last is not None and loader.last.rows.size == batch.size
        rows.append(loader.last.rows)
    return rows


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize(("window", "locality"), [(1, False), (4, False), (4, True)])
def test_resume_mid_epoch_equals_uninterrupted(tiny_data: Path, prefetch: int, window: int, locality: bool) -> None:
    ahead = 3 if prefetch else 0  # (row groups decoded ahead: restarted elsewhere by the resume)
    straight = consume(make(tiny_data, prefetch=prefetch, window=window, locality=locality, read_ahead=ahead), 14)
    first = make(tiny_data, prefetch=prefetch, window=window, locality=locality, read_ahead=ahead)
    consume(first, 9)
    state = first.state_dict()
    first.close()
    resumed = make(tiny_data, prefetch=prefetch, window=window, locality=locality, read_ahead=ahead)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(consume(resumed, 5), straight[9:]))
    resumed.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_resume_makes_its_order_from_the_saved_windows_draws_not_from_the_epochs_start(tiny_data: Path,
                                                                                          prefetch: int) -> None:
    cfg = {"prefetch": prefetch, "read_ahead": 3 if prefetch else 0, "shuffle_row_groups": 1, "batch_size": 512}
    straight_loader = make(tiny_data, **cfg)
    straight = consume(straight_loader, 17)
    first = make(tiny_data, **cfg)
    consume(first, 12)
    state = first.state_dict()
    first.close()
    assert state["order"]["row_group"] >= 2  # (step 12's rows, 12,288 on: past the first two row groups of 4,096)
    resumed = make(tiny_data, **cfg)
    resumed.load_state_dict(state)
    assert resumed.planner.order._epochs[0].low.made == 0  # (no window before the saved one made to resume)
    assert all(np.array_equal(a, b) for a, b in zip(consume(resumed, 5), straight[12:]))
    resumed.close()
    straight_loader.close()


def test_batch_fields_and_loss_scale(tiny_data: Path) -> None:
    loader = make(tiny_data, prefetch=0)
    batch = loader.next_batch()
    info = loader.last
    assert info is not None and batch.costs is not None and batch.costs.shape == (batch.size,)
    assert batch.loss_scale == pytest.approx(2 / info.global_size)
    assert info.global_size == 64 and 1.0 <= info.bound <= info.imbalance + 1e-9


def test_histories_are_each_rows_most_recent_items(tiny_data: Path) -> None:
    """The batch's histories, cut at read time (``gather.gather_tails``), are the last ``max_seq_len``
    items of each row's stored history, in the order of ``last.rows``; the candidates follow them."""
    loader = make(tiny_data, prefetch=0, max_seq_len=5)
    stored = ParquetSource(str(tiny_data), "train", [HISTORY_ITEMS, CANDIDATE_ITEM])  # no cut
    for _ in range(3):
        batch = loader.next_batch()
        assert loader.last is not None
        table, rows = stored.read(loader.last.rows)
        assert np.array_equal(rows, loader.last.rows)
        history = batch.sparse[HISTORY_ITEMS]
        expected = [h[-5:] for h in table.column(HISTORY_ITEMS).to_pylist()]
        assert history.lengths().tolist() == [len(h) for h in expected]
        assert history.values().tolist() == [v for h in expected for v in h]
        assert batch.sparse[CANDIDATE_ITEM].values().tolist() == table.column(CANDIDATE_ITEM).to_pylist()
    assert any(len(h) > 5 for h in table.column(HISTORY_ITEMS).to_pylist())  # the cut did cut


def test_live_rank_change_between_steps_keeps_exactly_once(tiny_data: Path) -> None:
    loaders = {r: make(tiny_data, rank=r, world_size=3, window=4, prefetch=2) for r in range(3)}
    seen: list[int] = []
    live = [0, 1, 2]
    steps = loaders[0].steps_per_epoch
    for step in range(steps):
        if step == 6:
            live = [0, 2]  # rank 1 fails
        if step == 11:
            live = [0, 1, 2]  # and comes back: it takes the group's position from a live peer
            loaders[1].load_state_dict(loaders[0].state_dict())
        for r in live:
            loaders[r].set_live_ranks(live)
            loaders[r].next_batch()
            seen.extend(loaders[r].last.rows.tolist())  # type: ignore[union-attr]
    assert len(seen) == len(set(seen)) == steps * 96
    for loader in loaders.values():
        loader.close()


def test_prefetch_thread_reports_bad_rows_in_next_batch(tmp_path: Path) -> None:
    bad = write_dataset(tmp_path / "bad", table_with(candidate_item_id=pa.array([1, 2, 30, 4], pa.int64())))
    loader = make(bad, world_size=1, batch_size=4, prefetch=2)
    with pytest.raises(DataError, match="row 2: column 'candidate_item_id': id 30"):
        loader.next_batch()
    loader.close()


def _rank_rows(path: str, rank: int, out: str) -> None:
    loader = make(Path(path), rank=rank, world_size=2, prefetch=2)
    rows = consume(loader, loader.steps_per_epoch)
    loader.close()
    np.save(out, np.concatenate(rows))


def test_two_processes_see_each_sample_exactly_once_per_epoch(tiny_data: Path, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_rows, args=(str(tiny_data), r, str(tmp_path / f"rank{r}.npy"))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    rows = np.concatenate([np.load(tmp_path / f"rank{r}.npy") for r in (0, 1)])
    steps = make(tiny_data).steps_per_epoch
    assert rows.size == np.unique(rows).size == steps * 64


def test_cost_model_change_keeps_ranks_in_agreement_and_resumes(tiny_data: Path) -> None:
    """All ranks switch cost model at the same step, whatever each had prefetched."""
    new_model = CostModel(1.0, 0.0, 0.0)
    loaders = [make(tiny_data, rank=r, world_size=2, window=4, prefetch=p) for r, p in ((0, 4), (1, 0))]
    seen: list[int] = []
    for step in range(14):
        if step == 5:
            for loader in loaders:
                loader.set_cost_model(new_model)
        for loader in loaders:
            loader.next_batch()
            seen.extend(loader.last.rows.tolist())  # type: ignore[union-attr]
        if step == 9:
            state = loaders[0].state_dict()
    assert len(seen) == len(set(seen)) == 14 * 64
    straight = seen[10 * 64 :]
    resumed = [make(tiny_data, rank=r, world_size=2, window=4, prefetch=2) for r in (0, 1)]
    again: list[int] = []
    for loader in resumed:
        loader.load_state_dict(state)
    for _ in range(4):
        for loader in resumed:
            loader.next_batch()
            again.extend(loader.last.rows.tolist())  # type: ignore[union-attr]
    assert again == straight
    for loader in loaders + resumed:
        loader.close()


def _train_with_failures(
    path: Path, *, window: int, dies: dict[int, list[int]], returns: dict[int, list[int]], epochs: int = 2,
    locality: bool = False,
) -> tuple[np.ndarray, np.ndarray, dict[int, BalancedLoader]]:
    """Three simulated ranks over ``epochs`` epochs.  ``dies[t]``: ranks that fail during global
    step t (after taking their batch): the survivors commit t without them, requeue their planned
    rows and go on without them.  ``returns[t]``: ranks that rejoin before step t, restored from a
    survivor's ``state_dict``.  Returns (committed rows, every row of the epochs' full batches)."""
    loaders = {r: make(path, rank=r, world_size=3, window=window, batch_size=128, prefetch=p, locality=locality)
               for r, p in zip(range(3), (2, 0, 3))}
    steps = loaders[0].steps_per_epoch
    live = [0, 1, 2]
    committed: list[np.ndarray] = []
    for t in range(epochs * steps):
        if t in returns:
            state = loaders[live[0]].state_dict()
            for r in returns[t]:
                loaders[r].load_state_dict(state)
            live = sorted(live + returns[t])
        for r in live:
            loaders[r].set_live_ranks(live)
            loaders[r].next_batch()
        infos: dict[int, StepInfo] = {r: loaders[r].last for r in live}  # type: ignore[misc]
        for r, info in infos.items():  # every rank knows every live rank's plan, its own included
            assert info is not None and (info.epoch * steps + info.step) == t and info.live_ranks == tuple(live)
            assert sum(info.rank_sizes) == info.global_size and info.rank_sizes == tuple(p.size for p in info.plan_rows)
            assert np.array_equal(np.sort(info.plan_rows[live.index(r)]), info.rows)  # no bad rows in tiny_data
            assert all(np.array_equal(a, b) for a, b in zip(info.plan_rows, infos[live[0]].plan_rows))
        dead = dies.get(t, [])
        survivors = [r for r in live if r not in dead]
        committed.extend(infos[r].rows for r in survivors)
        if dead:
            # What every survivor knows of the dead ranks' samples: the plan, identical on all of them.
            lost = {r: np.concatenate([infos[r].plan_rows[live.index(d)] for d in dead]) for r in survivors}
            assert all(np.array_equal(lost[r], lost[survivors[0]]) for r in survivors)
            for r in survivors:
                loaders[r].requeue(lost[r])
                assert loaders[r]._next_plans is None  # (a read planned ahead is planned again: the carry changes it)
                loaders[r].set_live_ranks(survivors)
            live = survivors
    order = loaders[0].planner.order
    expected = np.concatenate([order(e)[: steps * 128 * 3] for e in range(epochs)])
    return np.concatenate(committed), expected, {r: loaders[r] for r in live}


@pytest.mark.parametrize(("window", "locality"), [(1, False), (4, False), (4, True)])
def test_requeue_after_failures_trains_every_row_exactly_once(tiny_data: Path, window: int, locality: bool) -> None:
    """Rank 2 dies mid-epoch and comes back; ranks 1 then 0 die on the steps after (carry of carry);
    rank 0 dies on the epoch's last step (carry into the next epoch's step 0).  With read locality
    too: its windows are re-planned over the survivors the same way."""
    steps = make(tiny_data, world_size=3, batch_size=128).steps_per_epoch
    dies = {5: [2], 11: [1], 12: [0], steps - 1: [0]}
    returns = {9: [2], 15: [0, 1], steps + 2: [0]}
    got, expected, loaders = _train_with_failures(tiny_data, window=window, dies=dies, returns=returns,
                                                  locality=locality)
    assert np.array_equal(np.sort(got), np.sort(expected))
    for loader in loaders.values():
        assert loader.planner.carry_state(0, 0) == []  # spent carry is forgotten
        loader.close()


def test_requeue_on_the_last_step_carries_into_the_next_epoch(tiny_data: Path) -> None:
    """Ranks 1 and 2 die on epoch 0's last step: what they lost is pending for (1, 0), in the state."""
    steps = make(tiny_data, world_size=3, batch_size=128).steps_per_epoch
    got, expected, loaders = _train_with_failures(tiny_data, window=4, dies={steps - 1: [1, 2]}, returns={}, epochs=1)
    (epoch, step, carried), = loaders[0].state_dict()["carry"]
    assert (epoch, step) == (1, 0) and len(carried) > 0
    assert np.array_equal(np.sort(np.concatenate([got, np.asarray(carried)])), np.sort(expected))
    for loader in loaders.values():
        loader.close()


def _run_shape(path: Path, world: int, steps: int | None, state: dict | None, **cfg: object) -> tuple[list, dict, int]:
    """``world`` simulated ranks of one shape: from ``state`` (or the start) for ``steps`` global steps (or to
    the end of the epoch).  Returns (rows each rank trained, per step), the state after, and the epoch."""
    loaders = [make(path, rank=r, world_size=world, prefetch=0, **cfg) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    trained, start_epoch = [], loaders[0].epoch
    while (steps is None and loaders[0].epoch == start_epoch) or (steps is not None and len(trained) < steps):
        trained.extend(loader.next_batch() and loader.last.rows for loader in loaders)  # type: ignore[union-attr]
    after = loaders[0].state_dict()
    for loader in loaders:
        loader.close()
    return trained, after, start_epoch


def test_resume_under_another_shape_trains_the_rest_of_the_epoch_exactly_once(tiny_data: Path) -> None:
    """2 ranks x 32 (window 4, a rank's rows lost and requeued) -> 3 ranks x 20 (window 2) -> 1 rank x 48
    (window 1, KK): the epoch's samples, each trained once, the carry and the last partial batch included."""
    first = [make(tiny_data, rank=r, world_size=2, prefetch=0, window=4) for r in range(2)]
    trained = []
    for _ in range(6):
        trained.extend(loader.next_batch() and loader.last.rows for loader in first)  # type: ignore[union-attr]
    lost = first[0].last.plan_rows[1]  # type: ignore[union-attr]  rank 1 died in step 5: its rows are carried
    trained = trained[:-1]
    for loader in first:
        loader.requeue(lost)
    state = first[0].state_dict()
    expected = first[0].planner.order(0)[: first[0].steps_per_epoch * 64]
    for loader in first:
        loader.close()
    assert state["carry"] and state["step"] == 6
    more, state, epoch = _run_shape(tiny_data, 3, 5, state, batch_size=20, window=2)
    assert epoch == 0 and state["reshaped_from"]["step"] == 6
    rest, after, _ = _run_shape(tiny_data, 1, None, state, batch_size=48, partitioner="kk")
    got = np.concatenate(trained + more + rest)
    assert np.array_equal(np.sort(got), np.sort(expected))  # none skipped, none twice
    assert (after["epoch"], after["step"]) == (1, 0) and "reshaped_from" not in after


def _batches(loader: BalancedLoader, steps: int) -> list[tuple[np.ndarray, ...]]:
    out = []
    for _ in range(steps):
        batch = loader.next_batch()
        info = loader.last
        assert info is not None
        out.append((info.rows, *info.plan_rows, batch.dense.numpy(), batch.labels.numpy(),
                    batch.sparse.values().numpy(), batch.sparse.lengths().numpy(), np.array([batch.loss_scale])))
    return out


@pytest.mark.parametrize("window", [1, 4])
def test_state_with_pending_carry_resumes_identically(tiny_data: Path, window: int) -> None:
    first = make(tiny_data, prefetch=3, window=window)
    consume(first, 6)
    info = first.last
    assert info is not None
    lost = np.asarray(info.plan_rows[1][:20])  # as if part of rank 1's step had to be trained again
    first.requeue(lost)
    first.planner.requeue(first.epoch, first.step + 2, np.asarray(info.plan_rows[1][20:30]))  # a later step too
    state = json.loads(json.dumps(first.state_dict()))  # JSON-friendly
    assert [c[:2] for c in state["carry"]] == [[0, 6], [0, 8]]
    straight = _batches(first, 5)
    assert set(lost.tolist()) <= set(np.concatenate(straight[0][1:3]).tolist())  # the next step holds the carry
    resumed = make(tiny_data, prefetch=1, window=window)
    resumed.load_state_dict(state)
    again = _batches(resumed, 5)
    assert all(len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)) for a, b in zip(straight, again))
    # An old state without carry still loads, and plans without any.
    old = make(tiny_data, prefetch=0, window=window)
    old.load_state_dict({k: v for k, v in state.items() if k != "carry"})
    assert old.planner.carry_state(0, 0) == [] and not set(lost.tolist()) & set(consume(old, 1)[0].tolist())
    for loader in (first, resumed, old):
        loader.close()


@pytest.mark.parametrize("window", [1, 4])
def test_state_dict_keeps_the_prefetched_batches_and_the_state_resumes_identically(tiny_data: Path,
                                                                                     window: int) -> None:
    """A save reads the loader's state while its producer thread plans ahead: the prefetched batches stay (no
    stop, no re-read: a save's next step does not wait for its batch), the batches after it are those of a
    loader asked nothing, and the state resumes exactly there."""
    asked, plain = make(tiny_data, prefetch=3, window=window), make(tiny_data, prefetch=3, window=window)
    consume(asked, 5)
    consume(plain, 5)
    deadline = time.monotonic() + 30
    while len(asked._handoff) < 3 and time.monotonic() < deadline:  # the next steps are prefetched
        time.sleep(0.01)
    producer, ready = asked._thread, len(asked._handoff)
    state = json.loads(json.dumps(asked.state_dict()))
    assert asked._thread is producer and producer is not None and producer.is_alive()
    assert len(asked._handoff) >= ready >= 3  # nothing dropped (the producer may have handed over more)
    after, expected = _batches(asked, 6), _batches(plain, 6)
    resumed = make(tiny_data, prefetch=1, window=window)
    resumed.load_state_dict(state)
    again = _batches(resumed, 6)
    for got in (after, again):
        assert all(len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)) for a, b in zip(got, expected))
    for loader in (asked, plain, resumed):
        loader.close()


def test_requeue_drops_batches_prefetched_without_the_carry(tiny_data: Path) -> None:
    loader = make(tiny_data, prefetch=3, window=4)
    consume(loader, 2)
    deadline = time.monotonic() + 30
    while len(loader._handoff) < 3 and time.monotonic() < deadline:  # the next steps are prefetched
        time.sleep(0.01)
    info = loader.last
    assert info is not None
    lost = np.asarray(info.plan_rows[1])
    loader.requeue(lost)
    loader.next_batch()
    nxt = loader.last
    assert nxt is not None and nxt.step == 2 and nxt.global_size == 64 + lost.size
    assert np.array_equal(np.sort(np.concatenate(nxt.plan_rows)), np.sort(np.concatenate([lost, *make(
        tiny_data, prefetch=0, window=4).planner.plan(0, 2, (0, 1)).rows])))
    assert set(nxt.rows.tolist()) & set(lost.tolist())  # this rank's share is in its batch
    loader.close()


def test_a_group_restored_from_a_peers_snapshot_knows_the_rows_its_last_step_trained(tiny_data: Path) -> None:
    """A group that catches up to the very step of its peer's snapshot replays nothing, so that
    step's record (the rows it trained, every group's) must come with the snapshot: without it the
    record held the rows of the last step this group applied itself (a chaos run's audit saw every
    sample trained once, but one step's rows recorded twice and another's never).  The fault-tolerance
    layer's snapshot side, with real feeds, a real model and optimizer; the snapshot travels as bytes."""
    from types import SimpleNamespace

    import torch

    from freescale.dense_update import DenseUpdate, LRSchedule
    from freescale.ft.layer_snapshot import SnapshotSide
    from freescale.step_feed import StepFeed
    from freescale.step_types import Commit

    class Side(SnapshotSide):
        def __init__(self, feed: StepFeed) -> None:
            self._model = torch.nn.Linear(2, 1)
            self._optimizer = torch.optim.SGD(self._model.parameters(), lr=0.1)
            self._update = DenseUpdate([self._optimizer], list(self._model.parameters()), LRSchedule())
            self._data, self._accounted, self._user_states = feed, None, {}
            self._sync = SimpleNamespace(wait_staged=lambda: 0.0)  # type: ignore[assignment]
            self._events = []

        def _apply(self, result):  # type: ignore[no-untyped-def, override]
            raise AssertionError("nothing is replayed here")

        def agree(self, ok: bool) -> bool:
            return ok  # a group of one rank

    sources = [Side(StepFeed(make(tiny_data, rank=g), g, 1, 2, 0, lambda step: 10)) for g in range(2)]
    for step in range(3):
        for side in sources:
            side._data.weight(step)  # type: ignore[union-attr]
            side._accounted = side._data.commit(Commit(step, frozenset({0, 1}), frozenset({0, 1})))  # type: ignore[union-attr]
    tensors = {name: t.clone() for name, t in sources[0].snapshot().items()}
    behind = Side(StepFeed(make(tiny_data, rank=1), 1, 1, 2, 0, lambda step: 10))
    behind.load(tensors)
    rows = [side._accounted.rows.tolist() for side in sources]  # type: ignore[union-attr]
    assert behind._accounted is not None and behind._accounted.rows.tolist() == rows[0] == rows[1]
    assert behind._accounted.rows.size > 0 and behind._accounted.samples == 0  # it sat that step out
    assert sources[1]._accounted.samples > 0  # type: ignore[union-attr]
    for side in [*sources, behind]:
        side._data.loader.close()  # type: ignore[union-attr]


def test_a_waiting_joiner_reads_only_the_last_steps_in_flight_planned_with_it() -> None:
    """Behind two batches planned ahead, a joiner's snapshot may hold a step planned with its group (before it died),
    one planned without it, and one planned with it again (once a vote named it as joining): a pipeline pulls one
    batch a step, in order, so only the last run is read; the step before the gap is sat out, its share requeued at
    its commit (``StepFeed.commit``), and no later step finds the pipeline's iterator short."""
    from collections import deque
    from types import SimpleNamespace

    from freescale.dataloader.partition import Parts
    from freescale.step_feed import PlannedStep, StepFeed

    reads: list[int] = []

    def read_planned(epoch: int, step: int, live: tuple[int, ...], rows: Parts) -> tuple[str, str]:
        reads.append(step)
        return f"info {step}", f"batch {step}"

    loader = SimpleNamespace(rank=1, read_planned=read_planned)
    feed = StepFeed(loader, 1, 1, 2, 2, lambda step: 100)  # type: ignore[arg-type]
    plans = [(7, (0, 1)), (8, (0,)), (9, (0, 1)), (10, (0, 1))]
    feed._plans = deque(PlannedStep(step, live, Parts.of_list([np.array([r]) for r in live]), when=(0, step))
                        for step, live in plans)
    feed.read_in_flight()
    assert reads == [9, 10] and list(feed.batches()) == ["batch 9", "batch 10"]
    assert [p.info for p in feed._plans] == [None, None, "info 9", "info 10"]


@pytest.mark.parametrize("batch_size", [100, 1365, 2000])
def test_evaluation_reads_every_row_once_and_no_rank_gets_an_empty_batch(tiny_data: Path, batch_size: int) -> None:
    """One evaluation pass over 3 ranks yields each of the split's 4,096 rows exactly once, in lockstep: the
    last step also holds the rows short of a whole batch (196 of them at batch 100; at 1,365 the one row
    left over; at 2,000 the split is smaller than a batch: one step), so no rank's share is ever empty."""
    config = DataConfig(path=str(tiny_data), batch_size=batch_size, max_seq_len=64)
    loaders = [build_loader(config, "eval", rank=r, world_size=3, sparse_features=FEATURES,
                            derived_cost=CostModel(1e-3, 1.0, 1.0), seed=3, training=False) for r in range(3)]
    per_rank = [[(batch.size, loader.last.rows.copy()) for batch in loader if loader.last is not None]
                for loader in loaders]
    assert [len(steps) for steps in per_rank] == [max(4096 // (3 * batch_size), 1)] * 3
    rows = np.concatenate([r for steps in per_rank for _, r in steps])
    assert np.array_equal(np.sort(rows), np.arange(4096))
    assert all(size == r.size > 0 for steps in per_rank for size, r in steps)
    for loader in loaders:
        loader.close()


def test_capacities_set_at_a_step_plan_a_slow_rank_less_and_are_measured_anew_after_a_resume(tiny_data: Path) -> None:
    """Two ranks' loaders set rank 1 to half speed at step 2: from there rank 1 reads about a third of each
    global batch and both ranks agree on the plan.  A loader resumed from the state (at a step whose window is
    not planned yet) plans with no speeds: they are measured anew after a restart."""
    loaders = [make(tiny_data, rank=r, prefetch=0) for r in range(2)]
    for loader in loaders:
        consume(loader, 2)
        loader.set_capacities({1: 0.5})
    plans = [consume(loader, 3) for loader in loaders]
    for step in range(3):
        assert not set(plans[0][step].tolist()) & set(plans[1][step].tolist())
        assert abs(plans[1][step].size / 64 - 1 / 3) < 0.12  # about a third of the samples (by cost: a third)
    state = json.loads(json.dumps(loaders[1].state_dict()))
    resumed = make(tiny_data, rank=1, prefetch=0)
    resumed.load_state_dict(state)
    assert resumed.planner.capacities is None and loaders[1].planner.capacities == {1: 0.5}
    assert abs(consume(resumed, 1)[0].size / 64 - 1 / 2) < 0.12
    for loader in [*loaders, resumed]:
        loader.close()
