"""The sharding plan of a replica group that runs on fewer ranks than its own (``[ft] on_rank_loss = "shrink"``).

A group of ``G`` ranks lost some and re-formed on ``G' < G`` (``freescale.launch.GroupSizes``).  Its tables
are placed by the plan every whole group uses (torchrec's planner over ``G`` ranks, on the same inputs), with
each shard of rank position ``p`` moved to rank ``p % G'``: the rank that stands in for position ``p`` in the
exchange across groups (``freescale.ft.replica_group.positions_served``).  The shards are the same units as
in a whole group (same tables, same row and column ranges), only more of them per rank, so

- the union update exchanges lookups per table shard and every rank applies what lands in its own shards
  (``freescale.ft.sparse_sync``): groups sharded this way and whole groups stay identical;
- a rank catching up takes each of its shards from the peer rank that holds it at the same position
  (``freescale.ft.layer_snapshot``), the rows and optimizer state of exactly its shards;
- a rank holds the shards of every position it serves, so the group fits only if their bytes fit the
  rank's memory (torchrec's topology for the device): a plan that does not fit is refused in one line, and
  the group's agent restarts it at its size instead.

Table-wise and column-wise shards move whole (torchrec places several column shards of a table on one rank;
a snapshot names each shard by its offsets, the same on any rank: ``freescale.ft.snapshot_state``).  Row-wise
shards do not: torchrec routes a row-wise table's ids by an even split over the world size, which a group of
``G'`` ranks cannot keep for ``G`` shards (re-splitting the rows, and exchanging lookups by row range, is not
built): refused the same way.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torchrec.distributed.planner import Topology

MOVABLE = ("table_wise", "column_wise", "table_column_wise", "data_parallel")
"""Sharding types whose shards move whole to the rank standing in for their position."""


class ShrinkUnfit(ValueError):
    """The group cannot train on its ranks with the whole group's placement (the message says why, in one line)."""


def group_ranks(world: int) -> int:
    """The whole group's ranks (``FREESCALE_GROUP_RANKS``, set by the group's agent), or ``world``."""
    from freescale.ft.config import GROUP_RANKS_ENV

    return max(world, int(os.environ.get(GROUP_RANKS_ENV, "0") or 0))


def shard_bytes(sizes: list[int], optimizer_rows: bool) -> int:
    """A shard's fp32 weights, and row-wise Adagrad's one float per row."""
    rows, cols = [*sizes, 1][:2]
    return 4 * rows * cols + (4 * rows if optimizer_rows else 0)


def merge_plan(plan: Any, ranks: int, full: int, device_type: str) -> tuple[Any, dict[tuple[str, tuple[int, ...]], int]]:
    """``plan`` (a whole group's, over ``full`` ranks) with each shard moved from rank ``p`` to ``p % ranks``;
    and each moved shard's position, by (table, shard offsets).  Raises ``ShrinkUnfit``."""
    positions: dict[tuple[str, tuple[int, ...]], int] = {}
    load = [0] * ranks
    merged: dict[str, Any] = {}
    for module, tables in plan.plan.items():
        moved = {}
        for table, sharding in tables.items():
            if sharding.sharding_type not in MOVABLE:
                raise ShrinkUnfit(f"table '{table}' is {sharding.sharding_type.replace('_', '-')} sharded, and only "
                                  "table- and column-wise shards move whole to the ranks a group has left")
            if sharding.sharding_type == "data_parallel" or sharding.sharding_spec is None:
                moved[table] = sharding
                continue
            shards = []
            for shard in sharding.sharding_spec.shards:
                position = shard.placement.rank()
                rank = position % ranks
                positions[(table, tuple(shard.shard_offsets))] = position
                load[rank] += shard_bytes(shard.shard_sizes, True)
                shards.append(dataclasses.replace(
                    shard, placement=f"rank:{rank}/{shard.placement.device()}"))
            spec = type(sharding.sharding_spec)(shards=shards)
            moved[table] = dataclasses.replace(sharding, ranks=[r % ranks for r in (sharding.ranks or [])],
                                               sharding_spec=spec)
        merged[module] = type(tables)(moved)
    _check_memory(load, ranks, device_type)
    return type(plan)(merged), positions


def _check_memory(load: list[int], ranks: int, device_type: str) -> None:
    """Each rank's shards within its device's memory: the GPU's own (CUDA), torchrec's topology's host memory
    (CPU: its default, 128 GiB).  Tables only: the dense part and activations are left to the margin."""
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        cap, where = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, "its GPU's memory"
    else:
        storage = Topology(world_size=ranks, compute_device=device_type).devices[0].storage
        cap, where = (storage.hbm if device_type == "cuda" else storage.ddr), "its memory (torchrec's topology)"
    for rank, held in enumerate(load):
        if held > cap:
            raise ShrinkUnfit(f"rank {rank} would hold {held / 2**30:.1f} GiB of tables and their optimizer state, "
                              f"over the {cap / 2**30:.1f} GiB of {where}")
