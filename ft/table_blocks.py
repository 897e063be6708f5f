"""The union update's unit across replica groups: one table shard's lookups of a step (``freescale.ft.sparse_sync``).

A fused TBE batches several tables (torchrec groups a rank's table shards by kernel, pooling and type), and
which shards share a TBE depends on how many ranks the group runs on: a group that lost ranks holds the
shards of several rank positions on one rank (``freescale.shrunk_plan``).  So the exchange does not ship
TBEs; it ships *blocks*, one per table shard, in one order every group knows (the plan's shards, sorted):

- ``split``: a TBE's step (feature-major ``offsets``, ids, output gradient) cut into its shards' blocks;
- ``union_step``: a TBE's union step from every participant's blocks of its shards, in quorum order, each
  gradient scaled by its share of the step's samples (feature by feature: the TBE's layout).

A row's gradients reach its TBE's backward in the same order whichever TBE holds the shard (feature, then
participant, then bag), so every group's fused update of a row is the same bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from freescale.ft.replica_group import FanOutGroup, ReplicaGroup

MODEL_PARALLEL = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")


@dataclass(frozen=True)
class ShardSpec:
    """One table shard in a TBE: ``features`` features (bags) of ``dim`` columns each."""

    key: str
    features: int
    dim: int
    position: int
    """Its rank position in a whole group: the position whose exchange carries it."""


@dataclass
class Block:
    """A table shard's lookups of a step: per-bag ``lengths`` (feature-major: ``features x bags``), the ids, and
    the output gradient (pooled: ``[bags, features x dim]``; sequence: ``[ids, dim]``)."""

    lengths: torch.Tensor
    indices: torch.Tensor
    grad: torch.Tensor

    def nbytes(self) -> int:
        return (self.lengths.numel() + self.indices.numel()) * 8 + self.grad.numel() * 4

    def sizes(self) -> list[int]:
        return [self.indices.numel(), self.lengths.numel(), *self.grad.shape]


def shard_key(table: str, offsets: Any) -> str:
    return f"{table}@{','.join(str(int(o)) for o in offsets)}"


def plan_keys(dmp: Any) -> list[str]:
    """Every model-parallel table shard of ``dmp``'s plan, sorted: the same list on every rank of every group
    (a group on fewer ranks keeps the whole group's shards: ``freescale.shrunk_plan``)."""
    keys: list[str] = []
    for tables in getattr(getattr(dmp, "plan", None), "plan", {}).values():
        for table, sharding in tables.items():
            if sharding.sharding_type in MODEL_PARALLEL and sharding.sharding_spec is not None:
                keys.extend(shard_key(table, s.shard_offsets) for s in sharding.sharding_spec.shards)
    return sorted(keys)


def shard_specs(kernel: Any, positions: dict[tuple[str, tuple[int, ...]], int] | None, own: int) -> list[ShardSpec]:
    """A torchrec kernel's table shards in its TBE's order, each at its rank position (``own`` in a whole group)."""
    specs = []
    for table in kernel._config.embedding_tables:
        offsets = tuple(int(o) for o in table.local_metadata.shard_offsets) if table.local_metadata else (0, 0)
        position = positions.get((table.name, offsets), own) if positions is not None else own
        specs.append(ShardSpec(shard_key(table.name, offsets), table.num_features(), table.local_cols, position))
    return specs


def id_cuts(specs: list[ShardSpec], offsets: torch.Tensor) -> list[int]:
    """Where each shard's ids start in the TBE's ``indices`` (and where the last ends): one read of ``offsets``
    (a single host sync on a GPU, whatever the number of shards)."""
    features = sum(s.features for s in specs)
    bags = (offsets.numel() - 1) // features if features else 0
    starts = [0]
    for spec in specs:
        starts.append(starts[-1] + spec.features)
    return [int(x) for x in offsets[torch.tensor([f * bags for f in starts], device=offsets.device)].tolist()]


def split(specs: list[ShardSpec], indices: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
          pooled: bool) -> list[Block]:
    """A TBE's step cut into its shards' blocks (``specs`` in the TBE's order)."""
    features = sum(s.features for s in specs)
    bags = (offsets.numel() - 1) // features if features else 0
    lengths = offsets.diff().view(features, bags)
    cuts = id_cuts(specs, offsets)
    blocks, first, col = [], 0, 0
    for spec, lo, hi in zip(specs, cuts, cuts[1:]):
        last = first + spec.features
        width = spec.features * spec.dim
        part = grad[:, col:col + width] if pooled else grad[lo:hi]
        blocks.append(Block(lengths[first:last].reshape(-1), indices[lo:hi], part))
        first, col = last, col + width
    return blocks


def empty_blocks(specs: list[ShardSpec], pooled: bool) -> list[Block]:
    return [Block(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                  torch.zeros(0, s.features * s.dim if pooled else s.dim)) for s in specs]


def union_step(specs: list[ShardSpec], parts: list[list[Block]], shares: list[torch.Tensor], pooled: bool,
               name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TBE's union step (indices, offsets, output gradient) from every participant's blocks of its shards
    (``parts[s][p]``: shard ``s`` in the TBE's order, participant ``p`` in quorum order): per feature, the
    participants' bags in quorum order, each gradient scaled by its ``shares``.  Each participant's blocks are put
    back into the TBE's own layout first (one concatenation each), so the rest costs what a per-TBE union does."""
    features = sum(spec.features for spec in specs)
    lengths: list[torch.Tensor] = []
    pieces: list[tuple[torch.Tensor, ...]] = []
    width = sum(spec.features * spec.dim for spec in specs) if pooled else (specs[0].dim if specs else 0)
    live = []
    for p, share in enumerate(shares):
        blocks = [shard[p] for shard in parts]
        if not any(b.lengths.numel() for b in blocks):
            continue  # it sat the step out (catching up): no bags
        per_bag = torch.cat([b.lengths.view(spec.features, -1) for spec, b in zip(specs, blocks)])
        ids = torch.cat([b.indices for b in blocks])
        counts = per_bag.sum(dim=1).tolist()
        if sum(counts) != ids.numel():
            raise RuntimeError(f"fault tolerance: embedding '{name}': lengths do not cover the ids")
        lengths.append(per_bag)
        pieces.append(torch.split(ids, counts))
        live.append((blocks, share, per_bag.shape[1] if pooled else ids.numel()))
    if not lengths:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(0, width)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.cat(lengths, dim=1).reshape(-1), 0)])
    indices = torch.cat([piece[f] for f in range(features) for piece in pieces])
    # Each participant's gradient written once into its rows of the union (its shards side by side), then scaled.
    grad = torch.empty(sum(n for _, _, n in live), width)
    first = 0
    for blocks, share, n in live:
        rows = grad[first:first + n]
        torch.cat([b.grad for b in blocks], dim=1 if pooled else 0, out=rows)
        rows.mul_(share)
        first += n
    if pooled:
        return indices, offsets, grad
    rows_of = torch.split(grad, [n for _, _, n in live])
    per_feature = [torch.split(r, [len(x) for x in piece]) for r, piece in zip(rows_of, pieces)]
    return indices, offsets, torch.cat([row[f] for f in range(features) for row in per_feature])


def served_groups(group: ReplicaGroup) -> list[tuple[int | None, ReplicaGroup]]:
    """The process group of each rank position this rank exchanges at: one per position for a rank standing in
    for lost ones (``FanOutGroup``), else its own (``None``: every shard it holds)."""
    if isinstance(group, FanOutGroup):
        return list(zip(group.positions, group.groups))
    return [(None, group)]
