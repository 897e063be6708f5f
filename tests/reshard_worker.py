"""One process of ``test_reshard``: a table of each kind, trained, saved under one plan, loaded under others.

``ranks`` processes; each phase runs on the first ``world`` of them (a subgroup), so one spawn covers
saving at 2 ranks and loading at other world sizes, each with another sharding type per table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

SEQUENCE_TABLES = {"a_table": 32, "b_table": 32, "c_table": 32}
"""In an EmbeddingCollection: table-, row- and column-wise on CPU."""
POOLED_TABLES = {"d_table": 32}
"""In an EmbeddingBagCollection: table-, column- and table-column-wise on CPU (torchrec offers row-wise
sharding of pooled tables on CUDA only)."""
TABLES = {**SEQUENCE_TABLES, **POOLED_TABLES}
ROWS = 24


class Both(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

        meta = torch.device("meta")
        self.sequence = EmbeddingCollection(tables=[EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=ROWS,
                                                                    feature_names=[n[0]])
                                                    for n, d in SEQUENCE_TABLES.items()], device=meta)
        self.pooled = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=ROWS,
                                                                        feature_names=[n[0]])
                                                     for n, d in POOLED_TABLES.items()], device=meta)

    def forward(self, sequence: Any, pooled: Any) -> torch.Tensor:
        loss = sum((jt.values() ** 2).sum() for jt in self.sequence(sequence).values())
        return loss + sum((v ** 2).sum() for v in self.pooled(pooled).to_dict().values())


def build(plan: dict[str, str], group: Any, world: int) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8}
    sharders = [EmbeddingCollectionSharder(fused_params=fused), EmbeddingBagCollectionSharder(fused_params=fused)]
    constraints = {n: ParameterConstraints(sharding_types=[plan[n]], compute_kernels=["fused"], min_partition=8)
                   for n in TABLES}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu",
                                                         local_world_size=world), constraints=constraints)
    model = Both()
    sharding = planner.collective_plan(model, sharders, group)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"),
                                    plan=sharding, sharders=sharders)


def train(dmp: Any, steps: int, rank: int) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 + rank)

    def batch(names: list[str]) -> KeyedJaggedTensor:
        keys = [n[0] for n in names]
        lengths = torch.randint(1, 4, (len(keys) * 4,), generator=gen)
        return KeyedJaggedTensor(keys=keys, values=torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen),
                                 lengths=lengths)

    for _ in range(steps):
        dmp(batch(list(SEQUENCE_TABLES)), batch(list(POOLED_TABLES))).backward()


def logical(dmp: Any, group: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Rank 0 of ``group``: each table's weight and row-wise fragments, gathered; and the layouts."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from freescale.reshard import to_logical

    state, layouts = to_logical(dmp.state_dict(), dmp.fused_optimizer.state_dict(), group)
    out_w, out_m = {}, {}
    first = dist.get_rank(group) == 0
    for source, out in ((state["model"], out_w), (state["rowwise"], out_m)):
        for key, value in source.items():
            if isinstance(value, ShardedTensor):
                full = torch.zeros(value.size()) if first else None
                value.gather(dst=dist.get_global_rank(group, 0), out=full)
                if first:
                    out[key.split("/")[0].split(".")[-2]] = full
    return out_w, out_m, {k.split("/")[0].split(".")[-2]: v for k, v in layouts.items()}


def leaves(state: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a state dict by path (a ShardedTensor's local shards as ``path#i``)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(state, ShardedTensor):
        return [(f"{path}#{i}", shard.tensor) for i, shard in enumerate(state.local_shards())]
    if isinstance(state, torch.Tensor):
        return [(path, state)]
    if isinstance(state, dict):
        return [leaf for key, value in state.items() for leaf in leaves(value, f"{path}/{key}")]
    return []


def lazy_copy(dmp: Any, tracker: Any, rank: int) -> dict[str, Any]:
    """A ``LazySnapshot`` of this rank's state, its tables copied a few rows per step over 4 more training
    steps, against a host copy made at once: equal tensors?  And how many rows a lookup kept first."""
    from freescale.checkpoint import host_copy
    from freescale.staging import LazySnapshot

    live = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    at_once = host_copy(live)
    snapshot = LazySnapshot(tracker, live)
    for _ in range(4):
        train(dmp, 1, rank + 7)
        snapshot.advance(3 * 32 * 4)  # three rows of a table (or a row of each of three)
    ahead = snapshot.copied
    taken = snapshot.finish()
    lazily = dict(leaves(snapshot.assemble()))
    same = [torch.equal(lazily[path], tensor) for path, tensor in leaves(at_once)]
    return {"equal": all(same) and len(same) == len(lazily), "rows_kept": taken["rows_kept"], "ahead": ahead,
            "tables": len(tracker.tables)}


def rank_counts(dmp: Any, group: Any, rank: int) -> dict[str, Any]:
    """``retrieval.RankCounter`` on each table as this plan shards it: random queries of each rank
    (different counts per rank), their targets' counts; gathered to every rank."""
    from freescale.retrieval import RankCounter

    out: dict[str, Any] = {}
    state = dmp.state_dict()
    for key, weight in sorted(state.items()):
        if not key.endswith(".weight") or "_table" not in key:
            continue
        name = key.split(".")[-2]
        g = torch.Generator().manual_seed(100 + rank)
        queries = torch.randn(3 + rank, weight.size()[1], generator=g)
        targets = torch.randint(0, ROWS, (3 + rank,), generator=g)
        counter = RankCounter.of_sharded(weight, group)
        counter.chunk_bytes = 2 * 4 * ROWS  # two queries a chunk: several chunks, each with its collectives
        greater, ties = counter.count(queries, targets)
        mine = [queries, targets, greater, ties, counter.column_split]
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        out[name] = every
    return out


def fewer_rows_than_ranks(rank: int, group: Any, world: int) -> list[Any]:
    """``reshard.fragments`` of a row-wise table of one row over ``world`` ranks, as torchrec shards it (the ranks
    past its row hold empty shards, all at offset 1), on every rank: ``[rank, local fragments, declared shards,
    values kept]`` of each (gathered over ``group``)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    from freescale.reshard import fragments

    def sharded(size: list[int], offsets: list[list[int]], sizes: list[list[int]], local: torch.Tensor) -> Any:
        metas = [ShardMetadata(shard_offsets=o, shard_sizes=z, placement=f"rank:{r}/cpu")
                 for r, (o, z) in enumerate(zip(offsets, sizes))]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, metas[rank])], ShardedTensorMetadata(metas, torch.Size(size), TensorProperties(torch.float32)),
            process_group=group)

    rows = [1] + [0] * (world - 1)
    starts = [0] + [1] * (world - 1)
    weight = sharded([1, 4], [[s, 0] for s in starts], [[n, 4] for n in rows], torch.ones(rows[rank], 4))
    state = sharded([1], [[s] for s in starts], [[n] for n in rows], torch.full((rows[rank],), 7.0))
    out, _ = fragments(state, weight, "one_row_table", torch.float32, group)
    mine = [rank, len(out.local_shards()), len(out.metadata().shards_metadata),
            all(torch.equal(s.tensor, torch.full((1, 1), 7.0)) for s in out.local_shards())]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    return every


def main(rank: int, port: int, tmp: str, phases: list[dict[str, Any]], ranks: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    groups = {n: dist.new_group(list(range(n))) for n in sorted({p["world"] for p in phases})}
    ckpt = str(Path(tmp) / "ckpt")
    from freescale.reshard import load_logical, to_logical
    from freescale.staging import RowTracker

    for i, phase in enumerate(phases):
        world, group = phase["world"], groups[phase["world"]]
        if rank < world:
            dmp = build(phase["plan"], group, world)
            result: dict[str, Any] = {"plan": phase["plan"]}
            if phase["kind"] == "save":
                tracker = RowTracker(dmp)
                train(dmp, 3, rank)
                state, layouts = to_logical(dmp.state_dict(), dmp.fused_optimizer.state_dict(), group)
                dcp.save(state, checkpoint_id=ckpt, process_group=group)
                if rank == 0:
                    (Path(tmp) / "layouts.json").write_text(json.dumps(layouts))
            else:
                model, optim = dmp.state_dict(), dmp.fused_optimizer.state_dict()
                layouts = json.loads((Path(tmp) / "layouts.json").read_text())
                notes = load_logical(lambda s: dcp.load(s, checkpoint_id=ckpt, process_group=group),
                                     model, optim, layouts, group)
                dmp.load_state_dict(model)
                dmp.fused_optimizer.load_state_dict(optim)
                result["notes"] = notes
                if world > 2:
                    result["fewer_rows_than_ranks"] = fewer_rows_than_ranks(rank, group, world)
            result["ranks"] = rank_counts(dmp, group, rank)
            from freescale.digest import logical_digest

            result["logical_digest"] = logical_digest(dmp.state_dict(), group)  # the tables' weights, any sharding
            weights, momentum, layout = logical(dmp, group)
            if phase["kind"] == "save":  # after the gather: the checks of the save above see the saved state
                result["lazy"] = lazy_copy(dmp, tracker, rank)
            if rank == 0:
                torch.save({"weights": weights, "momentum": momentum, "layouts": layout, **result},
                           Path(tmp) / f"phase{i}.pt")
            del dmp
        else:  # torchrec's ShardingEnv builds a device mesh over the phase's ranks: a collective of every rank
            from torch.distributed.device_mesh import init_device_mesh

            init_device_mesh("cpu", (world,))
        dist.barrier()
    dist.destroy_process_group()
