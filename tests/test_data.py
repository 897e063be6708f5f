from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from freescale.dataloader import DataError, DatasetManifest, SyntheticSpec, generate, sample_schema
from freescale.dataloader.reader import ParquetSequenceReader, _truncate_recent
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, LABEL, USER_ID

ALL_FEATURES = [HISTORY_ITEMS, CANDIDATE_ITEM, USER_ID]


def reader(path: Path, **kw: object) -> ParquetSequenceReader:
    args: dict[str, object] = dict(batch_size=64, max_seq_len=64, sparse_features=ALL_FEATURES)
    args.update(kw)
    return ParquetSequenceReader(path, "train", **args)  # type: ignore[arg-type]


def test_generator_is_deterministic_and_matches_schema(tmp_path: Path) -> None:
    spec = SyntheticSpec(rows=3_000, eval_rows=500, max_len=32, seed=7)
    a, b = generate(tmp_path / "a", spec), generate(tmp_path / "b", spec)
    assert a.splits == b.splits == {"train": ["train-00000.parquet"], "eval": ["eval-00000.parquet"]}
    ta, tb = pq.read_table(tmp_path / "a" / "train-00000.parquet"), pq.read_table(tmp_path / "b" / "train-00000.parquet")
    assert ta.equals(tb)
    assert ta.schema.equals(sample_schema(spec.dense_dim))
    lengths = pc.list_value_length(ta.column(HISTORY_ITEMS)).to_numpy()
    assert lengths.min() >= 1 and lengths.max() <= 32
    assert pc.list_value_length(ta.column("history_timestamps")).to_numpy().tolist() == lengths.tolist()
    other = generate(tmp_path / "c", SyntheticSpec(rows=3_000, eval_rows=500, max_len=32, seed=8))
    assert not pq.read_table(tmp_path / "c" / "train-00000.parquet").equals(ta)
    assert other.num_items == spec.num_items


def test_planted_signal_is_present(tmp_path: Path) -> None:
    spec = SyntheticSpec(rows=20_000, eval_rows=0, seed=1)
    generate(tmp_path, spec)
    table = pq.read_table(tmp_path / "train-00000.parquet")
    k = spec.num_categories
    history = table.column(HISTORY_ITEMS).combine_chunks()
    offsets = history.offsets.to_numpy()
    flat_category = history.flatten().to_numpy() % k
    # The user's preferred category is the most common one in the history.
    first = flat_category[offsets[:-1]]
    candidate_category = table.column(CANDIDATE_ITEM).to_numpy() % k
    label = table.column(LABEL).to_numpy()
    match = candidate_category == first
    assert label[match].mean() > 0.7 > 0.3 > label[~match].mean()


def test_generator_rejects_bad_spec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gen-data: lengths: must be one of ml-1m, ml-20m, uniform"):
        generate(tmp_path, SyntheticSpec(lengths="pareto"))


def test_each_sample_exactly_once_per_epoch_across_ranks(tiny_data: Path) -> None:
    world = 3
    readers = [reader(tiny_data, rank=r, world_size=world, sparse_features=[USER_ID], seed=5) for r in range(world)]
    steps = readers[0].steps_per_epoch
    seen = np.concatenate([r.rows_for(0, s) for r in readers for s in range(steps)])
    assert len(seen) == steps * 64 * world
    assert len(np.unique(seen)) == len(seen)
    assert readers[0].num_rows - len(seen) < 64 * world  # only the partial last batch is dropped
    # A new epoch is a different order of the same rows.
    assert not np.array_equal(readers[0].rows_for(1, 0), readers[0].rows_for(0, 0))


def test_batch_matches_the_rows_it_came_from(tiny_data: Path) -> None:
    r = reader(tiny_data, max_seq_len=16, shuffle=False)
    batch = r.next_batch()
    table = pq.read_table(tiny_data / "train-00000.parquet").slice(0, 64)
    kjt = batch.sparse
    assert kjt.keys() == ALL_FEATURES
    history = kjt[HISTORY_ITEMS]
    for i in (0, 5, 63):
        full = table.column(HISTORY_ITEMS)[i].as_py()
        start, end = int(history.offsets()[i]), int(history.offsets()[i + 1])
        assert history.values()[start:end].tolist() == full[-16:]
    assert kjt[CANDIDATE_ITEM].values().tolist() == table.column(CANDIDATE_ITEM).to_pylist()
    assert kjt[USER_ID].values().tolist() == table.column(USER_ID).to_pylist()
    assert batch.labels.tolist() == table.column(LABEL).to_pylist()
    assert batch.dense.shape == (64, 8)
    np.testing.assert_array_equal(batch.dense[3].numpy(), np.array(table.column("dense_features")[3].as_py(), np.float32))


def test_truncate_recent_keeps_the_last_items() -> None:
    values = np.arange(10)
    out, lengths = _truncate_recent(values, np.array([4, 0, 1, 5]), 2)
    assert lengths.tolist() == [2, 0, 1, 2]
    assert out.tolist() == [2, 3, 4, 8, 9]


def test_state_dict_resumes_where_it_stopped(tiny_data: Path) -> None:
    steps = reader(tiny_data).steps_per_epoch
    straight = reader(tiny_data)
    expected = [straight.next_batch() for _ in range(steps + 3)]
    first = reader(tiny_data)
    for _ in range(steps - 2):
        first.next_batch()
    resumed = reader(tiny_data)
    resumed.load_state_dict(first.state_dict())
    for want in expected[steps - 2 :]:
        got = resumed.next_batch()
        assert got.labels.tolist() == want.labels.tolist()
        assert got.sparse.values().tolist() == want.sparse.values().tolist()
    assert resumed.epoch == 1
    with pytest.raises(DataError, match="global batch 64.*uses 128"):
        reader(tiny_data, batch_size=128).load_state_dict(first.state_dict())


# ----- bad input ---------------------------------------------------------------------
def write_dataset(directory: Path, table: pa.Table, dense_dim: int = 2, num_items: int = 10) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / "train-00000.parquet")
    DatasetManifest(
        num_items=num_items, num_users=10, dense_dim=dense_dim, max_len=8, splits={"train": ["train-00000.parquet"]}
    ).write(directory)
    return directory


def good_columns(n: int = 4) -> dict[str, pa.Array]:
    return {
        "user_id": pa.array(list(range(n)), pa.int64()),
        "history_item_ids": pa.array([[1, 2], [3], [], [4, 5, 6]][:n], pa.list_(pa.int64())),
        "history_timestamps": pa.array([[1, 2], [3], [], [4, 5, 6]][:n], pa.list_(pa.int64())),
        "candidate_item_id": pa.array([1, 2, 3, 4][:n], pa.int64()),
        "dense_features": pa.FixedSizeListArray.from_arrays(pa.array([0.5] * 2 * n, pa.float32()), 2),
        "label": pa.array([0.0, 1.0, 1.0, 0.0][:n], pa.float32()),
    }


def table_with(**changes: pa.Array | None) -> pa.Table:
    cols = good_columns()
    for key, value in changes.items():
        if value is None:
            del cols[key]
        else:
            cols[key] = value
    return pa.table(cols)


def test_good_small_dataset_reads(tmp_path: Path) -> None:
    d = write_dataset(tmp_path / "ok", table_with())
    batch = reader(d, batch_size=4, shuffle=False).next_batch()
    assert batch.sparse[HISTORY_ITEMS].lengths().tolist() == [2, 1, 0, 3]  # empty history is allowed


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"label": None}, "missing column 'label'"),
        ({"candidate_item_id": pa.array([1, 2, 3, 4], pa.int32())}, "column 'candidate_item_id' has type int32, expected int64"),
        ({"history_item_ids": pa.array([[1], None, [2], [3]], pa.list_(pa.int64()))}, "column 'history_item_ids' has 1 null value(s)"),
        ({"history_item_ids": pa.array([[1], [-3], [2], [3]], pa.list_(pa.int64()))}, "column 'history_item_ids': negative id -3"),
        ({"candidate_item_id": pa.array([1, 2, 10, 4], pa.int64())}, "column 'candidate_item_id': id 10 is >= the table size num_items=10"),
        ({"label": pa.array([0.0, float("nan"), 1.0, 0.0], pa.float32())}, "column 'label' row 1 is nan"),
        ({"label": pa.array([0.0, 2.0, 1.0, 0.0], pa.float32())}, "column 'label' row 1 is 2.0"),
    ],
)
def test_bad_rows_are_named(tmp_path: Path, changes: dict[str, pa.Array | None], needle: str) -> None:
    d = write_dataset(tmp_path / "bad", table_with(**changes))
    with pytest.raises(DataError) as info:
        reader(d, batch_size=2)
    message = str(info.value)
    assert "train-00000.parquet" in message and needle in message


def test_corrupt_parquet_is_named(tmp_path: Path) -> None:
    d = write_dataset(tmp_path / "corrupt", table_with())
    path = d / "train-00000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match=r"train-00000.parquet: not a readable Parquet file"):
        reader(d, batch_size=2)


def test_missing_path_manifest_and_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data path not found: .*nowhere \(create one with `freescale gen-data"):
        reader(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no dataset.json"):
        reader(tmp_path / "empty")
    d = write_dataset(tmp_path / "gone", table_with())
    (d / "train-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"train-00000.parquet: listed in dataset.json split 'train' but missing"):
        reader(d)


def test_too_few_rows_for_one_global_batch(tmp_path: Path) -> None:
    d = write_dataset(tmp_path / "small", table_with())
    with pytest.raises(DataError, match=r"has 4 rows, fewer than one global batch \(4 per rank x 2 ranks = 8\)"):
        reader(d, batch_size=4, world_size=2)
