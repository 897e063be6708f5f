"""Shard a model over one replica group with torchrec, and build its optimizers.

Embedding tables are placed by torchrec's ``EmbeddingShardingPlanner`` over the
group's ranks (model parallel) and updated by fbgemm's fused optimizer inside
backward (no embedding gradient is ever materialized).  Everything else is
dense and data parallel: ``DistributedModelParallel`` wraps it in DDP, and
AdamW steps it.  ``CombinedOptimizer`` presents both as one optimizer whose
state dict holds both (sharded tensors for the tables).
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardedModule, ShardingEnv
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from freescale.config import ConfigError, require
from freescale.dense_update import SCHEDULES, DenseUpdate, LRSchedule
from freescale.distributed import DistContext
from freescale.reshard import table_name

MODEL_PARALLEL = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
"""Sharding types whose tables sit on fused kernels (the fused optimizer updates rows inside backward)."""
SHARDING_TYPES = (*MODEL_PARALLEL, "data_parallel")
"""``data_parallel``: every rank holds the whole table on torchrec's dense kernel; torchrec's own DDP around
each data-parallel lookup all-reduces (averages) its dense gradient, and ``build_optimizer``'s row-wise
optimizer updates it after backward.  Under fault tolerance the layer reduces the gradient instead, in the group
and across groups with the dense ones (``replicated_kernel_weights``), and the same optimizer steps it on the
committed average: no union update for these tables.  With the prioritized pipeline it is not measured, so
refused."""

_SPARSE_OPTIMIZERS = {
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "sgd": EmbOptimType.EXACT_SGD,
}


@dataclass
class OptimConfig:
    dense_lr: float = 3e-3
    dense_weight_decay: float = 0.0
    sparse_optimizer: Literal["rowwise_adagrad", "sgd"] = "rowwise_adagrad"
    sparse_lr: float = 0.05
    sparse_eps: float = 1e-8
    sharding: str = ""
    """torchrec sharding types: empty lets torchrec's planner choose; one type for every table
    (``table_wise``, ``row_wise``, ``column_wise``, ``table_row_wise``, ``table_column_wise``), or
    ``item_table=column_wise,user_table=table_wise``, or ``data_parallel`` (whole tables on every rank, see
    ``SHARDING_TYPES``).  A checkpoint resumes under any model-parallel type (reshard.py)."""
    column_shard_min_dim: int = 0
    """Narrowest column shard torchrec may cut (``min_partition``); 0: torchrec's default."""
    lr_schedule: str = "constant"
    """``constant``, ``warmup_cosine`` or ``warmup_linear`` (decay to ``min_lr_ratio`` at ``train.steps``):
    a factor of the committed step on ``dense_lr`` and ``sparse_lr`` (``freescale/dense_update.py``)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from ``1/warmup_steps`` of the rate (with any schedule)."""
    min_lr_ratio: float = 0.0
    clip_grad_norm: float = 0.0
    """Clip the dense gradients' global 2-norm to this (0: off); the same norm on every rank and group."""

    def sharding_types(self) -> dict[str, str]:
        """``{table or "*": type}`` from ``sharding``."""
        found: dict[str, str] = {}
        for item in (part.strip() for part in self.sharding.split(",") if part.strip()):
            table, _, kind = item.rpartition("=")
            found[table.strip() or "*"] = kind.strip()
        return found

    def validate(self) -> None:
        for table, kind in self.sharding_types().items():
            require(kind in SHARDING_TYPES, "sharding", f"'{kind}' for {table if table != '*' else 'every table'} "
                    f"is not one of {', '.join(SHARDING_TYPES)}")
        require(self.column_shard_min_dim >= 0, "column_shard_min_dim", "must be >= 0")
        for name in ("dense_lr", "sparse_lr"):  # (inf passed once, and every step's loss was nan)
            value = getattr(self, name)
            require(0 < value < math.inf, name, f"must be positive and finite, got {value}")
        require(0 <= self.dense_weight_decay < math.inf, "dense_weight_decay", "must be >= 0 and finite")
        require(self.lr_schedule in SCHEDULES, "lr_schedule",
                f"must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        require(self.clip_grad_norm >= 0, "clip_grad_norm", f"must be >= 0 (0: off), got {self.clip_grad_norm}")


def sharders(cfg: OptimConfig) -> list[ModuleSharder[nn.Module]]:
    fused = {
        "optimizer": _SPARSE_OPTIMIZERS[cfg.sparse_optimizer],
        "learning_rate": cfg.sparse_lr,
        "eps": cfg.sparse_eps,
    }
    return [EmbeddingCollectionSharder(fused_params=fused), EmbeddingBagCollectionSharder(fused_params=fused)]


class NoDataParallel(DataParallelWrapper):
    """Leave the dense modules unwrapped: the prioritized pipeline reduces their gradients itself."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        return None


def shard_model(
    model: nn.Module, ctx: DistContext, cfg: OptimConfig, data_parallel: bool = True,
    group: dist.ProcessGroup | None = None,
) -> DistributedModelParallel:
    """Plan and shard ``model`` (embedding tables built on the meta device) over the default group (planned
    there; ``group``: the process group torchrec's sharded modules communicate over, default that one too).

    ``data_parallel=False``: no DDP around the dense part nor around ``data_parallel`` tables' lookups (the
    caller reduces every gradient: the prioritized pipeline, fault tolerance).
    """
    module_sharders = sharders(cfg)
    plan, positions = group_plan(model, module_sharders, _constraints(model, cfg, ctx.device.type), ctx.device.type,
                                 ctx.local_world_size)
    wrapper = None if data_parallel else NoDataParallel()
    dmp = DistributedModelParallel(
        model, device=ctx.device, plan=plan, sharders=module_sharders, data_parallel_wrapper=wrapper,
        env=ShardingEnv.from_process_group(group) if group is not None else None,
    )
    setattr(dmp, "shard_positions", positions)  # noqa: B010  (read by shard_positions)
    comm = group._get_backend_name() if group is not None else ctx.backend  # (the run log's start says it)
    setattr(dmp, "embedding_comm", comm)  # noqa: B010
    if not data_parallel:  # the caller reduces every gradient, data_parallel tables' included (fault tolerance)
        unwrap_replicated_lookups(dmp)
    return dmp


def shard_fused(model: nn.Module, device: torch.device | None = None, *,
                fused_params: dict[str, object] | None = None,
                constraints: dict[str, ParameterConstraints] | None = None,
                sharders: list[ModuleSharder[nn.Module]] | None = None) -> DistributedModelParallel:
    """``DistributedModelParallel(model)`` over the default group as fault tolerance needs it
    (``freescale.ft.shard``): torchrec's planner with every table on a fused kernel (kept identical
    across groups by the union update) unless its constraint asks for ``data_parallel`` alone (the
    planner's own default for a small table is not taken), and no DDP around the dense part (the layer
    reduces it).

    ``fused_params``: the tables' fused optimizer (default exact row-wise Adagrad, rate 0.05).
    ``constraints``: per table, as torchrec's; a table's own placement wishes are kept.  A table
    constrained to ``data_parallel`` alone is whole on every rank on a dense kernel: the layer reduces
    its gradient with the dense ones and *your* optimizer steps it (give it the table's parameters:
    ``model.parameters()`` holds them; the fused optimizer does not).  Its gradient is the mean over the
    group's ranks where a fused table's update sees their sum: an SGD rate for it is the ranks per group
    times the fused one (Adagrad-type optimizers differ only by eps: ``build_optimizer`` divides it).  A dense kernel on a
    model-parallel table is refused in one line.  ``sharders``: default torchrec's
    ``EmbeddingBagCollection`` and ``EmbeddingCollection`` sharders with ``fused_params``.
    """
    from freescale.rank_console import install_excepthook, launched, quiet_libraries

    if launched():  # a rank `freescale launch` owns: a refusal below, or a peer's failure later, is one line
        install_excepthook()
    with quiet_libraries():  # the planner's warnings about estimates and topology say nothing to this use
        return _shard(model, device, fused_params, constraints, sharders)


def _shard(model: nn.Module, device: torch.device | None, fused_params: dict[str, object] | None,
           constraints: dict[str, ParameterConstraints] | None,
           sharders: list[ModuleSharder[nn.Module]] | None) -> DistributedModelParallel:
    device = device or torch.device("cpu")
    fused = dict(fused_params or {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    module_sharders = sharders or [EmbeddingCollectionSharder(fused_params=fused),
                                   EmbeddingBagCollectionSharder(fused_params=fused)]
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan, positions = group_plan(model, module_sharders, fused_constraints(model, constraints or {}), device.type,
                                 int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=module_sharders,
                                   data_parallel_wrapper=NoDataParallel())
    setattr(dmp, "shard_positions", positions)  # noqa: B010  (read by shard_positions)
    unwrap_replicated_lookups(dmp)  # the layer reduces data_parallel tables' gradients too
    return dmp


def group_plan(model: nn.Module, module_sharders: list[ModuleSharder[nn.Module]],
               constraints: dict[str, ParameterConstraints] | None, device_type: str,
               local_world: int) -> tuple[Any, dict[tuple[str, tuple[int, ...]], int] | None]:
    """torchrec's plan over the default group (planned on rank 0, broadcast); for a replica group running on
    fewer ranks than its own, the whole group's plan with the lost ranks' shards moved to the ranks standing in
    for them, and each moved shard's rank position (``freescale.shrunk_plan``; one that cannot be is refused:
    ``freescale.group_sizes.refuse_shrink``, and the group's agent restarts the group at its size)."""
    from freescale.shrunk_plan import ShrinkUnfit, group_ranks, merge_plan

    world = dist.get_world_size() if dist.is_initialized() else 1
    full = group_ranks(world)
    topology = Topology(world_size=full, compute_device=device_type,
                        local_world_size=full if local_world == world else local_world)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, module_sharders, dist.GroupMember.WORLD)
    if full == world:
        return plan, None
    try:
        return merge_plan(plan, world, full, device_type)
    except ShrinkUnfit as unfit:
        from freescale.group_sizes import refuse_shrink

        refuse_shrink(str(unfit), world, full)


def shard_positions(dmp: nn.Module) -> dict[tuple[str, tuple[int, ...]], int] | None:
    """Each table shard's rank position in a replica group running on fewer ranks than its own (``group_plan``),
    by (table, shard offsets); None in a whole group (every shard is at its rank's own position)."""
    return getattr(dmp, "shard_positions", None)


def fused_constraints(model: nn.Module, given: dict[str, ParameterConstraints]) -> dict[str, ParameterConstraints]:
    """Every table of ``model`` constrained to fused kernels and a model-parallel sharding type, or to
    ``data_parallel`` on the dense kernel where ``given`` asks for it alone (``shard_fused``)."""
    allowed = list(MODEL_PARALLEL)
    out: dict[str, ParameterConstraints] = {}
    tables = _table_names(model)
    unknown = sorted(set(given) - set(tables))
    if unknown:
        raise ValueError(f"freescale.ft.shard: constraints name table {unknown[0]!r}, which the model does not have "
                         f"(it has {', '.join(sorted(tables))})")
    sequence_tables = set(_table_names(model, ("embedding_configs",)))
    for table in tables:
        mine = copy.copy(given.get(table, ParameterConstraints()))
        kinds = [str(k) for k in mine.sharding_types] if mine.sharding_types else allowed
        if kinds == ["data_parallel"]:
            if table in sequence_tables:
                raise ValueError(f"freescale.ft.shard: table {table!r} is a sequence table (EmbeddingCollection); "
                                 "torchrec 1.8's data-parallel lookup of it fails: only pooled tables can be "
                                 "data_parallel")
            if mine.compute_kernels and "dense" not in mine.compute_kernels:
                raise ValueError(f"freescale.ft.shard: table {table!r} is data_parallel on the kernels "
                                 f"{', '.join(mine.compute_kernels)}; a data_parallel table takes the 'dense' kernel")
            mine.compute_kernels = ["dense"]
            out[table] = mine
            continue
        if not set(kinds) & set(allowed):
            raise ValueError(f"freescale.ft.shard: table {table!r} is constrained to {', '.join(kinds)}; fault "
                             f"tolerance needs one of {', '.join(allowed)}, or data_parallel alone")
        if mine.compute_kernels and "fused" not in mine.compute_kernels:
            raise ValueError(f"freescale.ft.shard: table {table!r} is constrained to the kernels "
                             f"{', '.join(mine.compute_kernels)}; fault tolerance needs 'fused'")
        mine.sharding_types = [k for k in kinds if k in allowed]
        mine.compute_kernels = ["fused"]
        out[table] = mine
    return out


def _table_names(model: nn.Module, kinds: tuple[str, ...] = ("embedding_bag_configs", "embedding_configs")) -> list[str]:
    """The tables of ``model``'s embedding modules (``kinds``: ``("embedding_configs",)`` for the sequence
    tables of ``EmbeddingCollection`` modules only)."""
    names: list[str] = []
    for m in model.modules():
        configs: Any = next((c for c in (getattr(m, kind, None) for kind in kinds) if c is not None), None)
        names += [t.name for t in configs()] if callable(configs) else []
    return names


def _constraints(model: nn.Module, cfg: OptimConfig, device_type: str = "cpu") -> dict[str, ParameterConstraints] | None:
    """``optim.sharding`` as torchrec planner constraints (fused kernels: the fused optimizer holds the state).
    A sharding torchrec cannot make for a table on this device is refused here, on every rank alike, in one
    line (torchrec's planner runs on rank 0 and would fail there with its own traceback)."""
    kinds = cfg.sharding_types()
    if not kinds and not cfg.column_shard_min_dim:
        return None
    tables = _table_names(model)
    unknown = sorted(set(kinds) - set(tables) - {"*"})
    if unknown:
        raise ConfigError(f"optim.sharding: no table named {unknown[0]!r} (the model has {', '.join(sorted(tables))})")
    extra = {"min_partition": cfg.column_shard_min_dim} if cfg.column_shard_min_dim else {}
    out = {}
    sequence_tables = set(_table_names(model, ("embedding_configs",)))
    for t in tables:
        kind = kinds.get(t, kinds.get("*"))
        if kind == "data_parallel" and t in sequence_tables:
            raise ConfigError(f"optim.sharding: data_parallel for table {t!r}, a sequence table (EmbeddingCollection): "
                              "torchrec 1.8's data-parallel lookup of it fails; only pooled tables "
                              "(EmbeddingBagCollection) can be data_parallel")
        _check_supported(t, kind, t in sequence_tables, device_type)
        out[t] = ParameterConstraints(sharding_types=[kind] if kind else list(MODEL_PARALLEL),
                                      compute_kernels=["dense" if kind == "data_parallel" else "fused"], **extra)
    return out


def _check_supported(table: str, kind: str | None, sequence: bool, device_type: str) -> None:
    """``kind`` for ``table`` is one torchrec's sharder for its module shards on ``device_type``, or ConfigError."""
    if not kind:
        return
    module, sharder = (("EmbeddingCollection", EmbeddingCollectionSharder()) if sequence
                       else ("EmbeddingBagCollection", EmbeddingBagCollectionSharder()))
    allowed = sharder.sharding_types(device_type)
    if kind not in allowed:
        raise ConfigError(f"optim.sharding: {kind} for table {table!r}: torchrec does not shard a "
                          f"{'sequence' if sequence else 'pooled'} table ({module}) that way on {device_type}; "
                          f"it can: {', '.join(allowed)}")


def dense_named_parameters(dmp: DistributedModelParallel) -> dict[str, nn.Parameter]:
    """Parameters outside every torchrec sharded module (those are updated by the fused optimizer).

    Filtering by the fused optimizer's keys is not enough: without DDP around the
    dense part, a rank's ``named_parameters`` also lists tables whose shards live
    on other ranks.
    """
    # ``dmp.module`` unwraps DMP (and DDP), so these names match ``dmp.named_parameters()``.
    sharded = [name for name, module in dmp.module.named_modules() if isinstance(module, ShardedModule)]
    fused_keys = set(dmp.fused_optimizer.params.keys())
    return {
        name: p for name, p in dmp.named_parameters()
        if name not in fused_keys and not any(name.startswith(prefix + ".") for prefix in sharded)
    }


def embedding_kernels(dmp: nn.Module) -> list[tuple[str, Any, bool]]:
    """``(name, kernel, fused)`` for every embedding kernel of ``dmp``'s sharded modules, in a fixed order:
    torchrec keeps a sharded module's lookups in a plain list (not registered submodules), so they are
    walked explicitly.  A fused kernel's ``emb_module`` is fbgemm's table-batched embedding (TBE), which
    updates its rows with the fused optimizer inside backward."""
    from torchrec.distributed.batched_embedding_kernel import (
        BatchedDenseEmbedding,
        BatchedDenseEmbeddingBag,
        BatchedFusedEmbedding,
        BatchedFusedEmbeddingBag,
    )

    found: list[tuple[str, Any, bool]] = []  # torchrec's kernels; their emb_module is fbgemm's (untyped) TBE
    for name, module in dmp.named_modules():
        if not isinstance(module, ShardedModule):
            continue
        for i, lookup in enumerate(getattr(module, "_lookups", [])):
            for sub_name, sub in lookup.named_modules():
                if isinstance(sub, (BatchedDenseEmbedding, BatchedDenseEmbeddingBag, BatchedFusedEmbedding,
                                    BatchedFusedEmbeddingBag)):
                    fused = isinstance(sub, (BatchedFusedEmbedding, BatchedFusedEmbeddingBag))
                    found.append((f"{name}.lookup{i}.{sub_name}", sub, fused))
    return found


def build_optimizer(dmp: DistributedModelParallel, cfg: OptimConfig) -> CombinedOptimizer:
    """Fused embedding optimizer (already inside ``dmp``) + AdamW over the dense parameters (+ the sparse
    optimizer's math, row-wise Adagrad or SGD at ``sparse_lr``, over ``data_parallel`` tables: the same update
    their fused kernel would make, applied after the gradient is reduced)."""
    dense_params = dense_named_parameters(dmp)
    dense = KeyedOptimizerWrapper(
        dense_params,
        lambda params: torch.optim.AdamW(params, lr=cfg.dense_lr, weight_decay=cfg.dense_weight_decay),
    )
    optimizers: list[Any] = [dmp.fused_optimizer, dense]
    replicated = replicated_table_parameters(dmp)
    if replicated:
        # Both kernels step on the ranks' mean gradient, whatever the group's size: torchrec divides the gradient
        # its all-to-all (or reduce-scatter) returns to a fused shard by the group's size, and DDP (or fault
        # tolerance's buckets) averages a data-parallel table's.  So the same rate and eps serve both.
        optimizers.append(KeyedOptimizerWrapper(replicated, lambda params: (
            RowWiseAdagrad(params, lr=cfg.sparse_lr, eps=cfg.sparse_eps)
            if cfg.sparse_optimizer == "rowwise_adagrad" else torch.optim.SGD(params, lr=cfg.sparse_lr))))
    return CombinedOptimizer(optimizers)


def replicated_tables(dmp: nn.Module) -> set[str]:
    """The tables ``dmp``'s plan put on ``data_parallel`` (asked for, or chosen by torchrec's planner)."""
    plans = getattr(getattr(dmp, "plan", None), "plan", {})
    return {table for module_plan in plans.values() for table, sharding in module_plan.items()
            if sharding.sharding_type == "data_parallel"}


def replicated_table_parameters(dmp: DistributedModelParallel) -> dict[str, nn.Parameter]:
    """The weights of ``data_parallel`` tables (``<sharded module>.<...>.<table>.weight``; a sharded module also
    lists placeholders for other ranks' shards of its model-parallel tables, which this leaves out)."""
    replicated = replicated_tables(dmp)
    if not replicated:
        return {}
    sharded = [name for name, module in dmp.module.named_modules() if isinstance(module, ShardedModule)]
    return {name: p for name, p in dmp.named_parameters()
            if table_name(name) in replicated and any(name.startswith(prefix + ".") for prefix in sharded)}


def unwrap_replicated_lookups(dmp: nn.Module) -> None:
    """Take torchrec's DDP off the lookups of ``data_parallel`` tables, for a caller that reduces their gradients
    itself (fault tolerance: its buckets, in the group and across groups).  Before the model's first forward:
    a DDP that ran a forward with gradient would still all-reduce in the next backward.  torchrec keeps the
    lookups in a plain list; its resharding in place (``update_shards``) expects the DDP there and is not
    supported after this."""
    for module in dmp.modules():
        lookups = getattr(module, "_lookups", None) if isinstance(module, ShardedModule) else None
        for i, lookup in enumerate(lookups or []):
            while isinstance(lookup, nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            lookups[i] = lookup  # type: ignore[index]


def replicated_kernel_weights(dmp: nn.Module) -> list[nn.Parameter]:
    """The leaf weight of each dense kernel of ``dmp``'s ``data_parallel`` tables, one flat fbgemm tensor per
    kernel, in model order (the per-table parameters of ``replicated_table_parameters``, which the optimizer
    steps, view it and its gradient), with torchrec's DDP around their lookups taken off
    (``unwrap_replicated_lookups``, if the sharding did not already).

    A dense kernel on a model-parallel table is refused in one line: its gradient covers this rank's shard only,
    and nothing but fbgemm's fused update could keep it right (torchrec 1.8 offers no such plan on CPU)."""
    unwrap_replicated_lookups(dmp)
    replicated = replicated_tables(dmp)
    weights: list[nn.Parameter] = []
    for name, kernel, fused in embedding_kernels(dmp):
        if fused:
            continue
        tables = [t.name for t in kernel.config.embedding_tables]
        stray = sorted(set(tables) - replicated)
        if stray:
            raise ValueError(f"fault tolerance: table {stray[0]!r} ('{name.split('.lookup')[0]}') is model parallel "
                             "on a dense (non-fused) kernel; its replicas could not be kept identical. Give it the "
                             "'fused' kernel, or make it data_parallel")
        weights.append(kernel.emb_module.weights)
    return weights


def dense_update(dmp: DistributedModelParallel, optimizer: CombinedOptimizer, cfg: OptimConfig,
                 total_steps: int) -> DenseUpdate:
    """The committed step's update (``dense_update.py``): AdamW over the dense parameters, the schedule's rate
    on it and on every fused table."""
    dense = [opt for _, opt in optimizer.optimizers if opt is not dmp.fused_optimizer]
    tables = [kernel.emb_module for _, kernel, fused in embedding_kernels(dmp) if fused]
    schedule = LRSchedule(cfg.lr_schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    return DenseUpdate(dense, list(dense_named_parameters(dmp).values()), schedule, cfg.clip_grad_norm, tables)


def materialize_optimizer_state(optimizer: CombinedOptimizer) -> None:
    """Create the lazily built dense optimizer state (AdamW moments) with one zero-gradient
    step, so that a checkpoint can be loaded into it in place.

    Only before loading a checkpoint: the step counts it adds are overwritten by the
    load.  The fused embedding optimizer allocates its state eagerly and is skipped.
    """
    for _, opt in optimizer.optimizers:
        if isinstance(opt, KeyedOptimizerWrapper):
            opt.init_state()
            opt.zero_grad(set_to_none=True)
