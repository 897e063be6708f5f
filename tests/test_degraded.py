"""A replica group that loses ranks (``[ft] on_rank_loss = "shrink"``), the parts that need no processes: the
agent's decisions (``freescale.launch.GroupSizes``), the plan of a group on fewer ranks
(``freescale.shrunk_plan``), the launcher's refusals.  The end-to-end runs, with real SIGKILLs, are in
``tests/test_ft_torchrec.py``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

from freescale.cli import main
from freescale.ft.config import GROUP_RANKS_ENV, INCARNATION_BASE_ENV
from freescale.group_sizes import AFTER_FAILURE_ENV, GroupSizes, RankLoss
from freescale.shrunk_plan import ShrinkUnfit, merge_plan

KILLED = RankLoss(1, "signal 9", 123)


@pytest.fixture(autouse=True)
def _agent_environment() -> Iterator[None]:
    """``GroupSizes`` writes the variables a group's ranks read: none may reach another test."""
    yield
    for name in (GROUP_RANKS_ENV, INCARNATION_BASE_ENV, AFTER_FAILURE_ENV):
        os.environ.pop(name, None)


def test_shrink_goes_down_to_the_minimum_then_restarts_while_restarts_last(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = GroupSizes(4, max_restarts=1, on_rank_loss="shrink", min_group_ranks=2)
    assert sizes.restarts_now() == 0  # every failure comes back to the agent
    assert sizes.after_loss(KILLED, "") and sizes.size == 3
    sizes.restarts_now()
    assert sizes.after_loss(KILLED, "") and sizes.size == 2
    sizes.restarts_now()
    assert sizes.after_loss(KILLED, "") and sizes.size == 2 and sizes.restarts_left == 0  # at the minimum: a restart
    sizes.restarts_now()
    assert not sizes.after_loss(KILLED, "")  # none left: the group stops
    err = capsys.readouterr().err
    assert "replica group 0: lost rank 1 (signal 9); continues on 3 ranks at 0.75 share" in err
    assert "continues on 2 ranks at 0.50 share" in err and "lost rank 1 (signal 9); restarts on 2 ranks" in err


def test_a_refused_shrink_restarts_at_the_size_before_and_shrinks_no_more(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = GroupSizes(2, max_restarts=1, on_rank_loss="shrink", min_group_ranks=1)
    sizes.restarts_now()
    assert sizes.after_loss(KILLED, "") and sizes.size == 1
    sizes.restarts_now()
    assert sizes.after_loss(RankLoss(0, "it cannot train at this size", 1), "a reason") and sizes.size == 2
    assert sizes.restarts_now() == 0  # a whole group again, no restart left for torch's agent
    assert not sizes.after_loss(KILLED, "")
    assert "cannot continue on 1 rank: a reason; restarts on 2 ranks" in capsys.readouterr().err
    without = GroupSizes(2, max_restarts=0, on_rank_loss="shrink", min_group_ranks=1)
    without.restarts_now()
    without.after_loss(KILLED, "")
    without.restarts_now()
    assert not without.after_loss(KILLED, "a reason")
    assert "a reason; no restart left: the group stops" in capsys.readouterr().err


def test_restart_policy_leaves_restarts_to_torchs_agent() -> None:
    sizes = GroupSizes(2, max_restarts=3, on_rank_loss="restart", min_group_ranks=1)
    assert sizes.restarts_now() == 3
    assert os.environ[AFTER_FAILURE_ENV] == "no restart left: the group stops"  # read once torch's 3 are spent
    assert not sizes.after_loss(KILLED, "")  # torch's agent spent them: the group stops


def _plan(**tables: tuple[str, list[tuple[list[int], list[int], int]]]) -> ShardingPlan:
    module = EmbeddingModuleShardingPlan()
    for name, (kind, shards) in tables.items():
        metadata = [ShardMetadata(offsets, sizes, f"rank:{rank}/cpu") for offsets, sizes, rank in shards]
        module[name] = ParameterSharding(kind, "fused", [rank for _, _, rank in shards], EnumerableShardingSpec(metadata))
    return ShardingPlan({"sparse.ebc": module})


def test_a_group_on_fewer_ranks_holds_the_lost_ranks_table_shards_at_their_positions() -> None:
    plan = _plan(a_table=("table_wise", [([0, 0], [100, 8], 0)]), b_table=("table_wise", [([0, 0], [50, 8], 1)]),
                 c_table=("table_wise", [([0, 0], [10, 8], 2)]))
    merged, positions = merge_plan(plan, 2, 3, "cpu")
    ranks = {t: [int(s.placement.rank()) for s in p.sharding_spec.shards] for t, p in merged.plan["sparse.ebc"].items()}
    assert ranks == {"a_table": [0], "b_table": [1], "c_table": [0]}  # position 2 -> rank 2 % 2
    assert {t: p.ranks for t, p in merged.plan["sparse.ebc"].items()} == {"a_table": [0], "b_table": [1], "c_table": [0]}
    assert positions == {("a_table", (0, 0)): 0, ("b_table", (0, 0)): 1, ("c_table", (0, 0)): 2}


@pytest.mark.parametrize(("kind", "said"), [("row_wise", "row-wise"), ("table_row_wise", "table-row-wise")])
def test_shards_that_cannot_move_whole_are_refused_in_one_line(kind: str, said: str) -> None:
    plan = _plan(a_table=(kind, [([0, 0], [50, 8], 0), ([50, 0], [50, 8], 1)]))
    with pytest.raises(ShrinkUnfit, match=f"table 'a_table' is {said} sharded, and only table- and column-wise"):
        merge_plan(plan, 1, 2, "cpu")


def test_column_shards_of_lost_ranks_join_the_shards_already_there() -> None:
    plan = _plan(a_table=("column_wise", [([0, 0], [50, 8], 0), ([0, 8], [50, 8], 1), ([0, 16], [50, 8], 2)]))
    merged, positions = merge_plan(plan, 2, 3, "cpu")
    assert merged.plan["sparse.ebc"]["a_table"].ranks == [0, 1, 0]
    assert positions == {("a_table", (0, 0)): 0, ("a_table", (0, 8)): 1, ("a_table", (0, 16)): 2}


def test_a_plan_over_the_ranks_memory_is_refused_in_one_line() -> None:
    huge = _plan(a_table=("table_wise", [([0, 0], [2**33, 8], 0)]))
    with pytest.raises(ShrinkUnfit, match=r"rank 0 would hold 288.0 GiB of tables and their optimizer state, over the 128.0 GiB of its memory"):
        merge_plan(huge, 1, 2, "cpu")


def test_shrink_needs_a_peer_group_and_room_to_shrink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, said in ((["--replicas", "1"], "on_rank_loss = shrink: needs --replicas 2 or more"),
                       (["--replicas", "2", "--min-group-ranks", "2"], "min_group_ranks: must be in 1..1")):
        assert main(["launch", "--nproc-per-node", "2", *args, "--on-rank-loss", "shrink", "--",
                     "python", "-c", "pass"]) == 2
        assert said in capsys.readouterr().err
