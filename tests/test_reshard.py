"""Logical checkpoints (``freescale.reshard``): saved at 2 ranks under one plan, loaded at 1 and 3
ranks under others, every table changing its sharding type; real processes on gloo.

Checked on the gathered logical state: every weight equals the saved one bit for bit; each row-wise
Adagrad value equals the width-weighted mean of the saved column ranges it covers (exact where the
new shard is a union of saved ranges: then equal to float rounding), and a note names exactly the
tables whose saved column range the new plan split (the approximate direction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.procs import free_port
from tests.reshard_worker import main

# a, b, c: sequence tables (table-, row-, column-wise); d: a pooled table (table-, column-, table-column-wise:
# torchrec shards pooled tables by rows on CUDA only).
SAVE = {"a_table": "table_wise", "b_table": "row_wise", "c_table": "column_wise", "d_table": "table_column_wise"}
LOADS = [
    (1, {"a_table": "column_wise", "b_table": "table_wise", "c_table": "table_wise", "d_table": "table_wise"}),
    (3, {"a_table": "row_wise", "b_table": "column_wise", "c_table": "row_wise", "d_table": "column_wise"}),
]
# (A load at 4 ranks ran too when this was written: it adds a fourth process, nothing the 3-rank load does
# not show, to a CI budget of ten minutes.)


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("reshard")
    plan = [{"kind": "save", "world": 2, "plan": SAVE}] + [{"kind": "load", "world": w, "plan": p} for w, p in LOADS]
    ranks = max(p["world"] for p in plan)
    mp.start_processes(main, args=(free_port(), str(tmp), plan, ranks), nprocs=ranks, start_method="spawn", join=True)
    return [torch.load(Path(tmp) / f"phase{i}.pt", weights_only=False) for i in range(len(plan))]


def expected_value(saved: torch.Tensor, cuts: list[int], c0: int, c1: int) -> torch.Tensor:
    """The row-wise value of columns [c0, c1) from saved ranges: their width-weighted mean (float64)."""
    total = torch.zeros(saved.shape[0], dtype=torch.float64)
    for j in range(len(cuts) - 1):
        overlap = max(0, min(cuts[j + 1], c1) - max(cuts[j], c0))
        total += overlap * saved[:, j].to(torch.float64)
    return total / (c1 - c0)


def test_the_save_splits_a_column_wise_table_into_several_ranges(phases: list[dict[str, Any]]) -> None:
    saved = phases[0]
    assert len(saved["layouts"]["c_table"]["cuts"]) > 2, saved["layouts"]  # it was split by columns
    assert all(saved["momentum"][t].abs().sum() > 0 for t in SAVE)  # trained: the state is not zero


def test_tables_copied_over_later_steps_equal_a_copy_at_the_step(phases: list[dict[str, Any]]) -> None:
    """``staging.LazySnapshot`` on rank 0 of the save (every sharding type of both collections): the tables
    copied three rows per step while 4 more steps train, each row a lookup is about to update kept first,
    equal a host copy made at the step, bit for bit."""
    lazy = phases[0]["lazy"]
    assert lazy["equal"], lazy
    assert lazy["rows_kept"] > 0 and lazy["ahead"] > 0 and lazy["tables"] >= 2 * 4, lazy


@pytest.mark.parametrize("index", range(1, 1 + len(LOADS)))
def test_loads_under_another_plan_and_world_size(phases: list[dict[str, Any]], index: int) -> None:
    saved, loaded = phases[0], phases[index]
    split = []
    for table in SAVE:
        assert torch.equal(loaded["weights"][table], saved["weights"][table]), table
        old, new = saved["layouts"][table]["cuts"], loaded["layouts"][table]["cuts"]
        for k in range(len(new) - 1):
            c0, c1 = new[k], new[k + 1]
            want = expected_value(saved["momentum"][table], old, c0, c1).to(torch.float32)
            assert torch.allclose(loaded["momentum"][table][:, k], want, rtol=1e-6, atol=0), (table, c0, c1)
            if any(max(c0, a) < min(c1, b) and not (c0 <= a and b <= c1) for a, b in zip(old, old[1:])):
                split.append(table)
    named = sorted({note.split("'")[1] for note in loaded["notes"]})
    assert named == sorted(set(split)), loaded["notes"]
    # The weights are equal under every plan and world size, and so is their logical digest.
    assert loaded["logical_digest"] == saved["logical_digest"] and loaded["plan"] != saved["plan"]
    if index == 1:  # a table-wise table split by columns (approximate); column shards merged (exact)
        assert named == ["a_table"], loaded["notes"]


def test_a_row_wise_table_of_fewer_rows_than_ranks_is_saved_from_every_rank(phases: list[dict[str, Any]]) -> None:
    """Row-wise sharding gives the ranks past a table's last row empty shards, all at the same offset: the save's
    fragments (declared from the weight's metadata, no collective) leave them out, on every rank."""
    every = phases[-1]["fewer_rows_than_ranks"]
    assert every == [[0, 1, 1, True], [1, 0, 1, True], [2, 0, 1, True]], every


@pytest.mark.parametrize("index", range(1 + len(LOADS)))
def test_items_outscoring_a_target_are_counted_on_the_shards_as_a_full_sort_would(phases: list[dict[str, Any]],
                                                                                  index: int) -> None:
    """``retrieval.RankCounter`` over each table as each phase's plan shards it (table-, row-, column- and
    table-column-wise, at 1, 2 and 3 ranks): per query, the items scoring above its target and tied with it
    equal those of scoring the whole gathered table at once, and at least one table was split by columns."""
    phase = phases[index]
    column_split = []
    for table, per_rank in phase["ranks"].items():
        for queries, targets, greater, ties, split in per_rank:
            scores = queries @ phase["weights"][table].T
            target = scores.gather(1, targets.view(-1, 1))
            assert torch.equal(greater, (scores > target).sum(1)), (table, phase["plan"][table])
            assert torch.equal(ties, (scores == target).sum(1) - 1), (table, phase["plan"][table])
            column_split.append(split)
    assert len(phase["ranks"]) == len(SAVE) and (index == 1 or any(column_split)), phase["plan"]


def test_the_logical_digest_sees_every_value_and_its_place() -> None:
    """In one process (no shards): equal tensors digest alike; one element changed, or the same values in
    another shape, do not (the sharded case: ``test_loads_under_another_plan_and_world_size``)."""
    from freescale.digest import logical_digest

    state = {"t.weight": torch.arange(12.0).reshape(3, 4), "t.bias": torch.ones(2)}
    same = {k: v.clone() for k, v in state.items()}
    assert logical_digest(state) == logical_digest(same)
    same["t.weight"][1, 2] += 1e-6
    assert logical_digest(state) != logical_digest(same)
    assert logical_digest(state) != logical_digest({**state, "t.weight": torch.arange(12.0).reshape(4, 3)})
    assert logical_digest(state) != logical_digest({"t.weight": state["t.bias"], "t.bias": state["t.weight"]})
