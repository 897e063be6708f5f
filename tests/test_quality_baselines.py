"""``benchmarks/quality_baselines.py``: each baseline is fit on training positions only and scores exactly the
held-out items; the order-2 model sees what order 1 cannot; equal scores count as a random order."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from quality_baselines import baselines, positions, ranked, users_of


def _data(tmp_path: Path, sequences: list[list[int]]) -> Path:
    """Format-2 users: training, then one validation, then one test interaction each."""
    lengths = [len(s) for s in sequences]
    pq.write_table(pa.table({
        "item_ids": pa.array(sequences, pa.list_(pa.int64())),
        "labels": pa.array([[1.0] * n for n in lengths], pa.list_(pa.float32())),
        "length": pa.array(lengths, pa.int32()),
        "train_end": pa.array([n - 2 for n in lengths], pa.int32()),
        "valid_end": pa.array([n - 1 for n in lengths], pa.int32()),
    }), tmp_path / "users-00000.parquet")
    return tmp_path


def test_splits_are_disjoint_and_training_holds_no_held_out_item(tmp_path: Path) -> None:
    u = users_of(_data(tmp_path, [[0, 1, 2, 3, 4], [5, 6, 7]]))
    test, train = positions(u)
    valid, _ = positions(u, "valid")
    assert test.tolist() == [4, 7] and valid.tolist() == [3, 6] and train.tolist() == [1, 2]
    assert not set(train) & (set(test) | set(valid))


def test_order_two_breaks_what_order_one_leaves_tied(tmp_path: Path) -> None:
    """Users (7, 1, 2, 3, 1, 2 | 3) and (7, 4, 2, 5, 4, 2 | 5), ten of each (the last two: validation, test).
    Training holds (1, 2) -> 3 and (4, 2) -> 5 as often: after 2 alone, 3 and 5 tie; the item before tells them
    apart."""
    users = [[7, 1, 2, 3, 1, 2, 3], [7, 4, 2, 5, 4, 2, 5]] * 10
    u = users_of(_data(tmp_path, users))
    test, train = positions(u)
    assert set(u["items"][test].tolist()) == {3, 5} and set(u["items"][test - 1].tolist()) == {2}
    assert max(train - np.repeat(u["start"], u["length"])[train]) == 4  # training stops before the validation item
    out = baselines(u, 10)
    assert out["last-item co-occurrence"]["hr@1"] == pytest.approx(0.5)  # 3 and 5 tie after 2: first half the time
    assert out["order-2 Markov (backoff)"]["hr@1"] == pytest.approx(1.0)


def test_equal_scores_count_as_a_random_order() -> None:
    scores = np.zeros((4, 20))
    metrics = ranked(scores, np.array([0, 5, 10, 19]))
    assert metrics["hr@10"] == pytest.approx(10 / 20) and metrics["hr@1"] == pytest.approx(1 / 20)
