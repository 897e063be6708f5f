"""Several steps read and built at once give the batches one step at a time gives, bit for bit."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from freescale.dataloader.assemble import BatchAssembler, StepRows
from freescale.dataloader.batch import Batch
from freescale.dataloader.buffer_pool import BufferPool
from freescale.dataloader.copy_thread import INLINE_READS, CopyThread
from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.cost import CostModel
from freescale.dataloader.loader import READ_STEPS
from freescale.dataloader.log_input import LogColumns
from freescale.dataloader.prepare import PrepareSpec, prepare
from freescale.dataloader.schema import (
    CANDIDATE_ITEM,
    CANDIDATE_TIMESTAMP,
    DENSE,
    HISTORY_ITEMS,
    HISTORY_TIMESTAMPS,
    LABEL,
    SAMPLED_ITEMS,
    USER_ID,
    DataError,
    DatasetManifest,
)


def same(a: Batch, b: Batch) -> bool:
    tensors = [(a.sparse.values(), b.sparse.values()), (a.sparse.lengths(), b.sparse.lengths()), (a.dense, b.dense),
               (a.labels, b.labels), (a.costs, b.costs), (a.history_timestamps, b.history_timestamps),
               (a.candidate_timestamps, b.candidate_timestamps)]
    return (a.sparse.keys() == b.sparse.keys() and a.loss_scale == b.loss_scale
            and all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                                and torch.equal(x, y)) for x, y in tensors))


def carries_its_per_key_counts(batch: Batch) -> bool:
    """The batch's KJT was built with its stride and values per key (torchrec need not sum its lengths for them),
    and they are what torchrec computes from its lengths."""
    carried = batch.sparse
    fresh = KeyedJaggedTensor(keys=carried.keys(), values=carried.values(), lengths=carried.lengths())
    return (carried._length_per_key is not None and carried._offset_per_key is not None
            and (carried.length_per_key(), carried.offset_per_key(), carried.stride())
            == (fresh.length_per_key(), fresh.offset_per_key(), fresh.stride()))


def prepared(tmp_path: Path, seed: int, interactions: int, users: int, items: int) -> None:
    """A random log through ``freescale prepare`` into ``tmp_path / "d"`` (format 2, row groups of 200 interactions)."""
    rng = np.random.default_rng(seed)
    n = interactions
    log = pa.table({"who": rng.integers(0, users, n), "what": rng.integers(0, items, n),
                    "when": rng.integers(0, 10**6, n), "stars": rng.integers(1, 6, n).astype(np.float64)})
    pacsv.write_csv(log, tmp_path / "log.csv")
    prepare(PrepareSpec(input=str(tmp_path / "log.csv"), out=str(tmp_path / "d"), row_group_interactions=200,
                        columns=LogColumns(user="who", item="what", time="when", label="stars", rating_threshold=4.0)))


def test_steps_built_together_equal_each_built_alone() -> None:
    rng = np.random.default_rng(0)
    sizes = np.array([5, 0, 3, 1, 7])  # an empty step among them
    n = int(sizes.sum())
    history = rng.integers(0, 6, n)
    arrays = {
        HISTORY_ITEMS: rng.integers(0, 50, int(history.sum())), HISTORY_ITEMS + "@": history,
        HISTORY_TIMESTAMPS: rng.integers(0, 10**9, int(history.sum())), HISTORY_TIMESTAMPS + "@": history,
        CANDIDATE_ITEM: rng.integers(0, 50, n).astype(np.int32), USER_ID: rng.integers(0, 9, n),
        CANDIDATE_TIMESTAMP: rng.integers(0, 10**9, n), DENSE: rng.normal(size=(n, 3)).astype(np.float64),
        LABEL: rng.integers(0, 2, n).astype(np.float32),
    }
    costs = rng.random(n)
    when = [(1, s) for s in range(sizes.size)]
    scales = [0.5, 1.0, 0.25, 2.0, 1.5]
    assembler = BatchAssembler([HISTORY_ITEMS, CANDIDATE_ITEM, USER_ID, SAMPLED_ITEMS], dense_dim=3, rank=1,
                               timestamps=True, sampled_items=4, num_items=50, seed=3)
    together = assembler.batches(arrays, StepRows(sizes, costs, scales, when))
    cuts = np.concatenate([[0], np.cumsum(sizes)])
    value_cuts = np.concatenate([[0], np.cumsum(history)])[cuts]
    for j, batch in enumerate(together):
        a, b, va, vb = cuts[j], cuts[j + 1], value_cuts[j], value_cuts[j + 1]
        alone = {key: values[va:vb] if key in (HISTORY_ITEMS, HISTORY_TIMESTAMPS) else values[a:b]
                 for key, values in arrays.items()}
        expected = assembler.batches(alone, StepRows(sizes[j:j + 1], costs[a:b], scales[j:j + 1], when[j:j + 1]))[0]
        assert same(batch, expected) and batch.size == sizes[j] and carries_its_per_key_counts(batch)
        if sizes[j]:
            assert batch.sparse[SAMPLED_ITEMS].lengths().tolist() == [4] + [0] * (int(sizes[j]) - 1)
            assert torch.equal(batch.sparse[HISTORY_ITEMS].values(), torch.from_numpy(arrays[HISTORY_ITEMS][va:vb]))
        for key in (CANDIDATE_ITEM, USER_ID):  # (each feature's values where the KJT's layout puts them)
            assert batch.sparse[key].values().tolist() == arrays[key][a:b].tolist()
            assert batch.sparse[key].lengths().tolist() == [1] * int(sizes[j])
        assert batch.sparse[HISTORY_ITEMS].lengths().tolist() == history[a:b].tolist()
    assert not together[1].sparse.values().numel() and together[1].dense.shape == (0, 3)
    # The history left uncut (its buffer, each sample's end in it: read_runs(uncut=True)) gives the same batches.
    buffer_gap = rng.integers(0, 50, 3 * int(history.sum()) + 10)
    ends = np.cumsum(history + 2) + 3  # runs apart in a larger buffer, with values between them
    for i, (end, length) in enumerate(zip(ends.tolist(), history.tolist())):
        a = int(np.concatenate([[0], np.cumsum(history)])[i])
        buffer_gap[end - length:end] = arrays[HISTORY_ITEMS][a:a + length]
    uncut = {key: value for key, value in arrays.items() if key != HISTORY_ITEMS}
    uncut[HISTORY_ITEMS + "@src"], uncut[HISTORY_ITEMS + "@end"] = buffer_gap.astype(np.int32), ends
    for batch, expected in zip(assembler.batches(uncut, StepRows(sizes, costs, scales, when)), together, strict=True):
        assert same(batch, expected) and carries_its_per_key_counts(batch)


def test_a_reads_values_buffer_is_written_again_only_once_no_batch_of_it_is_left() -> None:
    """The KJT values of a read's steps share one pooled buffer: never overwritten while any tensor of it lives
    (batches, a KJT kept alone, a values view), reused once none does, the pool bounded."""
    sizes = np.array([3, 4])

    def read(seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        history = rng.integers(1, 6, 7)
        return {HISTORY_ITEMS: rng.integers(0, 50, int(history.sum())), HISTORY_ITEMS + "@": history,
                CANDIDATE_ITEM: rng.integers(0, 50, 7), DENSE: np.zeros((7, 0)), LABEL: np.zeros(7, np.float32)}

    def steps() -> StepRows:
        return StepRows(sizes, np.ones(7), [1.0, 1.0], [(0, 0), (0, 1)])

    assembler = BatchAssembler([HISTORY_ITEMS, CANDIDATE_ITEM], dense_dim=0, rank=0, pool=BufferPool(keep=2))
    fresh = BatchAssembler([HISTORY_ITEMS, CANDIDATE_ITEM], dense_dim=0, rank=0)
    first = assembler.batches(read(0), steps())
    second = assembler.batches(read(1), steps())  # the first read's batches alive: another buffer
    first_at = first[0].sparse.values().data_ptr()
    assert second[0].sparse.values().data_ptr() != first_at
    assert all(same(a, b) for a, b in zip(first, fresh.batches(read(0), steps()), strict=True))
    kept_kjt, kept_values = second[1].sparse, second[0].sparse.values()[2:]  # pieces of the second read kept alone
    del first, second
    third = assembler.batches(read(2), steps())  # the first buffer is free again: written, and right
    assert third[0].sparse.values().data_ptr() == first_at
    assert all(same(a, b) for a, b in zip(third, fresh.batches(read(2), steps()), strict=True))
    fourth = assembler.batches(read(3), steps())  # both kept buffers held: a third one, not kept
    expected = fresh.batches(read(1), steps())
    assert torch.equal(kept_kjt.values(), expected[1].sparse.values())
    assert torch.equal(kept_values, expected[0].sparse.values()[2:])
    assert all(same(a, b) for a, b in zip(fourth, fresh.batches(read(3), steps()), strict=True))
    assert all(same(a, b) for a, b in zip(third, fresh.batches(read(2), steps()), strict=True))  # (not written over)
    assert assembler.pool.allocated == 3 and len(assembler.pool._buffers) == 2
    # Buffers reserved ahead (mapped on another thread at a loader's start) are taken as any freed one, within keep.
    pool = BufferPool(keep=3)
    assert pool.reserve(64, np.int64, 2) == 2 and pool.allocated == 2
    reserved = {buffer.ctypes.data for buffer, _ in pool._buffers}
    taken = [pool.take(40, np.int64), pool.take(64, np.int64)]
    assert {view.ctypes.data for view in taken} == reserved and pool.allocated == 2
    assert pool.take(65, np.int64).ctypes.data not in reserved and pool.allocated == 3  # (larger: a new one)
    assert pool.reserve(64, np.int64, 5) == 0  # (the pool keeps 3)


def test_the_prefetching_loader_reads_several_steps_at_once_and_hands_out_the_batches_of_one_at_a_time(
        tmp_path: Path) -> None:
    prepared(tmp_path, seed=1, interactions=4_000, users=150, items=80)
    features = [HISTORY_ITEMS, CANDIDATE_ITEM, USER_ID]
    runs = []
    for prefetch in (0, 3):
        cfg = DataConfig(path=str(tmp_path / "d"), batch_size=16, max_seq_len=10, prefetch=prefetch, shuffle_row_groups=3)
        loaders = [build_loader(cfg, "train", rank=r, world_size=2, sparse_features=features,
                                derived_cost=CostModel(1e-3, 0.37, 8.1), seed=7) for r in (0, 1)]  # (fractional
        # costs: each step's cost summed alike whatever the read it came in, bit for bit)
        reads: list[int] = []
        ahead: list[list[bool]] = [[], []]  # (each loader's reads planned while the read before them was copied)
        for loader, planned in zip(loaders, ahead):
            read_runs = loader.source.read_runs
            loader.source.read_runs = lambda runs, uncut=False, read_runs=read_runs, reads=reads: (  # type: ignore[method-assign]
                reads.append(len(runs)) or read_runs(runs, uncut))
            planned_ahead = loader._planned_ahead
            loader._planned_ahead = lambda *where, planned_ahead=planned_ahead, planned=planned: (  # type: ignore[method-assign]
                lambda plans: planned.append(plans is not None) or plans)(planned_ahead(*where))
        steps = []
        for _ in range(2 * loaders[0].steps_per_epoch):  # two epochs: a read never crosses into the next
            for loader in loaders:
                batch = loader.next_batch()
                info = loader.last
                assert info is not None
                steps.append((batch, info.rows.tolist(), info.rank_cost, info.row_lengths.tolist(), info.imbalance))
        for loader in loaders:
            loader.close()  # (lets go of its open files: a later read opens them again)
        again = loaders[1].batch_of(np.asarray(steps[1][1]), steps[1][0].loss_scale or 1.0, (0, 0))
        assert torch.equal(again.sparse.values(), steps[1][0].sparse.values()) and loaders[1].source._readers
        assert max(reads) == (1 if prefetch == 0 else READ_STEPS)
        for loader, planned in zip(loaders, ahead):
            copier = loader.assembler.copier
            if prefetch == 0:
                assert not any(planned) and copier is None
            else:  # (the first read's copy always tried on the copy thread; reads planned while their copy ran)
                assert copier is not None and copier.started >= 1 and copier.started + copier.inline > 4
                assert sum(planned) >= copier.started - 2
        runs.append(steps)
    assert len(runs[0]) == len(runs[1]) > 40
    for (a, *info_a), (b, *info_b) in zip(*runs):
        assert same(a, b) and info_a == info_b


def test_a_bad_row_in_a_read_of_several_steps_is_raised_at_its_own_step_after_the_steps_before_it(
        tmp_path: Path) -> None:
    users = 24
    items = [[1 + (u + j) % 9 for j in range(4)] for u in range(users)]
    labels = [[1.0] * 4 for _ in range(users)]
    labels[20][2] = 0.5  # user 20 sits in the 11th step of 2 users (4 samples), unshuffled
    directory = tmp_path / "d"
    directory.mkdir()
    pq.write_table(pa.table({
        "user_id": pa.array(range(users), pa.int64()), "item_ids": pa.array(items, pa.list_(pa.int64())),
        "timestamps": pa.array([[10, 20, 30, 40]] * users, pa.list_(pa.int64())),
        "labels": pa.array(labels, pa.list_(pa.float32())), "length": pa.array([4] * users, pa.int32()),
        "train_end": pa.array([3] * users, pa.int32())}), directory / "users-00000.parquet", row_group_size=1)
    DatasetManifest(num_items=10, num_users=users, dense_dim=0, max_len=4, format_version=2,
                    splits={"train": ["users-00000.parquet"]}).write(directory)
    handed_out = []
    for prefetch in (0, 2):
        cfg = DataConfig(path=str(directory), batch_size=4, shuffle=False, partitioner="round_robin", prefetch=prefetch)
        loader = build_loader(cfg, "train", rank=0, world_size=1, sparse_features=[HISTORY_ITEMS],
                              derived_cost=CostModel(1.0, 1.0, 1.0), seed=0)
        steps = 0
        with pytest.raises(DataError, match="row group 20: row 0: column 'labels'"):
            while True:
                loader.next_batch()
                steps += 1
        loader.close()
        handed_out.append(steps)
    assert handed_out == [10, 10]  # steps 0-9 (users 0-19), then user 20's step fails, with or without prefetch


def test_a_failure_only_reads_of_several_steps_meet_is_logged_and_every_step_still_handed_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    prepared(tmp_path, seed=2, interactions=2_000, users=80, items=50)
    batches = []
    for prefetch in (0, 2):
        cfg = DataConfig(path=str(tmp_path / "d"), batch_size=16, max_seq_len=10, prefetch=prefetch)
        loader = build_loader(cfg, "train", rank=0, world_size=1, sparse_features=[HISTORY_ITEMS],
                              derived_cost=CostModel(1.0, 2.0, 8.0), seed=3)
        read_runs = loader.source.read_runs

        def only_one_step(runs: list[np.ndarray], uncut=False, read_runs=read_runs) -> object:  # type: ignore[no-untyped-def]
            if len(runs) > 1:
                raise MemoryError("a read of several steps")
            return read_runs(runs, uncut)

        loader.source.read_runs = only_one_step  # type: ignore[method-assign]
        with caplog.at_level("WARNING", logger="freescale.dataloader"):
            batches.append([loader.next_batch().sparse.values() for _ in range(loader.steps_per_epoch)])
        loader.close()
    assert len(batches[1]) == len(batches[0]) > 10
    assert all(torch.equal(a, b) for a, b in zip(*batches))
    assert any("a read of several steps failed where each step alone did not" in r.message for r in caplog.records)


def test_a_read_copied_on_the_copy_thread_waits_for_it_on_failure_and_the_thread_is_set_aside_when_it_does_not_pay(
        ) -> None:
    class SlowExecutor(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            def slowly() -> Any:
                time.sleep(0.3)
                return fn(*args, **kwargs)
            self.last = super().submit(slowly)
            return self.last

    history = np.array([2, 3, 1])
    arrays = {HISTORY_ITEMS + "@src": np.arange(20), HISTORY_ITEMS + "@end": np.array([5, 9, 12]),
              HISTORY_ITEMS + "@": history, CANDIDATE_ITEM: np.array([1, 2, 3]), DENSE: np.zeros((3, 0))}
    good = {**arrays, LABEL: np.ones(3, dtype=np.float32)}
    copier, slow = CopyThread(), SlowExecutor(1)
    copier._executor = slow
    assembler = BatchAssembler([HISTORY_ITEMS, CANDIDATE_ITEM], dense_dim=0, rank=0, copier=copier)
    steps = StepRows(np.array([2, 1]), np.ones(3), [1.0, 1.0], [(0, 0), (0, 1)])
    with pytest.raises(KeyError):  # (no labels: the batches fail after the copy started)
        assembler.start_batches(arrays, steps)
    assert slow.last.done()  # (not left writing into a buffer the pool may hand out again)
    assert (copier.started, copier.inline) == (1, 0)
    for _ in range(INLINE_READS):  # (it waited longer than the copy took: the next reads copy here)
        batches = assembler.batches(good, steps)
        assert batches[0].sparse[HISTORY_ITEMS].values().tolist() == [3, 4, 6, 7, 8]
        assert batches[1].sparse[HISTORY_ITEMS].values().tolist() == [11]
    assert (copier.started, copier.inline) == (1, INLINE_READS)
    copier.close()
    busy, release = ThreadPoolExecutor(1), threading.Event()
    busy.submit(release.wait, 10)  # (its one thread taken: the copy never starts there, the caller makes it)
    copier._executor = busy
    copier._inline_left = 0
    batches = assembler.batches(good, steps)
    assert batches[0].sparse[HISTORY_ITEMS].values().tolist() == [3, 4, 6, 7, 8] and not release.is_set()
    assert (copier.started, copier._inline_left) == (2, INLINE_READS)
    release.set()
    copier.close()
