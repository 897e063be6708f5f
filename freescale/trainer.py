"""``Trainer``: one replica group's training loop over a torchrec-sharded model.

    from freescale import Trainer, TrainerConfig
    cfg = TrainerConfig()
    cfg.data.path = "data/demo"
    summary = Trainer(cfg).fit()      # under torchrun, or as a group of one

One step on rank r (all ranks in lockstep; collectives must match):

    1. loader.next_batch()            this rank's share of global batch s, planned by cost
                                      on every rank alike, read and prefetched on a thread
    2. pipeline.progress(batches)     (``freescale.pipeline``; ``pipeline.kind``)
       batch.to(device)               input dist (ids all-to-all) -> embedding lookup ->
       dmp(batch)                     output all-to-all -> dense forward -> loss
       loss.backward()                embedding grads all-to-all back, fused row-wise
                                      Adagrad updates the shards inside backward; dense
                                      grads all-reduced (DDP, or the prioritized reducer)
       optimizer.step()               AdamW on the dense parameters
    6. every log_every steps          metrics over the window, gathered from all ranks
    7. every checkpoint.every steps   atomic DCP checkpoint (model, optimizers, step,
                                      data position)

Pipelines other than ``plain`` read batches ahead; the trainer hands them an
iterator that stops at the next checkpoint, so the pipeline is empty exactly
when the loader position is saved.  Rank 0 alone prints (progress bar, summary) and writes the
JSONL log ``<train.output_dir>/train_log.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections import deque
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from tqdm import tqdm

from freescale import checkpoint
from freescale.checkpoint import CheckpointConfig
from freescale.config import ConfigError, require, to_dict
from freescale.dataloader.batch import Batch
from freescale.dataloader.loader import BalancedLoader, DataConfig, StepInfo, build_loader
from freescale.dataloader.schema import DatasetManifest
from freescale.ft.config import FTConfig
from freescale.comm_trace import CommTracer
from freescale.digest import state_digest
from freescale.distributed import DistConfig, DistContext, init_distributed, shutdown
from freescale.metrics import ClickMetrics, MetricWindow
from freescale.models import ModelConfig, build_model, cost_model_for
from freescale.pipeline import PipelineConfig, build_pipeline
from freescale.parallelize import OptimConfig, build_optimizer, materialize_optimizer_state, shard_model
from freescale.step_stats import Calibration, StepTiming


@dataclass
class TrainConfig:
    steps: int = 300
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
    benchmark_skip_float_comm: bool = False
    """Benchmarks only: floating-point collectives (embeddings, their gradients, dense gradients) become
    no-ops of the same shapes, so step time minus this run's step time is the exposed communication.
    The model learns nothing in this mode."""

    def validate(self) -> None:
        require(self.steps > 0, "steps", f"must be positive, got {self.steps}")
        require(self.log_every > 0, "log_every", f"must be positive, got {self.log_every}")
        require(bool(self.output_dir), "output_dir", "must not be empty")


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


@dataclass
class TrainSummary:
    model: str
    world_size: int
    start_step: int
    steps: int
    samples: int
    seconds: float
    samples_per_s: float
    train_loss: float
    train_auc: float
    eval_loss: float | None = None
    eval_auc: float | None = None
    eval_ne: float | None = None
    checkpoint: str | None = None
    skipped_rows: int = 0
    state_digest: str = ""
    """SHA-256 over every rank's parameters and optimizer state after training (``freescale.digest``)."""


class RunLog:
    """JSONL events on rank 0 (one object per line, flushed); a no-op elsewhere."""

    def __init__(self, path: Path | None) -> None:
        self._fh: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a")

    def write(self, event: str, **fields: Any) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def quiet_libraries() -> None:
    """Silence torchrec/fbgemm chatter that says nothing to a user of this trainer."""
    for name in ("torchrec", "fbgemm_gpu", "torch.fx._symbolic_trace", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("torchrec", "fbgemm_gpu", "torch.distributed", "torch.fx", "torch.autograd", "torch.nn"):
        warnings.filterwarnings("ignore", module=module)


class Trainer:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg

    def fit(self) -> TrainSummary:
        """Train ``train.steps`` steps (resuming if asked), evaluate, return the summary."""
        quiet_libraries()
        self.cfg.ft.resolve_env()
        self.cfg.ft.validate()
        if self.cfg.ft.enabled and self.cfg.pipeline.kind != "plain":
            raise ConfigError(f"pipeline.kind: fault-tolerant training (ft.lighthouse) runs the plain loop, "
                              f"got '{self.cfg.pipeline.kind}'")
        ctx = init_distributed(self.cfg.dist)
        try:
            summary = self._fit_replica(ctx) if self.cfg.ft.enabled else self._fit(ctx)
        except BaseException:
            # Peers may be dead or stuck in another collective: no barrier on the way out.
            shutdown(ctx, clean=False)
            raise
        shutdown(ctx)
        return summary

    # ------------------------------------------------------------------------------
    def _fit(self, ctx: DistContext) -> TrainSummary:
        cfg = self.cfg
        out_dir = Path(cfg.train.output_dir)
        ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out_dir / "checkpoints"
        manifest = DatasetManifest.read(cfg.data.path)
        torch.manual_seed(cfg.train.seed)
        model = build_model(
            cfg.model, manifest, max_seq_len=cfg.data.max_seq_len, embedding_device=torch.device("meta")
        )
        features = list(model.sparse_feature_names)
        dmp = shard_model(model, ctx, cfg.optim, data_parallel=cfg.pipeline.uses_ddp)
        optimizer = build_optimizer(dmp, cfg.optim)
        loader = self._loader(ctx, features, manifest.dense_dim, "train")
        log = RunLog(out_dir / "train_log.jsonl" if ctx.is_main else None)

        start_step = 0
        if cfg.checkpoint.resume:
            path = checkpoint.latest(ckpt_root)
            if path is not None:
                materialize_optimizer_state(optimizer)
                state = {"model": dmp.state_dict(), "optim": optimizer.state_dict()}
                meta = checkpoint.load(path, state)
                dmp.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optim"])
                loader.load_state_dict(meta["data"])
                start_step = int(meta["step"])
                log.write("resume", step=start_step, path=str(path))
                self._say(ctx, f"resumed from {path} at step {start_step}")
            else:
                self._say(ctx, f"no checkpoint under {ckpt_root}; starting from step 0")

        log.write(
            "start", config=to_dict(cfg), world_size=ctx.world_size, backend=ctx.backend, device=str(ctx.device),
            start_step=start_step, torch=torch.__version__, python=platform.python_version(),
            host=platform.node(), pid=os.getpid(),
        )

        def save(step: int) -> Path:
            state = {"model": dmp.state_dict(), "optim": optimizer.state_dict()}
            meta = {"data": loader.state_dict(), "world_size": ctx.world_size, "config": to_dict(cfg)}
            path = checkpoint.save(ckpt_root, step, state, meta, keep=cfg.checkpoint.keep)
            log.write("checkpoint", step=step, path=str(path))
            return path

        window, run_window = MetricWindow(), MetricWindow()
        bar = tqdm(
            total=cfg.train.steps, initial=start_step, desc=f"train {cfg.model.kind}", unit="step",
            disable=not (ctx.is_main and cfg.train.progress and sys.stderr.isatty()), dynamic_ncols=True,
        )
        dmp.train()
        last_ckpt: Path | None = None
        last_metrics = ClickMetrics(float("nan"), float("nan"), float("nan"), 0)
        timed_from, timed_steps = time.perf_counter(), 0
        window_start = time.perf_counter()
        timing = StepTiming()
        calibration = Calibration()
        skip = cfg.train.benchmark_skip_float_comm
        tracer = CommTracer(skip_float=skip) if cfg.train.trace_comm or skip else None
        if skip and cfg.pipeline.uses_ddp:
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

            ddp = dmp._dmp_wrapped_module
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                ddp.register_comm_hook(None, noop_hook)
        if tracer is not None:
            for name, module in dmp.named_modules():
                if hasattr(module, "compute_and_output_dist"):
                    tracer.attribute(module, name.rsplit(".", 1)[-1])
            tracer.__enter__()
        pipeline = build_pipeline(cfg.pipeline, dmp, optimizer, ctx.device, tracer)
        infos: deque[StepInfo | None] = deque()

        def batches(first: int, stop: int) -> Iterator[Batch]:
            """Batches of steps ``first .. stop-1``; the pipeline is empty at ``stop``."""
            for _ in range(first, stop):
                batch = loader.next_batch()
                infos.append(loader.last)
                yield batch.to(ctx.device, non_blocking=True)

        segment: Iterator[Batch] = iter(())
        for step in range(start_step, cfg.train.steps):
            if step == start_step or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                segment = batches(step, self._segment_end(step))
            if tracer is not None:
                tracer.step = step
            step_start = time.perf_counter()
            cpu_start = time.thread_time()
            loss, logits, labels = pipeline.progress(segment)
            info = infos.popleft()
            window.add(logits, labels)
            run_window.add(logits, labels)
            busy = time.thread_time() - cpu_start
            timing.add(info, busy=busy, wall=time.perf_counter() - step_start)
            # Early steps pay for lazy initialisation: not an observation of compute cost.
            if cfg.data.calibrate_every and info is not None and step > start_step + 1:
                calibration.add(loader.planner.lengths[info.rows], busy)
            done = step + 1
            if step == start_step:  # the first step pays for lazy initialisation: not timed
                timed_from = time.perf_counter()
            else:
                timed_steps += 1
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                last_metrics = window.compute()
                now = time.perf_counter()
                rate = last_metrics.samples / max(now - window_start, 1e-9)
                window_start = now
                balance = timing.compute(ctx.device.type == "cpu")
                log.write("step", step=done, loss=last_metrics.loss, auc=last_metrics.auc, ne=last_metrics.ne,
                          samples_per_s=rate, epoch=loader.epoch, skipped_rows=sum(loader.source.skipped.values()),
                          **balance)
                bar.set_postfix(loss=f"{last_metrics.loss:.4f}", auc=f"{last_metrics.auc:.3f}")
                if bar.disable and ctx.is_main and cfg.train.progress:
                    print(f"step {done}/{cfg.train.steps}  loss {last_metrics.loss:.4f}  "
                          f"auc {last_metrics.auc:.3f}  {rate:,.0f} samples/s  "
                          f"imbalance {balance['imbalance']:.3f}", flush=True)
            bar.update(1)
            if cfg.data.calibrate_every and done % cfg.data.calibrate_every == 0 and done != cfg.train.steps:
                model = calibration.fit_and_share(loader.planner.cost_model)
                if model is not None:
                    loader.set_cost_model(model)
                    log.write("calibrate", step=done, quadratic=model.quadratic, linear=model.linear,
                              constant=model.constant)
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != cfg.train.steps:
                last_ckpt = save(done)
        seconds = time.perf_counter() - timed_from
        if tracer is not None:
            tracer.__exit__(None, None, None)
            if cfg.train.trace_comm:
                tracer.write_jsonl(out_dir / f"comm_trace_rank{ctx.rank}.jsonl")
        bar.close()
        if cfg.checkpoint.save_final and start_step < cfg.train.steps:
            last_ckpt = save(cfg.train.steps)
        run_metrics = run_window.compute() if start_step < cfg.train.steps else last_metrics
        steps_run = cfg.train.steps - start_step
        samples_per_s = timed_steps * loader.global_batch_size / seconds if timed_steps else float("nan")
        summary = TrainSummary(
            model=cfg.model.kind, world_size=ctx.world_size, start_step=start_step, steps=steps_run,
            samples=steps_run * loader.global_batch_size, seconds=seconds, samples_per_s=samples_per_s,
            train_loss=run_metrics.loss, train_auc=run_metrics.auc,
            checkpoint=str(last_ckpt) if last_ckpt else None,
        )
        loader.close()
        summary.state_digest = state_digest(dmp, optimizer)
        if cfg.train.eval and manifest.rows.get("eval", 0) >= loader.global_batch_size:
            result = self._evaluate(pipeline.detach(), ctx, features, manifest.dense_dim)
            summary.eval_loss, summary.eval_auc, summary.eval_ne = result.loss, result.auc, result.ne
            log.write("eval", loss=result.loss, auc=result.auc, ne=result.ne, samples=result.samples)
        summary.skipped_rows = sum(loader.source.skipped.values())
        log.write("summary", **asdict(summary), skipped=dict(loader.source.skipped))
        log.close()
        return summary

    def _fit_replica(self, ctx: DistContext) -> TrainSummary:
        """One rank of a fault-tolerant replica group (``freescale.ft.trainer``)."""
        from freescale.ft.trainer import ReplicaRank

        cfg = self.cfg
        rank = ReplicaRank(cfg, ctx)
        try:
            start_step = rank.resume()
            rank.warm_up()
            rank.wait_for_peers()
            outcome = rank.run(cfg.train.steps, start_step)
            metrics = rank.window.compute()
            summary = TrainSummary(
                model=cfg.model.kind, world_size=ctx.world_size, start_step=start_step,
                steps=outcome["committed_steps"],
                samples=metrics.samples, seconds=outcome["seconds"],
                samples_per_s=metrics.samples / max(outcome["seconds"], 1e-9),
                train_loss=metrics.loss, train_auc=metrics.auc,
            )
            summary.state_digest = state_digest(rank.dmp, rank.optimizer)
            rank._write(event="summary", **asdict(summary), contributed_steps=outcome["contributed_steps"],
                        pending_rows=outcome["pending_rows"])
            if cfg.train.eval and DatasetManifest.read(cfg.data.path).rows.get("eval", 0) >= cfg.data.batch_size * ctx.world_size:
                result = self._evaluate(rank.dmp, ctx, list(rank.dmp.module.sparse_feature_names),
                                        DatasetManifest.read(cfg.data.path).dense_dim)
                summary.eval_loss, summary.eval_auc, summary.eval_ne = result.loss, result.auc, result.ne
        finally:
            rank.close()
        return summary

    def _segment_end(self, step: int) -> int:
        """Next step at which the pipeline must hold no read-ahead batch: a checkpoint or the end."""
        every, end = self.cfg.checkpoint.every, self.cfg.train.steps
        return min(end, (step // every + 1) * every) if every else end

    def _loader(self, ctx: DistContext, features: list[str], dense_dim: int, split: str) -> BalancedLoader:
        cfg = self.cfg
        return build_loader(
            cfg.data, split, rank=ctx.rank, world_size=ctx.world_size, sparse_features=features,
            derived_cost=cost_model_for(cfg.model, dense_dim), seed=cfg.train.seed, training=split == "train",
            pin_memory=ctx.device.type == "cuda",
        )

    def _evaluate(self, dmp: torch.nn.Module, ctx: DistContext, features: list[str], dense_dim: int) -> ClickMetrics:
        loader = self._loader(ctx, features, dense_dim, "eval")
        window = MetricWindow()
        dmp.eval()
        with torch.no_grad():
            for batch in loader:
                _, (_, logits, labels) = dmp(batch.to(ctx.device, non_blocking=True))
                window.add(logits, labels)
        dmp.train()
        loader.close()
        return window.compute()

    @staticmethod
    def _say(ctx: DistContext, message: str) -> None:
        if ctx.is_main:
            print(message, flush=True)

