"""Everything one rank trains with, built once from the config: the same parts with or without
fault tolerance (only the ``StepSync`` differs).

    model (meta embeddings) -> DMP (sharded; DDP around the dense part only where DDP reduces)
    -> optimizers (fused row-wise Adagrad in the tables, AdamW dense) -> loader (planned over every
    rank of every replica group) -> StepFeed -> StepSync (local, or FaultTolerance) -> pipeline
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer

from freescale.comm_trace import CommTracer
from freescale.dataloader.loader import BalancedLoader, build_loader
from freescale.dataloader.schema import DatasetManifest
from freescale.distributed import DistContext
from freescale.grad_buckets import BucketedGrads
from freescale.models import build_model, cost_model_for
from freescale.parallelize import build_optimizer, dense_named_parameters, shard_model
from freescale.pipeline import StepPipeline, build_pipeline
from freescale.step_feed import StepFeed
from freescale.step_sync import LocalSync, StepSync
from freescale.testing import StepHooks, hooks_from_env


@dataclass
class Components:
    ctx: DistContext
    manifest: DatasetManifest
    dmp: nn.Module
    optimizer: CombinedOptimizer
    loader: BalancedLoader
    feed: StepFeed
    sync: StepSync
    pipeline: StepPipeline
    hooks: StepHooks
    tracer: CommTracer | None
    group: int
    """This rank's replica group (0 without fault tolerance)."""
    log_dir: Path
    """Where this group's log goes: ``output_dir``, or ``output_dir/replica<g>``."""
    ft: Any = None
    """``freescale.ft.FaultTolerance`` (it is also ``sync``), or None."""

    @property
    def features(self) -> list[str]:
        return list(self.dmp.module.sparse_feature_names)  # type: ignore[union-attr]

    def close(self) -> None:
        self.loader.close()
        if self.tracer is not None:
            self.tracer.__exit__(None, None, None)
        if self.ft is not None:
            self.ft.close()


def segment_end_of(every: int, end: int) -> Callable[[int], int]:
    """Next step at which the pipeline holds no read-ahead batch after ``step``: a checkpoint or the end."""
    return lambda step: min(end, (step // every + 1) * every) if every else end


def build(cfg: Any, ctx: DistContext) -> Components:
    """The rank's components (``cfg``: a ``TrainerConfig``)."""
    ft_on = cfg.ft.enabled
    group = cfg.ft.replica_index if ft_on else 0
    groups = cfg.ft.replicas if ft_on else 1
    log_dir = Path(cfg.train.output_dir) / (cfg.ft.replica_id if ft_on else "")
    manifest = DatasetManifest.read(cfg.data.path)
    torch.manual_seed(cfg.train.seed)  # every rank (and every group) builds the same initial model
    model = build_model(cfg.model, manifest, max_seq_len=cfg.data.max_seq_len, embedding_device=torch.device("meta"))
    dmp = shard_model(model, ctx, cfg.optim, data_parallel=cfg.pipeline.uses_ddp(ft_on))
    optimizer = build_optimizer(dmp, cfg.optim)
    loader = build_loader(
        cfg.data, "train", rank=group * ctx.world_size + ctx.rank, world_size=groups * ctx.world_size,
        sparse_features=list(model.sparse_feature_names), derived_cost=cost_model_for(cfg.model, manifest.dense_dim),
        seed=cfg.train.seed, training=True, pin_memory=ctx.device.type == "cuda", group_size=ctx.world_size,
    )
    feed = StepFeed(loader, group, ctx.world_size, groups, cfg.pipeline.read_ahead,
                    segment_end_of(cfg.checkpoint.every, cfg.train.steps), ctx.device)
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hooks = hooks_from_env(group, ctx.rank, incarnation, log_dir)
    tracer = _tracer(dmp) if cfg.train.trace_comm else None
    prioritized = cfg.pipeline.kind == "prioritized"
    chunk = cfg.pipeline.chunk_kb * 1024 if prioritized else None
    inflight = cfg.pipeline.max_inflight if prioritized else None
    ft = None
    sync: StepSync
    if ft_on:
        from freescale.ft.layer import FaultTolerance

        ft = sync = FaultTolerance(dmp, optimizer, cfg.ft, data=feed, hooks=hooks, chunk_bytes=chunk,
                                   max_inflight=inflight, nonfinite=cfg.train.nonfinite, device=ctx.device)
        if tracer is not None and ft.in_group is not None:
            tracer.label(ft.in_group, "dense")
    else:
        grads = None
        if prioritized:
            dense_group = dist.new_group(backend=dist.get_backend())
            if tracer is not None:
                tracer.label(dense_group, "dense")
            grads = BucketedGrads(list(dense_named_parameters(dmp).values()), dense_group, chunk or 1, chunk or 1,
                                  chunk_bytes=chunk, max_inflight=inflight)
        sync = LocalSync(optimizer, list(dense_named_parameters(dmp).values()), feed, ctx.rank, grads,
                         cfg.train.nonfinite)
    pipeline = build_pipeline(cfg.pipeline, dmp, sync, ctx.device)
    return Components(ctx, manifest, dmp, optimizer, loader, feed, sync, pipeline, hooks, tracer, group, log_dir, ft)


def _tracer(dmp: nn.Module) -> CommTracer:
    tracer = CommTracer()
    for name, module in dmp.named_modules():
        if hasattr(module, "compute_and_output_dist"):
            tracer.attribute(module, name.rsplit(".", 1)[-1])
    return tracer.__enter__()
