"""``Trainer``: the one training loop, with or without fault tolerance, over any pipeline.

    from freescale import Trainer, TrainerConfig
    cfg = TrainerConfig()
    cfg.data.path = "data/demo"
    summary = Trainer(cfg).fit()      # under torchrun, or as a group of one

One step of rank r of replica group g (all ranks of a group in lockstep), in
the order the code runs it:

    1-2  plan, read       ``StepFeed`` (``freescale.step_feed``): planned and read ahead, on the
                          loader's prefetch thread, over the ranks of every ready group
         begin            ``sync.begin_step``: with fault tolerance, the quorum request (its
                          round trip overlaps the forward)
    3-5  input dist,      ``pipeline.progress`` (``freescale.pipeline``, ``pipeline.kind``):
         output dist,     ids all-to-all, prioritized embedding lookups and output all-to-alls,
         dense fwd/bwd    dense forward, backward with the dense buckets reduced during it
    6    exchange         ``sync.exchange`` (``freescale.step_sync``), called by the pipeline where an
    7    commit           optimizer step would be: in-group, then (fault tolerance) the weighted FTAR
    8    update           across groups, the vote, then the update: optimizer, the embedding sync
    9    account          the feed requeues rows of groups that did not train the step
    ---  (1-9 are ``StepEngine.run`` (``freescale.step_engine``): it returns the step's ``StepOutcome``)
         log, checkpoint  here, from the outcome: the log's ``commit`` record; metrics every
                          ``log_every``; a checkpoint at segment ends

A step this rank sits out (its group is catching up, or rejoined and is not
yet planned in) skips 3-5: ``sync.exchange`` contributes zeros with weight 0.
Everything else (metrics, calibration, tracing, progress, checkpoints, eval)
is the same code with or without ``--replicas``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from freescale import checkpoint, run_lease
from freescale.components import Components, TrainConfig, TrainerConfig, build, prepare
from freescale.config import to_dict
from freescale.dataloader.build import Dataset
from freescale.dataloader.schema import DataError
from freescale.digest import state_digest
from freescale.distributed import init_distributed, shutdown, summed_counts
from freescale.ft.commit_record import CommitRecord
from freescale.ft.config import RUN_ID_ENV, incarnation
from freescale.rank_console import quiet_libraries, say
from freescale.rank_speed import SpeedCheck
from freescale.resume import Resume
from freescale.run_log import Progress, RunLog
from freescale.step_stats import Calibration
from freescale.step_types import JobFinished, NonFiniteError, ReplicaRun, StepOutcome
from freescale.training_saves import TrainingSaves
from freescale.validation import epoch_steps, test_evaluation


@dataclass
class TrainSummary:
    model: str
    world_size: int
    start_step: int
    steps: int
    """Steps this group committed with valid state (all of them, unless it had to catch up)."""
    samples: int
    seconds: float
    samples_per_s: float
    train_loss: float
    train_auc: float | None = None
    eval_loss: float | None = None
    eval_auc: float | None = None
    eval_ne: float | None = None
    task: str = "ranking"
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """Every evaluation metric of the task (ranking: loss, auc, ne; retrieval: hr@K, ndcg@K, mrr)."""
    checkpoint: str | None = None
    skipped_rows: int = 0
    state_digest: str = ""
    """SHA-256 over every rank's parameters and optimizer state after training (``freescale.digest``)."""
    finished_elsewhere: bool = False
    """Another replica group finished the run while this one was (re)starting: nothing was left to train."""
    validation: dict[str, Any] = field(default_factory=dict)
    """With ``eval.every``: the metric, the best validated step and its value, the validations and their seconds."""


__all__ = ["TrainConfig", "TrainSummary", "Trainer", "TrainerConfig"]


class Trainer:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self._dataset: Dataset | None = None

    def open_dataset(self) -> Dataset:
        """The run's dataset, opened (its manifest read) once per process: a missing or malformed one is one
        line here, before any process group exists."""
        if self._dataset is None:
            self._dataset = Dataset(self.cfg.data)
        return self._dataset

    def fit(self) -> TrainSummary:
        """Train ``train.steps`` steps (resuming if asked), evaluate, return the summary."""
        cfg = self.cfg
        prepare(cfg)
        with quiet_libraries(), self.lease():
            return self._fit()

    @contextlib.contextmanager
    def lease(self) -> Iterator[None]:
        """The run directory's lease when no launcher holds it for this job (``run_lease``): taken by rank 0
        before the process group exists, with what killed saves left removed.  Replica groups without
        the launcher share a directory by design: no lease."""
        if os.environ.get(run_lease.TOKEN_ENV) or self.cfg.ft.enabled or os.environ.get("RANK", "0") != "0":
            yield
            return
        with run_lease.held(self._lease_directories, stale=self._checkpoint_root):
            yield

    @property
    def _lease_directories(self) -> list[Path]:
        return run_lease.lease_directories(self.cfg.train.output_dir, self._checkpoint_root)

    def _fence(self) -> checkpoint.Fence | None:
        return run_lease.fence_from_env(self._lease_directories)

    def _fit(self) -> TrainSummary:
        cfg = self.cfg
        dataset = self.open_dataset()
        ctx = init_distributed(cfg.dist)
        try:
            if cfg.train.epochs:
                cfg.train.steps = epoch_steps(cfg, dataset.samples("train"), ctx.world_size)
            parts = build(cfg, ctx, dataset)
            log = RunLog(parts.log_dir / "train_log.jsonl" if ctx.is_main else None, self._sinks(parts))
            try:
                summary = self._run(parts, log)
            finally:
                parts.close()
                log.close()
        except BaseException:
            # Peers may be dead or stuck in another collective: no barrier on the way out.
            shutdown(ctx, clean=False)
            raise
        shutdown(ctx)
        return summary

    # ------------------------------------------------------------------------------
    def _sinks(self, parts: Components) -> list[Any]:
        """Where the run log's events go besides the JSONL file (the group's rank 0 only)."""
        if not (self.cfg.log.tensorboard and parts.ctx.is_main):
            return []
        from freescale.tensorboard_log import TensorBoardSink

        where = self.cfg.log.tensorboard_dir
        return [TensorBoardSink(Path(where) / parts.log_dir.name if where and self.cfg.ft.enabled
                                else Path(where) if where else parts.log_dir / "tensorboard")]

    def _run(self, parts: Components, log: RunLog) -> TrainSummary:
        cfg, ctx = self.cfg, parts.ctx
        self._open_records(parts)
        start_step = Resume(self.cfg, self._checkpoint_root, self._records, self._records_run).start_step(parts, log)
        log.write("start", config=to_dict(cfg), world_size=ctx.world_size, backend=ctx.backend, device=str(ctx.device),
                  start_step=start_step, torch=torch.__version__, python=platform.python_version(),
                  host=platform.node(), pid=os.getpid(), group=parts.group, replicas=parts.groups,
                  incarnation=incarnation(), embedding_comm=getattr(parts.dmp, "embedding_comm", ctx.backend))
        if parts.replicas is not None:
            self._warm_up(parts, parts.replicas, log)
            parts.replicas.start()
        if parts.validation is not None:
            parts.validation.resumed(parts, log, start_step, self._checkpoint_root)
        progress = Progress(log, cfg.train.steps, start_step, cfg.model.kind,
                            ctx.is_main and cfg.train.progress, ctx.device.type == "cpu",
                            parts.loader.global_batch_size, label=f"group {parts.group}  " if parts.groups > 1 else "",
                            task=parts.task)
        committed, last_ckpt, finished_elsewhere = self._train(parts, log, progress, start_step)
        seconds = progress.close()
        if parts.tracer is not None:
            parts.tracer.__exit__(None, None, None)
            parts.tracer.write_jsonl(Path(cfg.train.output_dir) / f"comm_trace_rank{parts.loader.rank}.jsonl")
            parts.tracer = None
        run = progress.run_window.compute() if committed else progress.last
        skipped = summed_counts(parts.ctx, dict(parts.loader.source.skipped))  # every rank's, by reason
        summary = TrainSummary(
            model=cfg.model.kind, world_size=ctx.world_size, start_step=start_step, steps=committed,
            samples=int(run["samples"]), seconds=seconds, samples_per_s=progress.samples_per_s,
            train_loss=run["loss"], train_auc=run.get("auc"), checkpoint=str(last_ckpt) if last_ckpt else None,
            skipped_rows=sum(skipped.values()), task=parts.task.name, state_digest=state_digest(parts.dmp, parts.optimizer),
            finished_elsewhere=finished_elsewhere and committed == 0)
        if cfg.train.eval and not summary.finished_elsewhere and parts.dataset.samples("eval") >= ctx.world_size:
            result = test_evaluation(parts, cfg, self._checkpoint_root, log)
            summary.eval_metrics = {k: v for k, v in result.items() if k != "samples"}
            summary.eval_loss, summary.eval_auc, summary.eval_ne = (result.get(k) for k in ("loss", "auc", "ne"))
        summary.validation = parts.validation.summary() if parts.validation is not None else {}
        log.write("summary", **asdict(summary), skipped=skipped,
                  pending_rows=parts.loader.state_dict().get("carry", []))
        return summary

    def _train(self, parts: Components, log: RunLog, progress: Progress,
               start_step: int) -> tuple[int, Path | None, bool]:
        """Steps ``start_step .. train.steps - 1``; (steps committed with valid state, last checkpoint, whether
        another replica group finished the run first).
        A save still being written at the end (or at a stop on a non-finite loss, which every rank makes
        together) is waited for: the checkpoint of the last good step is complete."""
        steps = self.cfg.train.steps
        self._saves = TrainingSaves(self.cfg, parts, log, self._checkpoint_root, self._fence())
        self.stopped_at: int | None = None
        """The step after which training stopped early (``train.early_stop``), if it did."""
        try:
            committed, finished_elsewhere = self._train_steps(parts, log, progress, start_step)
        except NonFiniteError:
            try:
                self._saves.complete()
            except checkpoint.CheckpointError as exc:  # the stop's reason stays the one reported
                log.write("checkpoint_failed", error=str(exc))
            raise
        except BaseException:  # stopped (^C, the CLI's SIGTERM), or a peer's failure: no half-written save left
            self._saves.abandon()
            raise
        self._saves.complete()
        if parts.speed is not None:  # a check asked at an early stop, never read: waited for, before the group goes
            parts.speed.answer()
        parts.engine.check_finite()
        if parts.replicas is not None and not finished_elsewhere:
            parts.replicas.finish(self.stopped_at if self.stopped_at is not None else steps - 1)
        return committed, self._saves.last, finished_elsewhere

    def _train_steps(self, parts: Components, log: RunLog, progress: Progress, start_step: int) -> tuple[int, bool]:
        """(Steps committed with valid state, whether another replica group finished the run first.)"""
        cfg, steps = self.cfg, self.cfg.train.steps
        if parts.validation is not None and parts.validation.stopped_before(log, start_step):
            self.stopped_at = start_step - 1
            return 0, False
        calibration = Calibration() if cfg.data.calibrate_every else None
        step, committed, first, trained_since_report = start_step, 0, True, 0
        while step < steps:
            try:
                outcome = parts.engine.run(step)
            except JobFinished as finished:
                log.write("finished_elsewhere", step=step, finished_step=finished.step)
                return committed, True
            for event in outcome.events:
                log.write(event["event"], **{k: v for k, v in event.items() if k != "event"})
            commit = outcome.commit
            if parts.shared_speeds is not None:  # judged at commits (replayed ones: logged, said by the others already)
                for check in parts.shared_speeds.take():
                    self._say_speeds(parts, log, progress, check, commit.ready, aloud=not commit.restored)
            step = commit.step + 1
            if not commit.applied or commit.restored:
                first = True  # catching up: the next step this process trains is its first again
            if commit.restored:
                self._saves.restored()
            if not commit.applied:
                continue
            done = commit.step + 1
            committed += 1
            if first and outcome.output is not None:  # the data's rows may all be bad: no silent empty training
                self._stop_if_nothing_trained(parts, done, _trained_samples(parts, outcome.output))
            self._log_commit(log, outcome)
            if parts.shared_speeds is not None and parts.shared_speeds.evicted is not None:
                raise parts.shared_speeds.evicted  # (balance.slow_policy = 'evict': this group is fail-slow)
            if outcome.output is not None:
                progress.add(outcome.output[1:])
                trained_since_report += 1
            progress.timing.add(outcome.info, busy=outcome.busy_s, wall=outcome.wall_s)
            progress.timed(first)
            if calibration is not None and outcome.info is not None and not first:
                calibration.add(outcome.info.row_lengths, outcome.busy_s)  # a first step pays for lazy set-up
            if parts.speed is not None and outcome.info is not None and not first:
                # Busy: the step's own CPU time and the wait for its batch (a rank whose data loading falls behind).
                parts.speed.add(commit.step, outcome.info.rank_cost, outcome.busy_s + outcome.info.wait_s, outcome.wall_s)
            first = False
            if parts.speed is not None:
                self._check_speed(parts, log, progress, done)
            if done % cfg.train.log_every == 0 or done == steps:
                parts.engine.check_finite()
                progress.report(done, parts.loader.epoch, parts.loader.skipped_rows)
                if trained_since_report:  # a group that sat the window out (catching up) trained nothing by design
                    self._stop_if_nothing_trained(parts, done, int(progress.last["samples"]))
                trained_since_report = 0
            progress.bar.update(1)
            if calibration is not None and done % cfg.data.calibrate_every == 0 and done != steps:
                self._calibrate(parts, log, calibration, done)
            stop = parts.validation is not None and parts.validation.after_commit(
                parts, log, commit, functools.partial(TrainingSaves.owns, parts, commit),
                self._checkpoint_root, last=done == steps)
            self._saves.after_commit(parts, commit, outcome.wall_s, stop)
            if stop:
                log.write("early_stop", step=done, since_best=parts.validation.tracker.since_best)  # type: ignore[union-attr]
                self.stopped_at = commit.step
                break
        return committed, False

    def _stop_if_nothing_trained(self, parts: Components, done: int, samples: int) -> None:
        """``samples`` is what the group trained (its first step, or since the last report): none at all means
        every row of those batches was skipped as bad (``data.on_bad_rows = "skip"``).  Stop in one line,
        the same on every rank, naming the data and each reason's count (collective when it stops)."""
        if samples > 0:
            return
        skipped = summed_counts(parts.ctx, dict(parts.loader.source.skipped))
        why = "; ".join(f"{reason}: {count:,} rows" for reason, count in sorted(skipped.items()))
        raise DataError(f"{self.cfg.data.path}: up to step {done} the model trained on no sample: every row of "
                        f"its batches was skipped as bad (data.on_bad_rows = \"skip\"; "
                        f"{why or 'yet no row was counted as skipped'}); fix the data (freescale prepare checks a log)")

    def _log_commit(self, log: RunLog, outcome: StepOutcome) -> None:
        """The log's ``commit`` record of an applied step, from its outcome alone."""
        commit, accounted = outcome.commit, outcome.accounted
        if self._record is not None:
            self._record.note(commit.step, int(outcome.record.get("quorum_id", -1)))
        record: dict[str, Any] = {"step": commit.step, "samples": accounted.samples if accounted else 0,
                                  "seconds": outcome.wall_s, "busy_s": outcome.busy_s,
                                  "batch_wait_s": outcome.info.wait_s if outcome.info is not None else 0.0,
                                  **outcome.record}
        if self._audit:  # (tests) the whole state's hash, the rows the step trained, rank 0's rows and loss
            info = outcome.info
            record.update(outcome.digests)
            record["rows"] = accounted.rows.tolist() if accounted else []
            record["rank_sizes"] = list(info.rank_sizes) if info is not None else []
            record["loss"] = float(outcome.output[0]) if outcome.output is not None else None
            record["rank_rows"] = info.rows.tolist() if info is not None else []
            record["loss_scale"] = info.loss_scale if info is not None else None
        log.write("commit", **record)

    # ------------------------------------------------------------------------------ checkpoints
    @property
    def _checkpoint_root(self) -> Path:
        c = self.cfg.checkpoint
        return Path(c.dir) if c.dir else Path(self.cfg.train.output_dir) / "checkpoints"

    def _open_records(self, parts: Components) -> None:
        """Fault tolerance under a run id: the groups' records of the committed steps (``ft.commit_record``),
        beside the checkpoints; rank 0 of this group writes its own."""
        run = os.environ.get(RUN_ID_ENV, "")
        self._records: Path | None = self._checkpoint_root / "commits" if self.cfg.ft.enabled and run else None
        self._records_run = run
        self._audit = parts.hooks.audit
        self._record = (CommitRecord(self._records, self.cfg.ft.replica_id, run)
                        if self._records is not None and parts.ctx.is_main else None)

    # ------------------------------------------------------------------------------
    def _warm_up(self, parts: Components, replicas: ReplicaRun, log: RunLog) -> None:
        """Fault tolerance: one forward and backward, nothing updated (a zero gradient: with averaged tables
        the fused kernels' step on it changes no row), before the first quorum, so
        torchrec's lazy set-up and the loader's first read are not paid in a step the other groups
        wait for.  The batch is the loader's next one, and the loader is put back where it was."""
        start = time.perf_counter()
        position = parts.loader.state_dict()
        batch = parts.loader.next_batch()
        parts.loader.load_state_dict(position)
        loss, _ = parts.dmp(batch.to(parts.ctx.device))
        replicas.warm_up(loss)
        log.write("warm_up", seconds=time.perf_counter() - start)

    def _check_speed(self, parts: Components, log: RunLog, progress: Progress, done: int) -> None:
        """Collective over the group, after every committed step (``freescale.rank_speed``): the ranks' speeds
        asked a step before judged (fail-slow ranks said once each way; with ``rebalance`` the loader planning
        them at their speed from the next window on), and at a check's step the next ones asked; not at the last
        step (no later step reads them).  With replica groups the table read here rides the next step's header
        instead, judged at that step's commit by every group alike (``freescale.speed_share``)."""
        speed, shared = parts.speed, parts.shared_speeds
        assert speed is not None
        last = self.cfg.train.steps - (1 if shared is not None else 0)
        if shared is not None:
            shared.collect()
        elif (answered := speed.answer()) is not None:
            check = speed.judge(done, answered[1])
            self._say_speeds(parts, log, progress, check, frozenset({0}))
            if check.replan:
                parts.loader.set_capacities(check.capacities)
        if speed.due(done) and done < last:
            speed.ask(done)

    def _say_speeds(self, parts: Components, log: RunLog, progress: Progress, check: SpeedCheck,
                    ready: frozenset[int], aloud: bool = True) -> None:
        """A verdict's scores for the step records, its events for the log, its lines on the console (said by
        rank 0 of the lowest ready group only: every group reached the same verdict)."""
        progress.scores = check.scores()
        group_size = parts.feed.group_size if parts.groups > 1 else None
        for line in check.announce(log.write, self.cfg.balance.slow_policy, group_size):
            if aloud and parts.ctx.is_main and parts.group == min(ready, default=parts.group):
                say(line)

    def _calibrate(self, parts: Components, log: RunLog, calibration: Calibration, done: int) -> None:
        model = calibration.fit_and_share(parts.loader.planner.cost_model)
        if model is not None:
            parts.loader.set_cost_model(model)
            log.write("calibrate", step=done, quadratic=model.quadratic, linear=model.linear,
                      constant=model.constant)


def _trained_samples(parts: Components, output: Any) -> int:
    """Samples the group trained in a step with these outputs (collective over the group)."""
    window = parts.task.window()
    window.add(output[1:])
    return int(window.compute()["samples"])
