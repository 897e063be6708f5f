"""BalancedLoader: exactly once, resumable, live-rank changes, prefetch, two real processes."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from freescale.dataloader.cost import CostModel
from freescale.dataloader.loader import BalancedLoader, DataConfig, build_loader
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, DataError
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
@pytest.mark.parametrize("window", [1, 4])
def test_resume_mid_epoch_equals_uninterrupted(tiny_data: Path, prefetch: int, window: int) -> None:
    straight = consume(make(tiny_data, prefetch=prefetch, window=window), 14)
    first = make(tiny_data, prefetch=prefetch, window=window)
    consume(first, 9)
    state = first.state_dict()
    first.close()
    resumed = make(tiny_data, prefetch=prefetch, window=window)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(consume(resumed, 5), straight[9:]))
    resumed.close()


def test_batch_fields_and_loss_scale(tiny_data: Path) -> None:
    loader = make(tiny_data, prefetch=0)
    batch = loader.next_batch()
    info = loader.last
    assert info is not None and batch.costs is not None and batch.costs.shape == (batch.size,)
    assert batch.loss_scale == pytest.approx(2 / info.global_size)
    assert info.global_size == 64 and 1.0 <= info.bound <= info.imbalance + 1e-9


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
