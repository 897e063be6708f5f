"""Format 2's cheap screen (``SequenceSource.passes_checks``) against the row checks it stands in for: on clean row
groups and on every kind of bad one, it passes exactly the row groups in which ``row_problems`` finds nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from freescale.dataloader.schema import DatasetManifest, sequence_schema
from freescale.dataloader.sequence_source import SequenceSource

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
