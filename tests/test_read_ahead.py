"""Row groups decoded ahead of the reads (``dataloader/read_ahead.py``): what it decodes, in which order, how far ahead,
errors raised by the read that needs the row group, and the loader's batches the same with it and without."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.cost import CostModel
from freescale.dataloader.gather import gather_tails
from freescale.dataloader.loader import BalancedLoader
from freescale.dataloader.read_ahead import ReadAhead
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, DataError, DatasetManifest
from tests.test_data import good_columns

FEATURES = [HISTORY_ITEMS, CANDIDATE_ITEM]
STARTS = np.array([0, 10, 20, 30, 40, 50], dtype=np.int64)
"""Five row groups of 10 rows."""


def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Decodes:
    """A fake decode that records its calls; a row group in ``failing`` raises."""

    def __init__(self, failing: int = -1) -> None:
        self.calls: list[int] = []
        self.failing = failing
        self.held: set[int] = set()

    def __call__(self, group: int) -> str:
        self.calls.append(group)
        if group == self.failing:
            raise DataError(f"row group {group}: bad")
        return f"decoded {group}"


def test_row_groups_are_decoded_in_the_order_first_needed_within_the_depth_and_taken_once() -> None:
    # Steps of 10 rows: step 0 reads groups 3 and 1, step 1 group 3 again and 4, step 2 groups 0 and 2.
    rows = np.array([35, 12] * 5 + [31, 44] * 5 + [5, 25] * 5, dtype=np.int64)
    decodes = Decodes()
    ahead: ReadAhead[str] = ReadAhead(decodes, STARTS, 10, 2, decodes.held.__contains__)
    ahead.at(0, 0, lambda epoch: rows)
    until(lambda: len(decodes.calls) == 2)
    time.sleep(0.05)  # (nothing taken: it stays within its depth)
    assert decodes.calls == [3, 1]
    assert ahead.take(3) == "decoded 3"
    until(lambda: len(decodes.calls) == 3)
    assert decodes.calls == [3, 1, 4]
    decodes.held.add(0)  # (the source holds group 0: not decoded ahead)
    assert ahead.take(1) == "decoded 1" and ahead.take(4) == "decoded 4"
    until(lambda: len(decodes.calls) == 4)
    time.sleep(0.05)
    assert decodes.calls == [3, 1, 4, 2]
    assert ahead.take(3) is None  # (taken already: the caller decodes it; nothing is decoded twice ahead)
    assert ahead.take(2) == "decoded 2" and ahead.take(0) is None
    ahead.close()


def test_a_decode_error_is_raised_by_the_read_that_takes_that_row_group_and_a_restart_follows_the_new_step() -> None:
    rows = np.arange(50, dtype=np.int64)  # steps of 10 rows: step s reads group s
    decodes = Decodes(failing=2)
    ahead: ReadAhead[str] = ReadAhead(decodes, STARTS, 10, 3, decodes.held.__contains__)
    ahead.at(0, 0, lambda epoch: rows)
    until(lambda: len(decodes.calls) == 3)
    assert ahead.take(0) == "decoded 0" and ahead.take(1) == "decoded 1"
    with pytest.raises(DataError, match="row group 2: bad"):
        ahead.take(2)
    until(lambda: len(decodes.calls) == 5 and ahead._waiting)  # (3 and 4 read, nothing in flight)
    ahead.at(0, 4, lambda epoch: rows)  # (the reads moved on: what the steps before it did not take is dropped)
    until(lambda: 4 in decodes.calls)
    assert ahead.take(4) == "decoded 4" and ahead.take(3) is None
    ahead.close()
    ahead.at(0, 0, lambda epoch: rows, more=True)  # (started again after a close, from an epoch's start)
    until(lambda: decodes.calls.count(0) == 2)
    ahead.close()
    with pytest.raises(ValueError, match="depth 0"):
        ReadAhead(decodes, STARTS, 10, 0, decodes.held.__contains__)


def test_the_next_epochs_schedule_is_made_on_the_thread_and_its_row_groups_follow_and_stay_decoded_into_it() -> None:
    epochs = {0: np.arange(50, dtype=np.int64), 1: np.arange(50, dtype=np.int64)[::-1].copy()}
    decodes = Decodes()
    ahead: ReadAhead[str] = ReadAhead(decodes, STARTS, 10, 2, decodes.held.__contains__)
    asked: list[tuple[int, str]] = []

    def rows_of(epoch: int) -> np.ndarray:
        asked.append((epoch, threading.current_thread().name))
        return epochs[epoch]

    for step in range(4):  # (the source holds the last two row groups a read took)
        ahead.at(0, step, rows_of, more=True)
        until(lambda: step in decodes.calls)
        assert ahead.take(step) == f"decoded {step}"
        decodes.held.clear()
        decodes.held.update({step - 1, step})
    until(lambda: len(decodes.calls) == 6)  # (group 4, then the next epoch's: 4 just decoded, 3 and 2 held, 1 and 0)
    assert ahead.take(4) == "decoded 4"
    decodes.held.clear()
    decodes.held.update({3, 4})
    until(lambda: len(decodes.calls) == 7)
    time.sleep(0.05)  # (two wait decoded for the next epoch: the depth)
    assert decodes.calls == [0, 1, 2, 3, 4, 1, 0]
    ahead.at(0, 4, rows_of, more=True)  # (the reads at the last step: what waits for the next epoch is not stale)
    ahead.at(1, 0, rows_of, more=False)  # (into the next epoch, the last: its schedule made already, its row groups kept)
    assert ahead.take(4) is None and ahead.take(1) == "decoded 1" and ahead.take(0) == "decoded 0"
    # Each epoch's rows asked once: this epoch's by the reads, the next's by the thread, as soon as it had nothing to
    # decode (two row groups ready: the depth).
    assert asked == [(0, "MainThread"), (1, "freescale-read-ahead")]
    until(lambda: len(decodes.calls) == 8)  # (2: 4 and 3 held, 1 and 0 taken)
    time.sleep(0.05)  # (no epoch follows the last: nothing more is decoded)
    assert decodes.calls == [0, 1, 2, 3, 4, 1, 0, 2] and asked == [(0, "MainThread"), (1, "freescale-read-ahead")]
    ahead.close()


def test_the_next_epoch_is_scheduled_halfway_and_row_groups_the_reads_passed_by_are_dropped_though_it_needs_them() -> None:
    rows = np.arange(50, dtype=np.int64)  # steps of 10 rows: step s reads group s, in both epochs
    decodes = Decodes()
    ahead: ReadAhead[str] = ReadAhead(decodes, STARTS, 10, 2, decodes.held.__contains__)
    ahead.at(0, 0, lambda epoch: rows, more=True)
    until(lambda: len(decodes.calls) == 2 and ahead._waiting)
    assert len(ahead._schedules) == 1  # (nothing to decode, but the reads are at the epoch's start: not yet)
    ahead.at(0, 3, lambda epoch: rows, more=True)  # (halfway: 3 and 4 decoded, then the next epoch scheduled)
    until(lambda: len(ahead._schedules) == 2)
    assert decodes.calls == [0, 1, 3, 4]
    ahead.at(0, 4, lambda epoch: rows, more=True)  # (step 3 was not this rank's: 3 is stale, though epoch 1 needs it)
    until(lambda: len(decodes.calls) == 5)
    assert decodes.calls == [0, 1, 3, 4, 0] and 3 not in ahead._ready and ahead.take(4) == "decoded 4"
    ahead.close()
    held = Decodes()  # (the source holds every row group: nothing to decode, nothing ready or stale to wake it)
    held.held.update(range(5))
    ahead = ReadAhead(held, STARTS, 10, 2, held.held.__contains__)
    ahead.at(0, 0, lambda epoch: rows, more=True)
    until(lambda: ahead._waiting)
    assert len(ahead._schedules) == 1
    ahead.at(0, 3, lambda epoch: rows, more=True)  # (halfway: the reads wake it to schedule the next epoch)
    until(lambda: len(ahead._schedules) == 2)
    assert held.calls == []
    ahead.close()


def test_a_primed_epoch_decodes_its_first_windows_row_groups_then_makes_its_order_and_the_schedule_keeps_them() -> None:
    rows = np.array([35, 12] * 5 + [31, 44] * 5 + [5, 25] * 5, dtype=np.int64)  # (the epoch's order, once made)
    decodes = Decodes()
    ahead: ReadAhead[str] = ReadAhead(decodes, STARTS, 10, 2, decodes.held.__contains__)
    windows_left = [3]

    def advance() -> bool:  # (one window of the order made a call; False once it is whole)
        windows_left[0] = max(0, windows_left[0] - 1)
        return windows_left[0] > 0

    ahead.prime(0, 0, [1, 3, 4], advance)  # (the first read's shuffle windows, before the order exists)
    until(lambda: ahead._advance is None)  # (two decoded, the depth; then, with nothing to decode, the order made)
    assert decodes.calls == [1, 3] and windows_left == [0]
    ahead.prime(0, 0, [1, 3, 4], advance)  # (asked again by the next read: nothing changes)
    assert ahead._advance is None and ahead.take(3) == "decoded 3"
    until(lambda: decodes.calls == [1, 3, 4])  # (room again: the primed groups go on)
    ahead.at(0, 0, lambda epoch: rows)  # (the order whole: the epoch's schedule, keeping what was decoded)
    assert ahead.take(1) == "decoded 1" and ahead.take(4) == "decoded 4"
    until(lambda: decodes.calls == [1, 3, 4, 0, 2])  # (the schedule's others, in the order first needed)
    assert ahead.handed == 3
    ahead.close()
    failing = Decodes()  # (making the order fails on the thread: its decodes go on, the order is not tried there again)
    ahead = ReadAhead(failing, STARTS, 10, 2, failing.held.__contains__)
    tries: list[int] = []

    def broken() -> bool:
        tries.append(1)
        raise MemoryError("no room for the order")

    ahead.prime(0, 0, [2, 0, 4], broken)
    until(lambda: ahead._advance is None and failing.calls == [2, 0])
    ahead.prime(0, 0, [2, 0, 4], broken)
    assert ahead.take(2) == "decoded 2"
    until(lambda: failing.calls == [2, 0, 4])
    assert tries == [1] and ahead._failed_epoch == 0
    ahead.close()


def prepared(root: Path, users: int) -> Path:
    """A format-2 dataset of ``users`` users in small row groups (many of them per step)."""
    from freescale.dataloader.log_input import LogColumns
    from freescale.dataloader.prepare import PrepareSpec, prepare
    from freescale.dataloader.synthetic_log import LogSpec, interactions

    pq.write_table(interactions(LogSpec(users=users, items=500, lengths="ml-20m", min_per_user=2, seed=1)),
                   root / "log.parquet")
    prepare(PrepareSpec(input=str(root / "log.parquet"), out=str(root / "v2"), columns=LogColumns(
        user="userId", item="movieId", time="timestamp", label="rating", rating_threshold=4.0), min_user_count=2,
        row_group_interactions=256))
    return root / "v2"


def loaders(path: Path, rank: int = 0, world_size: int = 1, **cfg: object) -> tuple[BalancedLoader, BalancedLoader]:
    made = []
    for ahead in (0, 3):
        config = DataConfig(path=str(path), batch_size=16, max_seq_len=20, read_ahead=ahead, shuffle_row_groups=4)
        for key, value in cfg.items():
            setattr(config, key, value)
        made.append(build_loader(config, "train", rank=rank, world_size=world_size, sparse_features=FEATURES,
                                 derived_cost=CostModel(1e-3, 1.0, 1.0), seed=5))
    assert made[0]._ahead is None and made[1]._ahead is not None
    return made[0], made[1]


@pytest.mark.parametrize("layout", ["format 1", "format 2"])
def test_batches_are_the_same_with_and_without_read_ahead(tiny_data: Path, tmp_path: Path, layout: str) -> None:
    path = tiny_data if layout == "format 1" else prepared(tmp_path, 120)
    for rank in (0, 1):
        plain, ahead = loaders(path, rank=rank, world_size=2, batch_size=64 if layout == "format 1" else 16)
        steps = plain.steps_per_epoch + plain.steps_per_epoch // 2  # (into the second epoch)
        for _ in range(steps):
            a, b = plain.next_batch(), ahead.next_batch()
            assert plain.last is not None and ahead.last is not None
            assert np.array_equal(plain.last.rows, ahead.last.rows)
            assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.sparse.lengths(), b.sparse.lengths())
            assert torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
            # Each batch, its histories copied straight from the row groups in a read of several steps, is the one
            # its rows give read alone and cut first (``batch_of``: ``read_arrays``).
            alone = ahead.batch_of(ahead.last.rows, b.loss_scale or 1.0)
            assert torch.equal(alone.sparse.values(), b.sparse.values()) and torch.equal(alone.sparse.lengths(),
                                                                                       b.sparse.lengths())
        assert ahead._ahead is not None and ahead._ahead.handed > 0  # (reads took row groups read ahead)
        if layout == "format 1":  # (its 5 row groups fit in the cache: each read once by either, counted alike)
            assert ahead.source.decoded_bytes == plain.source.decoded_bytes
        plain.close()
        ahead.close()


def test_bad_rows_are_raised_at_the_same_step_and_skipped_alike_with_read_ahead(tmp_path: Path) -> None:
    good = pa.table(good_columns())
    groups = [good] * 3 + [good.set_column(good.schema.get_field_index(CANDIDATE_ITEM), CANDIDATE_ITEM,
                                           pa.array([1, 2, 30, 4], pa.int64()))] + [good] * 2
    path = tmp_path / "bad"
    path.mkdir()
    with pq.ParquetWriter(path / "train-00000.parquet", good.schema) as writer:
        for table in groups:
            writer.write_table(table)
    DatasetManifest(num_items=10, num_users=10, dense_dim=2, max_len=8, splits={"train": ["train-00000.parquet"]}).write(path)
    raised = []
    for loader in loaders(path, batch_size=4, shuffle=False, partitioner="round_robin"):
        with pytest.raises(DataError) as info:
            for step in range(8):
                loader.next_batch()
        raised.append((step, str(info.value)))
        loader.close()
    assert raised[0] == raised[1] and raised[0][0] == 3 and "row 2: column 'candidate_item_id': id 30" in raised[0][1]
    skipped = []
    for loader in loaders(path, batch_size=4, shuffle=False, partitioner="round_robin", on_bad_rows="skip"):
        sizes = [loader.next_batch().size for _ in range(5)]
        skipped.append((sizes, dict(loader.source.skipped)))
        loader.close()
    assert skipped[0] == skipped[1] and skipped[0][0][3] == 3 and sum(skipped[0][1].values()) == 1


def test_a_format_1_read_of_several_runs_is_each_run_read_alone_back_to_back(tmp_path: Path) -> None:
    """Format 1's one gather for a read's runs (a row group at a time, ``row_gather.py``) against each run read alone:
    rows of distinct values in six row groups (a row taken from a wrong row group would show), a bad row dropped
    (skip mode), an empty run, histories cut to 2 of up to 4 values; the history left in place holds the same."""
    rows = np.arange(24)
    histories = [[10 * r + k for k in range(1 + r % 4)] for r in rows.tolist()]
    candidates = [3000 if r == 14 else r % 10 for r in rows.tolist()]  # (row 14: an item outside the catalogue)
    table = pa.table({
        "user_id": pa.array(rows, pa.int64()), "history_item_ids": pa.array(histories, pa.list_(pa.int64())),
        "history_timestamps": pa.array(histories, pa.list_(pa.int64())),
        "candidate_item_id": pa.array(candidates, pa.int64()),
        "dense_features": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(rows, 2), pa.float32()), 2),
        "label": pa.array(rows % 2, pa.float32())})
    path = tmp_path / "distinct"
    path.mkdir()
    pq.write_table(table, path / "train-00000.parquet", row_group_size=4)
    DatasetManifest(num_items=300, num_users=30, dense_dim=2, max_len=8, splits={"train": ["train-00000.parquet"]}).write(path)
    made = loaders(path, batch_size=4, shuffle=False, partitioner="round_robin", on_bad_rows="skip", max_seq_len=2)
    for loader in made[1:]:
        loader.close()
    source = made[0].source
    runs = [np.array([21, 14, 2, 9, 5]), np.array([], dtype=np.int64), np.array([13, 12, 15, 0, 23]), np.array([14])]
    arrays, kept, sizes = source.read_runs(runs)
    alone = [source.read_arrays(run) for run in runs]
    assert sizes.tolist() == [4, 0, 5, 0] and kept.tolist() == [2, 5, 9, 21, 0, 12, 13, 15, 23]
    assert kept.tolist() == [k for _, rows_alone in alone for k in rows_alone.tolist()]
    for key, values in arrays.items():
        assert np.array_equal(values, np.concatenate([a[key] for a, rows_alone in alone if rows_alone.size])), key
    assert arrays["dense_features"][:, 0].tolist() == kept.tolist()  # (each row from its own row group)
    assert arrays[HISTORY_ITEMS].tolist() == [v for r in kept.tolist() for v in histories[r][-2:]]
    uncut, _, _ = source.read_runs(runs, uncut=True)
    pieces = [*uncut[HISTORY_ITEMS + "@from"].tolist(), kept.size]
    assert np.array_equal(arrays[HISTORY_ITEMS], gather_tails([
        (src, uncut[HISTORY_ITEMS + "@end"][a:b], uncut[HISTORY_ITEMS + "@"][a:b])
        for src, a, b in zip(uncut[HISTORY_ITEMS + "@src"], pieces[:-1], pieces[1:])]))
    made[0].close()


@pytest.mark.parametrize("layout", ["format 1", "format 2"])
def test_a_source_that_forgets_its_decoded_row_groups_decodes_them_again_alike(tiny_data: Path, tmp_path: Path,
                                                                               layout: str) -> None:
    made = loaders(tiny_data if layout == "format 1" else prepared(tmp_path, 40))
    source = made[0].source
    rows = np.arange(0, source.num_rows, 7)
    first, kept = source.read_arrays(rows)
    decoded = source.decoded_bytes
    assert decoded > 0 and any(source.holds(rg) for rg in range(len(source.rg_rows)))
    source.forget_decoded()
    assert not any(source.holds(rg) for rg in range(len(source.rg_rows)))
    source.read_arrays(np.arange(source.num_rows - 40, source.num_rows))  # (other row groups first, other slots)
    between = source.decoded_bytes
    again, kept_again = source.read_arrays(rows)
    assert source.decoded_bytes > between > decoded and np.array_equal(kept, kept_again)
    assert first.keys() == again.keys() and all(np.array_equal(first[k], again[k]) for k in first)
    for loader in made:
        loader.close()
