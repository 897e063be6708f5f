"""The run's config tree and everything one rank trains with, built once from it: the same parts
with or without fault tolerance (only the ``StepSync`` differs, and a replica layer has run edges).

    dataset (opened once) -> model (meta embeddings) -> DMP (sharded; DDP around the dense part only where
    DDP reduces) -> optimizers (fused row-wise Adagrad in the tables, AdamW dense) -> loader (planned over
    every rank of every replica group) -> StepFeed -> StepSync (local, or FaultTolerance) -> StepEngine
    (the pipeline inside)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer

from freescale.checkpoint import CheckpointConfig
from freescale.comm_trace import CommTracer
from freescale.config import ConfigError, require
from freescale.dataloader.build import DataConfig, Dataset
from freescale.dataloader.loader import BalancedLoader
from freescale.distributed import DistConfig, DistContext, side_group
from freescale.ft.config import FTConfig, incarnation, skip_step_refusal
from freescale.grad_buckets import BucketedGrads
from freescale.models import ModelConfig, build_model, cost_model_for
from freescale.parallelize import (
    OptimConfig,
    build_optimizer,
    dense_named_parameters,
    dense_update,
    replicated_tables,
    shard_model,
)
from freescale.pipeline import PipelineConfig, check_comm
from freescale.rank_console import say
from freescale.rank_speed import BalanceConfig, RankSpeed
from freescale.side_channels import SideChannels
from freescale.speed_share import SpeedShare
from freescale.staging import LazySaves, RowTracker
from freescale.step_engine import PRECISIONS, StepEngine
from freescale.step_feed import StepFeed
from freescale.step_sync import NONFINITE, LocalSync
from freescale.step_types import ReplicaRun, StepSync
from freescale.table_init import init_tables, table_bounds
from freescale.tasks import Task, task_of
from freescale.testing import StepHooks, hooks_from_env
from freescale.validation import (
    BestTracker,
    EvalConfig,
    Validation,
    ValidationShare,
    check_validation,
    default_metric,
    validation_steps,
)


@dataclass
class TrainConfig:
    steps: int = 300
    epochs: int = 0
    """Passes over the training split; above 0 it sets ``steps`` (the split's samples over the global batch, times
    this)."""
    early_stop: int = 0
    """Stop after this many validations in a row without a better ``eval.metric`` (0: never; needs ``eval.every``)."""
    seed: int = 0
    log_every: int = 20
    output_dir: str = "runs/default"
    eval: bool = True
    """Evaluate on the dataset's ``eval`` split after training."""
    progress: bool = True
    """Progress bar on rank 0 (only when stderr is a terminal)."""
    trace_comm: bool = False
    """Record every collective (op, group, bytes, phase, issuing module, time blocked) to
    ``<output_dir>/comm_trace_rank<R>.jsonl`` (``freescale.comm_trace``; costs a little per collective)."""
    nonfinite: str = "stop"
    """A step whose reduced dense gradients are not finite (NaN or inf loss): ``stop`` (one line naming
    the step and rank; the last good checkpoint stays the one to resume from) or ``skip_step`` (no
    update, training goes on; needs fault tolerance, whose embedding update is deferred to the commit)."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: the step's forward autocast to bfloat16 on CUDA (matmuls and attention in bf16,
    losses and reductions in fp32 as autocast chooses; weights, gradients, optimizer state and checkpoints
    stay fp32; the fused tables keep their own dtype).  Refused on CPU: this project's CPU runs have no
    fast bf16 matmul (autocast on CPU ran slower than fp32 here), so fp32 is the only CPU precision."""

    def validate(self) -> None:
        require(self.steps > 0, "steps", f"must be positive, got {self.steps}")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        require(self.epochs >= 0, "epochs", f"must be >= 0, got {self.epochs}")
        require(self.early_stop >= 0, "early_stop", f"must be >= 0, got {self.early_stop}")
        require(self.log_every > 0, "log_every", f"must be positive, got {self.log_every}")
        require(bool(self.output_dir), "output_dir", "must not be empty")
        require(self.nonfinite in NONFINITE, "nonfinite", f"must be one of {list(NONFINITE)}, got '{self.nonfinite}'")
        require(self.precision in PRECISIONS, "precision", f"must be one of {list(PRECISIONS)}, got '{self.precision}'")


@dataclass
class LogConfig:
    tensorboard: bool = False
    """Also write the run log's numbers as TensorBoard scalars (``freescale/tensorboard_log.py``; needs the
    ``tensorboard`` extra).  The JSONL log is written either way."""
    tensorboard_dir: str = ""
    """Empty: ``<train.output_dir>/tensorboard`` (with replica groups, under each group's log directory)."""


@dataclass
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    log: LogConfig = field(default_factory=LogConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def prepare(cfg: TrainerConfig) -> None:
    """Resolve what the launcher put in the environment and refuse combinations that cannot run
    (one line each, naming the key), before any process group exists."""
    cfg.ft.resolve_env()
    try:
        cfg.ft.validate()
    except ConfigError as exc:
        raise ConfigError(f"ft.{exc}") from None
    if cfg.ft.enabled and cfg.data.calibrate_every:
        raise ConfigError("data.calibrate_every: not supported with replica groups yet (the fitted cost model "
                          "would have to be agreed across groups to keep their plans identical); set it to 0")
    if cfg.train.precision == "bf16" and (cfg.dist.backend == "gloo" or not torch.cuda.is_available()):
        raise ConfigError("train.precision: 'bf16' autocasts the step on CUDA, and this run is on CPU "
                          f"({'dist.backend = gloo' if cfg.dist.backend == 'gloo' else 'no GPU'}); use 'fp32'")
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("log.tensorboard: needs the tensorboard package (pip install 'freescale[tensorboard]')")
    if "data_parallel" in cfg.optim.sharding_types().values():
        refuse_replicated_tables(cfg, ["optim.sharding"])
    if cfg.optim.warmup_steps > cfg.train.steps and not cfg.train.epochs:  # (with epochs: checked once known)
        raise ConfigError(f"optim.warmup_steps: {cfg.optim.warmup_steps:,} is more than train.steps "
                          f"({cfg.train.steps:,}): the whole run would train at a fraction of the learning rate; "
                          "lower it")
    if cfg.balance.slow_policy == "evict" and (not cfg.ft.enabled or cfg.ft.replicas < 2):
        raise ConfigError("balance.slow_policy: 'evict' restarts a fail-slow replica group while the others train on, "
                          f"and this run has {'no replica groups (ft.enabled = false)' if not cfg.ft.enabled else 'one'}"
                          "; use 'rebalance' or 'report'")
    if cfg.balance.slow_policy == "rebalance":
        if cfg.data.partitioner != "lpt" or cfg.data.locality or cfg.data.equal_count:
            raise ConfigError("balance.slow_policy: 'rebalance' plans by rank speed, which needs data.partitioner = "
                              "'lpt', data.locality = false and data.equal_count = false; or use 'report'")
    refusal = skip_step_refusal(cfg.ft.enabled, cfg.ft.embedding_sync) if cfg.train.nonfinite == "skip_step" else None
    if refusal:
        raise ConfigError(f"train.nonfinite: {refusal}")
    if cfg.train.early_stop and validation_steps(cfg.eval.every, 1) == 0:
        raise ConfigError("train.early_stop: stops after validations without improvement, and eval.every is 0 (no "
                          "validation during training); set eval.every (\"500\" steps, \"1e\" an epoch)")


def refuse_replicated_tables(cfg: TrainerConfig, tables: list[str]) -> None:
    """data_parallel tables (``tables``) where nothing keeps them right: one line, naming them.  DDP reduces
    their gradients in a job; fault tolerance's buckets do, in the group and across groups, with the dense ones
    (whatever the pipeline: the prioritized one's chunked buckets included)."""
    if cfg.pipeline.uses_ddp(False) or cfg.ft.enabled:
        return
    why = "with pipeline.kind = 'prioritized' and no fault tolerance they are not measured"
    raise ConfigError(f"optim.sharding: data_parallel tables ({', '.join(tables)}) are refused here: {why}; set "
                      "optim.sharding to a model-parallel type (table_wise, row_wise, ...)")


@dataclass
class Components:
    ctx: DistContext
    dataset: Dataset
    dmp: nn.Module
    optimizer: CombinedOptimizer
    loader: BalancedLoader
    feed: StepFeed
    engine: StepEngine
    replicas: ReplicaRun | None
    """The replica layer's run edges (fault tolerance); None for one group."""
    hooks: StepHooks
    tracer: CommTracer | None
    group: int
    """This rank's replica group (0 without fault tolerance)."""
    groups: int
    """Replica groups of the run (1 without fault tolerance)."""
    log_dir: Path
    """Where this group's log goes: ``output_dir``, or ``output_dir/replica<g>``."""
    staging: LazySaves | None = None
    """Copies the tables to host memory over the steps after each save (``checkpoint.stage_budget``)."""
    speed: RankSpeed | None = None
    """The ranks' speeds and fail-slow verdicts (``balance.slow_policy``; None: off, or on CUDA, where busy time
    is not measured with events yet)."""
    shared_speeds: SpeedShare | None = None
    """With replica groups: the job-wide speed check, carried across groups with the steps."""
    validation: Validation | None = None
    """Validation during training (``eval.every``; ``freescale.validation``)."""
    side_group: dist.ProcessGroup | None = None
    """The training thread's small asynchronous collectives' group (``freescale.distributed.side_group``)."""

    @property
    def features(self) -> list[str]:
        names: list[str] = self.dmp.module.sparse_feature_names  # type: ignore[union-attr, assignment]
        return list(names)

    @property
    def task(self) -> Task:
        return task_of(self.dmp)

    @property
    def sampled_items(self) -> int:
        return int(getattr(self.dmp.module, "sampled_items", 0))

    @property
    def reads_timestamps(self) -> bool:
        return bool(getattr(self.dmp.module, "reads_timestamps", False))

    def close(self) -> None:
        self.loader.close()
        if self.tracer is not None:
            self.tracer.__exit__(None, None, None)
        if self.replicas is not None:
            self.replicas.close()


def segment_end_of(every: int, end: int, validate_every: int = 0, decided_after: int = 0) -> Callable[[int], int]:
    """Next step at which the pipeline holds no read-ahead batch after ``step``: a checkpoint, a validation (and,
    ``decided_after`` steps after it, the commit where replica groups learn its decision: an early stop's
    checkpoint) or the end."""
    periods = [p for p in (every, validate_every) if p]

    def end_of(step: int) -> int:
        ends = [(step // p + 1) * p for p in periods]
        if validate_every and decided_after:  # the next k * validate_every + decided_after after ``step``
            first = validate_every + decided_after
            ends.append(max(first, (step - decided_after) // validate_every * validate_every + first))
        return min([end, *ends])

    return end_of


def _comm_group(cfg: TrainerConfig, ctx: DistContext) -> dist.ProcessGroup | None:
    """The process group of torchrec's embedding all-to-alls: the SM-free backend's with ``pipeline.comm =
    "copy_engine"`` (collective; on the rank's device: shared memory on CPU, CUDA IPC on CUDA, where a group across
    nodes is refused: ``pipeline.check_comm``), else None (the default group)."""
    if cfg.pipeline.comm != "copy_engine":
        return None
    from freescale.kernels import sm_free_backend

    check_comm(cfg.pipeline, ctx.device, ctx.world_size, ctx.local_world_size)
    return sm_free_backend.new_group(ctx.device)


def build(cfg: TrainerConfig, ctx: DistContext, dataset: Dataset | None = None) -> Components:
    """The rank's components (``dataset``: ``cfg.data`` opened already; else opened here)."""
    ft_on = cfg.ft.enabled
    group = cfg.ft.replica_index if ft_on else 0
    groups = cfg.ft.replicas if ft_on else 1
    # Ranks of a whole group: the data is planned over ``groups x group_ranks`` rank slots, of which a group that
    # lost ranks fills its first ``ctx.world_size`` (``freescale.step_feed``).
    group_ranks = (cfg.ft.group_ranks or ctx.world_size) if ft_on else ctx.world_size
    log_dir = Path(cfg.train.output_dir) / (cfg.ft.replica_id if ft_on else "")
    dataset = dataset if dataset is not None else Dataset(cfg.data)
    torch.manual_seed(cfg.train.seed)  # every rank (and every group) builds the same initial model
    counts = torch.from_numpy(dataset.item_counts()) if cfg.model.task == "retrieval" else None
    model = build_model(cfg.model, dataset.manifest, max_seq_len=cfg.data.max_seq_len, embedding_device=torch.device("meta"),
                        item_counts=counts)
    bounds = table_bounds(model)
    dmp = shard_model(model, ctx, cfg.optim, data_parallel=cfg.pipeline.uses_ddp(ft_on), group=_comm_group(cfg, ctx))
    init_tables(dmp.state_dict(), bounds, cfg.train.seed)  # the same tables whatever the plan (a shrunk group's too)
    replicated = sorted(replicated_tables(dmp))  # asked for, or chosen by torchrec's planner for a small table
    if replicated:
        refuse_replicated_tables(cfg, replicated)
    c = cfg.checkpoint
    # Before fault tolerance wraps the tables' lookups: its union update must go through the tracker.
    # Not with the averaged tables: their averages overwrite rows no lookup reported (the save copies at its step).
    lazy = c.async_save and c.every and c.stage_budget and not (ft_on and cfg.ft.embedding_sync == "average")
    staging = LazySaves(RowTracker(dmp), c.stage_budget) if lazy else None
    optimizer = build_optimizer(dmp, cfg.optim)
    update = dense_update(dmp, optimizer, cfg.optim, cfg.train.steps)
    features: list[str] = list(model.sparse_feature_names)  # type: ignore[arg-type]  # every model declares them
    loader = dataset.loader(
        "train", rank=group * group_ranks + ctx.rank, world_size=groups * group_ranks,
        sparse_features=features, derived_cost=cost_model_for(cfg.model, dataset.manifest.dense_dim),
        seed=cfg.train.seed, training=True, pin_memory=ctx.device.type == "cuda", group_size=group_ranks,
        timestamps=bool(getattr(model, "reads_timestamps", False)), sampled_items=getattr(model, "sampled_items", 0),
    )
    validation = _validation(cfg, loader.steps_per_epoch, task_of(dmp).name, ft_on, dataset, ctx.world_size)
    feed = StepFeed(loader, group, group_ranks, groups, cfg.pipeline.read_ahead,
                    segment_end_of(cfg.checkpoint.every, cfg.train.steps, validation.every if validation else 0,
                                   1 if ft_on else 0))
    hooks = hooks_from_env(group, ctx.rank, incarnation(), log_dir)
    if hooks.wants("data"):
        loader.made = hooks.stretch_data
    tracer = _tracer(dmp) if cfg.train.trace_comm else None
    prioritized = cfg.pipeline.kind == "prioritized"
    chunk = cfg.pipeline.chunk_kb * 1024 if prioritized else None
    inflight = cfg.pipeline.max_inflight if prioritized else None
    speed, side = None, side_group(ctx)
    if cfg.balance.slow_policy != "off" and ctx.device.type == "cpu":
        speed = RankSpeed(cfg.balance, plan_lag=cfg.pipeline.read_ahead + cfg.data.window, group=side)
    elif cfg.balance.slow_policy != "off" and ctx.is_main:
        say("freescale: balance.slow_policy: ranks' speeds are measured on CPU only (on CUDA busy time must come "
            "from CUDA events: not built); no fail-slow check in this run")
    sync: StepSync
    replicas: ReplicaRun | None = None
    shared: SpeedShare | None = None
    if ft_on:
        from freescale.ft.layer import FaultTolerance

        ft = FaultTolerance(dmp, optimizer, cfg.ft, data=feed, hooks=hooks, chunk_bytes=chunk,
                            max_inflight=inflight, nonfinite=cfg.train.nonfinite, device=ctx.device, update=update)
        if tracer is not None and ft.in_group is not None:
            tracer.label(ft.in_group, "dense")
        if speed is not None:  # every group judges the job's speeds alike (freescale.speed_share)
            shared = SpeedShare(speed, loader, group, group_ranks)
        # Every group judges the job's speeds and its validations alike: their numbers ride with the steps.
        channels = [c for c in (shared, validation.share if validation is not None else None) if c is not None]
        if channels:
            ft.carry(channels[0] if len(channels) == 1 else SideChannels(channels))
        sync = replicas = ft
    else:
        grads = None
        if prioritized:
            dense_group = dist.new_group(backend=dist.get_backend())
            if tracer is not None:
                tracer.label(dense_group, "dense")
            grads = BucketedGrads(list(dense_named_parameters(dmp).values()), dense_group, chunk or 1, chunk or 1,
                                  chunk_bytes=chunk, max_inflight=inflight)
        sync = LocalSync(dmp, optimizer, list(dense_named_parameters(dmp).values()), feed, update, grads)
    engine = StepEngine(sync, feed, cfg.pipeline, dmp, ctx.device, cfg.train.precision, seed=cfg.train.seed,
                        slot=loader.rank, hooks=hooks, tracer=tracer)
    return Components(ctx, dataset, dmp, optimizer, loader, feed, engine, replicas, hooks, tracer, group, groups,
                      log_dir, staging, speed, shared, validation, side)


def _validation(cfg: TrainerConfig, steps_per_epoch: int, task: str, ft_on: bool, dataset: Dataset,
                ranks: int) -> Validation | None:
    """Validation during training as configured (``eval``, ``train.early_stop``), or None; what cannot run is
    refused here, in one line, before the first step."""
    every = validation_steps(cfg.eval.every, steps_per_epoch)
    if not every:
        return None
    metric = cfg.eval.metric or default_metric(task)
    check_validation(cfg.eval.split, metric, task, dataset.samples(cfg.eval.split), ranks, cfg.data.path)
    tracker = BestTracker(metric, cfg.train.early_stop)
    return Validation(every, cfg.train.steps, cfg.eval.split, tracker, cfg.eval.keep_best, cfg.train.seed, cfg.model,
                      ValidationShare(tracker) if ft_on else None)


def _tracer(dmp: nn.Module) -> CommTracer:
    tracer = CommTracer()
    for name, module in dmp.named_modules():
        if hasattr(module, "compute_and_output_dist"):
            tracer.attribute(module, name.rsplit(".", 1)[-1])
    return tracer.__enter__()
