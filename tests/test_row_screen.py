"""The sources' cheap screen (``passes_checks``, both layouts) against the row checks it stands in for: on clean row
groups and on every kind of bad one, it passes exactly the row groups in which ``row_problems`` finds nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.dataloader import row_checks as rc
from freescale.dataloader.schema import HISTORY_LENGTH, DatasetManifest, sample_schema, sequence_schema
from freescale.dataloader.sequence_source import SequenceSource, _locate
from freescale.dataloader.source import ParquetSource

NUM_USERS, NUM_ITEMS, DENSE_DIM = 50, 100, 2


def user_rows(rng: np.random.Generator, users: int) -> dict[str, list[object]]:
    lengths = rng.integers(0, 7, users)
    times = [np.sort(rng.integers(0, 1_000, n)).tolist() for n in lengths]  # each user's own, oldest first
    return {
        "user_id": rng.integers(0, NUM_USERS, users).tolist(),
        "item_ids": [rng.integers(0, NUM_ITEMS, n).tolist() for n in lengths],
        "timestamps": times,
        "labels": [rng.integers(0, 2, n).astype(float).tolist() for n in lengths],
        "dense_features": [rng.normal(size=(n, DENSE_DIM)).tolist() for n in lengths],
        "length": lengths.tolist(), "train_end": lengths.tolist(), "valid_end": lengths.tolist(),
    }


def spoil(rows: dict[str, list[object]], rng: np.random.Generator) -> str:
    """One fault (or a harmless change) in a random user's row; what it was."""
    u = int(rng.integers(len(rows["user_id"])))
    n = int(rows["length"][u])  # type: ignore[arg-type]
    lists = {name: rows[name][u] for name in ("item_ids", "timestamps", "labels", "dense_features")}
    kind = str(rng.choice(["user_null", "user_range", "item_range", "item_negative", "item_null", "label", "label_null",
                           "time_back", "length", "short_list", "dense_nan", "dense_inf", "dense_null", "list_null",
                           "none"]))
    if kind == "user_null":
        rows["user_id"][u] = None
    elif kind == "user_range":
        rows["user_id"][u] = int(rng.choice([-1, NUM_USERS]))
    elif kind == "list_null":
        rows[str(rng.choice(["item_ids", "timestamps", "labels", "dense_features"]))][u] = None
    elif kind == "length":
        rows["length"][u] = n + 1
    elif kind == "short_list":
        name = str(rng.choice(["timestamps", "labels", "dense_features"]))
        rows[name][u] = list(lists[name]) + list(lists[name][-1:] or [[0.0] * DENSE_DIM if name == "dense_features" else 0])  # type: ignore[call-overload]
    elif n == 0:
        return "none"
    else:
        i = int(rng.integers(n))
        value: object = {"item_range": NUM_ITEMS, "item_negative": -3, "item_null": None, "label": 0.5,
                         "label_null": None, "dense_nan": float("nan"), "dense_inf": float("inf"),
                         "dense_null": None, "time_back": None}.get(kind)
        if kind.startswith("item"):
            lists["item_ids"][i] = value  # type: ignore[index]
        elif kind.startswith("label"):
            lists["labels"][i] = value  # type: ignore[index]
        elif kind.startswith("dense"):
            lists["dense_features"][i] = None if value is None else [value] * DENSE_DIM  # type: ignore[index]
        elif kind == "time_back" and n > 1:
            lists["timestamps"][max(i, 1)] = lists["timestamps"][max(i, 1) - 1] - 1  # type: ignore[index,operator]
        else:
            return "none"
    return kind


def test_the_screen_passes_exactly_the_row_groups_without_a_problem(tmp_path: Path) -> None:
    schema = sequence_schema(DENSE_DIM)
    rng = np.random.default_rng(0)
    directory = tmp_path / "d"
    directory.mkdir()
    pq.write_table(pa.table(user_rows(rng, 8), schema=schema), directory / "users-00000.parquet")
    DatasetManifest(num_items=NUM_ITEMS, num_users=NUM_USERS, dense_dim=DENSE_DIM, max_len=8, format_version=2,
                    splits={"train": ["users-00000.parquet"]}).write(directory)
    source = SequenceSource(str(directory), "train", ["user_id", "history_item_ids"], max_seq_len=8)
    seen: dict[tuple[str, bool], int] = {}
    for _ in range(600):
        rows = user_rows(rng, int(rng.integers(1, 12)))
        kind = spoil(rows, rng) if rng.random() < 0.7 else "none"
        table = pa.table(rows, schema=schema)
        if rng.random() < 0.3 and table.num_rows > 2:  # a slice: offsets that do not start at 0
            table = table.slice(1, table.num_rows - 2)
        table = table.select(source.decode_columns)
        clean = not source.row_problems(table)
        assert source.passes_checks(table) == clean, (kind, table.to_pylist())
        seen[(kind, clean)] = seen.get((kind, clean), 0) + 1
    assert seen[("none", True)] > 100  # the screen is exercised where it must pass, not only where it fails
    faults = {kind for kind, clean in seen if not clean}
    assert faults >= {"user_null", "user_range", "item_range", "item_negative", "item_null", "label", "label_null",
                      "time_back", "length", "short_list", "dense_nan", "dense_inf", "dense_null", "list_null"}


def sample_rows(rng: np.random.Generator, rows: int, with_length: bool) -> dict[str, list[object]]:
    """Format 1: one sample a row, every history non-empty and oldest first."""
    lengths = rng.integers(1, 6, rows)
    out: dict[str, list[object]] = {
        "user_id": rng.integers(0, NUM_USERS, rows).tolist(),
        "history_item_ids": [rng.integers(0, NUM_ITEMS, n).tolist() for n in lengths],
        "history_timestamps": [np.sort(rng.integers(0, 1_000, n)).tolist() for n in lengths],
        "candidate_item_id": rng.integers(0, NUM_ITEMS, rows).tolist(),
        "dense_features": rng.normal(size=(rows, DENSE_DIM)).tolist(),
        "label": rng.integers(0, 2, rows).astype(float).tolist(),
    }
    if with_length:
        out["history_length"] = lengths.tolist()
    return out


def spoil_sample(rows: dict[str, list[object]], rng: np.random.Generator) -> str:
    """One fault (or none) in a random row of format 1; what it was."""
    r = int(rng.integers(len(rows["user_id"])))
    history, times = rows["history_item_ids"][r], rows["history_timestamps"][r]
    kind = str(rng.choice(["null", "empty", "item_range", "item_null", "candidate_range", "user_range", "label",
                           "time_back", "time_short", "time_null", "dense_nan", "dense_null", "length", "none"]))
    if kind == "null":
        rows[str(rng.choice(list(rows)))][r] = None
    elif kind == "empty":
        rows["history_item_ids"][r], rows["history_timestamps"][r] = [], []
        if "history_length" in rows:
            rows["history_length"][r] = 0
    elif kind in ("item_range", "item_null"):
        history[int(rng.integers(len(history)))] = NUM_ITEMS if kind == "item_range" else None  # type: ignore[index,arg-type]
    elif kind == "candidate_range":
        rows["candidate_item_id"][r] = -1
    elif kind == "user_range":
        rows["user_id"][r] = NUM_USERS
    elif kind == "label":
        rows["label"][r] = 2.0
    elif kind == "time_back" and len(times) > 1:  # type: ignore[arg-type]
        times[1] = times[0] - 1  # type: ignore[index,operator]
    elif kind == "time_short":
        rows["history_timestamps"][r] = list(times)[:-1]  # type: ignore[call-overload]
    elif kind == "time_null":
        times[0] = None  # type: ignore[index]
    elif kind in ("dense_nan", "dense_null"):
        rows["dense_features"][r] = [float("nan") if kind == "dense_nan" else None] * DENSE_DIM
    elif kind == "length" and "history_length" in rows:
        rows["history_length"][r] = len(history) + 1  # type: ignore[arg-type]
    else:
        return "none"
    return kind


def test_the_screen_of_format_1_passes_exactly_the_row_groups_without_a_problem(tmp_path: Path) -> None:
    schema = sample_schema(DENSE_DIM)
    rng = np.random.default_rng(1)
    directory = tmp_path / "d"
    directory.mkdir()
    pq.write_table(pa.table(sample_rows(rng, 8, False), schema=schema), directory / "train-00000.parquet")
    DatasetManifest(num_items=NUM_ITEMS, num_users=NUM_USERS, dense_dim=DENSE_DIM, max_len=8,
                    splits={"train": ["train-00000.parquet"]}).write(directory)
    source = ParquetSource(str(directory), "train", ["user_id", "history_item_ids"])
    seen: dict[tuple[str, bool], int] = {}
    for _ in range(600):
        with_length = bool(rng.random() < 0.5)
        rows = sample_rows(rng, int(rng.integers(1, 12)), with_length)
        kind = spoil_sample(rows, rng) if rng.random() < 0.7 else "none"
        table = pa.table(rows, schema=schema.append(pa.field(HISTORY_LENGTH, pa.int32())) if with_length else schema)
        if rng.random() < 0.3 and table.num_rows > 2:
            table = table.slice(1, table.num_rows - 2)
        clean = not source.row_problems(table)
        assert source.passes_checks(table) == clean, (kind, table.to_pylist())
        seen[(kind, clean)] = seen.get((kind, clean), 0) + 1
    assert seen[("none", True)] > 100
    assert {kind for kind, clean in seen if not clean} >= {
        "null", "empty", "item_range", "item_null", "candidate_range", "user_range", "label", "time_back", "time_short",
        "time_null", "dense_nan", "dense_null", "length"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 40), max_size=60), st.lists(st.integers(0, 8), max_size=8), st.booleans())
def test_the_screens_compiled_passes_answer_as_numpy_does(values: list[int], cuts: list[int], readonly: bool) -> None:
    """``in_range``, ``binary`` and ``ordered_within`` (one compiled pass each, stopping at the first bad value) against
    the numpy expressions they replace, on read-only arrays too (what pyarrow hands over)."""
    array = np.asarray(values, dtype=np.int64)
    array.flags.writeable = not readonly
    lengths = np.asarray(cuts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    starts = np.minimum(starts, array.size) if array.size else np.zeros(1, dtype=np.int64)
    starts = np.append(starts, array.size) if starts[-1] != array.size else starts
    assert rc.in_range(array, 30) == (not array.size or bool(array.min() >= 0 and array.max() < 30))
    assert rc.binary(array.astype(np.float32)) == bool(np.isin(array, (0, 1)).all())
    inside = [bool((np.diff(array[a:b]) >= 0).all()) for a, b in zip(starts[:-1], starts[1:])]
    assert rc.ordered_within(array, starts) == all(inside)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.lists(st.integers(0, 4), min_size=1, max_size=12),
       st.lists(st.lists(st.integers(0, 10**6), max_size=40), max_size=6))
def test_samples_are_located_as_two_searches_and_a_unique_do(per_user: list[int], users_per_group: list[int],
                                                            runs: list[list[int]]) -> None:
    """``_locate`` (walking on from the last sample's user, a binary search at a run's start or past a few users)
    against numpy's ``searchsorted`` and ``unique``: users with no samples, row groups with no users, runs each
    ascending but not across each other (``read_runs``), no samples at all."""
    user_start = np.concatenate([[0], np.cumsum(per_user)]).astype(np.int64)
    stored_start = np.concatenate([[0], np.cumsum(users_per_group)]).astype(np.int64)
    stored_start = np.append(stored_start[stored_start < len(per_user)], len(per_user))
    total = int(user_start[-1])
    if not total:
        runs = []
    samples = np.concatenate([np.sort(np.asarray(run, dtype=np.int64) % total) for run in runs] or
                             [np.zeros(0, dtype=np.int64)]).astype(np.int64)
    user, group, needed = _locate(samples, user_start, stored_start)
    expected_user = np.searchsorted(user_start, samples, side="right") - 1
    expected_group = np.searchsorted(stored_start, expected_user, side="right") - 1
    assert np.array_equal(user, expected_user) and np.array_equal(group, expected_group)
    assert np.array_equal(needed, np.unique(expected_group))
