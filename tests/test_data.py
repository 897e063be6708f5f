from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from freescale.dataloader.cost import CostModel
from freescale.dataloader import DataError, DatasetManifest, SyntheticSpec, generate, sample_schema
from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.loader import BalancedLoader
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, HISTORY_LENGTH, LABEL, USER_ID

ALL_FEATURES = [HISTORY_ITEMS, CANDIDATE_ITEM, USER_ID]


def loader(path: Path, *, world_size: int = 1, rank: int = 0, **cfg: object) -> BalancedLoader:
    """A training loader over ``path`` (prefetch off unless asked, so errors surface at once)."""
    config = DataConfig(path=str(path), batch_size=64, prefetch=0)
    for key, value in cfg.items():
        setattr(config, key, value)
    return build_loader(config, "train", rank=rank, world_size=world_size, sparse_features=ALL_FEATURES,
                        derived_cost=CostModel(1.0, 1.0, 1.0), seed=0)


def test_generator_is_deterministic_and_matches_schema(tmp_path: Path) -> None:
    spec = SyntheticSpec(rows=3_000, eval_rows=500, max_len=32, seed=7)
    a, b = generate(tmp_path / "a", spec), generate(tmp_path / "b", spec)
    assert a.splits == b.splits == {"train": ["train-00000.parquet"], "eval": ["eval-00000.parquet"]}
    ta, tb = pq.read_table(tmp_path / "a" / "train-00000.parquet"), pq.read_table(tmp_path / "b" / "train-00000.parquet")
    assert ta.equals(tb)
    assert ta.schema.equals(sample_schema(spec.dense_dim).append(pa.field(HISTORY_LENGTH, pa.int32(), nullable=False)))
    assert ta.column(HISTORY_LENGTH).to_numpy().tolist() == pc.list_value_length(ta.column(HISTORY_ITEMS)).to_numpy().tolist()
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
    with pytest.raises(ValueError, match="gen-data: lengths: must be one of ml-1m, ml-20m, zipf, uniform"):
        generate(tmp_path, SyntheticSpec(lengths="pareto"))


# ----- bad input ---------------------------------------------------------------------
def write_dataset(directory: Path, table: pa.Table, dense_dim: int = 2, num_items: int = 10) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / "train-00000.parquet")
    DatasetManifest(
        num_items=num_items, num_users=10, dense_dim=dense_dim, max_len=8, splits={"train": ["train-00000.parquet"]}
    ).write(directory)
    return directory


def good_columns(n: int = 4) -> dict[str, pa.Array]:
    histories = [[1, 2], [3], [7], [4, 5, 6]][:n]
    return {
        "user_id": pa.array(list(range(n)), pa.int64()),
        "history_item_ids": pa.array(histories, pa.list_(pa.int64())),
        "history_timestamps": pa.array(histories, pa.list_(pa.int64())),
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
    if "history_item_ids" in changes and "history_timestamps" not in changes:
        cols["history_timestamps"] = cols["history_item_ids"]  # keep the two lists consistent
    return pa.table(cols)


def test_good_small_dataset_reads_without_a_length_column(tmp_path: Path) -> None:
    d = write_dataset(tmp_path / "ok", table_with())
    batch = loader(d, batch_size=4, shuffle=False, partitioner="round_robin").next_batch()
    assert sorted(batch.sparse[HISTORY_ITEMS].lengths().tolist()) == [1, 1, 2, 3]


BAD_ROWS = [
    ({"history_item_ids": pa.array([[1], None, [2], [3]], pa.list_(pa.int64()))}, "row 1: column 'history_item_ids': null value"),
    ({"history_item_ids": pa.array([[1], [], [2], [3]], pa.list_(pa.int64()))}, "row 1: column 'history_item_ids': empty history"),
    ({"history_item_ids": pa.array([[1], [2, -3], [2], [3]], pa.list_(pa.int64()))}, "row 1: column 'history_item_ids': negative id -3"),
    ({"candidate_item_id": pa.array([1, 10, 3, 4], pa.int64())}, "row 1: column 'candidate_item_id': id 10 is >= the table size num_items=10"),
    ({"user_id": pa.array([0, 12, 1, 2], pa.int64())}, "row 1: column 'user_id': id 12 is >= the table size num_users=10"),
    ({"label": pa.array([0.0, float("nan"), 1.0, 0.0], pa.float32())}, "row 1: column 'label': is nan; labels must be 0 or 1"),
    ({"label": pa.array([0.0, 2.0, 1.0, 0.0], pa.float32())}, "row 1: column 'label': is 2.0; labels must be 0 or 1"),
    ({"history_timestamps": pa.array([[1], [3], [7], [4, 5, 6]], pa.list_(pa.int64()))}, "row 0: column 'history_timestamps': length differs"),
    ({"history_length": pa.array([2, 1, 9, 3], pa.int32())}, "row 2: column 'history_length': differs from the length"),
    ({"history_item_ids": pa.array([[1], [2], [3], [4, None, 6]], pa.list_(pa.int64()))},
     "row 3: column 'history_item_ids': null element (at position 1 of the list)"),
    ({"history_timestamps": pa.array([[1, 2], [3], [7], [6, 5, 6]], pa.list_(pa.int64()))},
     "row 3: column 'history_timestamps': timestamps go back in time (6 then 5); they must be oldest first"),
    ({"dense_features": pa.FixedSizeListArray.from_arrays(pa.array([0.5, 0.5, 0.5, float("inf"), 0, 0, 0, 0], pa.float32()), 2)},
     "row 1: column 'dense_features': is inf (not finite)"),
    ({"dense_features": pa.FixedSizeListArray.from_arrays(pa.array([0.5, 0.5, 0.5, 0.5, float("nan"), 0, 0, 0], pa.float32()), 2)},
     "row 2: column 'dense_features': is nan (not finite)"),
]


@pytest.mark.parametrize(("changes", "needle"), BAD_ROWS)
def test_bad_rows_name_file_row_group_row_and_column(tmp_path: Path, changes: dict[str, pa.Array | None], needle: str) -> None:
    d = write_dataset(tmp_path / "bad", table_with(**changes))
    with pytest.raises(DataError) as info:
        loader(d, batch_size=4).next_batch()
    assert str(info.value).endswith(needle) or needle in str(info.value)
    assert "train-00000.parquet: row group 0: " in str(info.value)


@pytest.mark.parametrize(("changes", "needle"), BAD_ROWS)
def test_skip_mode_drops_and_counts_bad_rows(tmp_path: Path, changes: dict[str, pa.Array | None], needle: str) -> None:
    d = write_dataset(tmp_path / "bad", table_with(**changes))
    batches = loader(d, batch_size=2, world_size=1, on_bad_rows="skip", shuffle=False, partitioner="round_robin")
    seen = batches.next_batch().size + batches.next_batch().size
    assert seen == 3 and sum(batches.source.skipped.values()) == 1
    assert batches.state_dict()["skipped"]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"label": None}, "missing column 'label'"),
        ({"candidate_item_id": pa.array([1, 2, 3, 4], pa.int32())}, "column 'candidate_item_id' has type int32, expected int64"),
        ({"history_length": pa.array([2, 1, 1, 3], pa.int64())}, "column 'history_length' has type int64, expected int32"),
    ],
)
def test_schema_problems_are_named_at_open(tmp_path: Path, changes: dict[str, pa.Array | None], needle: str) -> None:
    d = write_dataset(tmp_path / "bad", table_with(**changes))
    with pytest.raises(DataError, match="train-00000.parquet: " + needle):
        loader(d, batch_size=2)


def test_corrupt_parquet_is_named(tmp_path: Path) -> None:
    d = write_dataset(tmp_path / "corrupt", table_with())
    path = d / "train-00000.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match=r"train-00000.parquet: not a readable Parquet file"):
        loader(d, batch_size=2)


def test_missing_path_manifest_and_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data path not found: .*nowhere \(create one with `freescale gen-data"):
        loader(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no dataset.json"):
        loader(tmp_path / "empty")
    (tmp_path / "ratings.csv").write_text("u,i,t\n1,2,3\n")  # an interaction log given as the dataset
    with pytest.raises(DataError, match=r"ratings.csv: a file, not a dataset directory; .* `freescale prepare "):
        loader(tmp_path / "ratings.csv")
    d = write_dataset(tmp_path / "gone", table_with())
    (d / "train-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"train-00000.parquet: listed in dataset.json split 'train' but missing"):
        loader(d)


def test_too_few_rows_for_one_global_batch(tmp_path: Path) -> None:
    d = write_dataset(tmp_path / "small", table_with())
    with pytest.raises(DataError, match=r"the split has 4 rows, fewer than one global batch \(8\)"):
        loader(d, batch_size=4, world_size=2)
