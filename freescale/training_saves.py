"""The training loop's saves: when each is taken, and the three things that make one.

A save is taken after a committed step when it is due (``checkpoint.every``, the last step, a validation
that may be the best, an early stop).  Three parts make it, and the loop waits for none of them but the
first:

- at the save step, the state's host copy begins (``staging.LazySaves``: the dense state at once, the
  tables over the steps after it, copy-on-write) or, without lazy copying, is made whole;
- at the step every rank agreed on, the tables' copy is finished and the writer's thread takes it
  (``checkpoint.CheckpointWriter``: DCP's write and the commit, on a gloo group of its own);
- the writer's commit is noted at a later step (``poll``) and logged.

A periodic save that comes due while the one before it is still being copied or written, on any rank of
the group, is skipped (``checkpoint.skip_while_busy``): the next multiple of ``checkpoint.every`` asks again.
Otherwise that step would wait for the whole of the previous write, and the new save's copy would compete
with it for the same cores.  Every rank asks at the same steps (one small asynchronous all-reduce, a step before
each periodic save: ``_BusyPoll``) and gets the same answer.  A save is never moved to another step: checkpoints are taken only
where the pipeline holds no read-ahead batch (``components.segment_end_of``), which is what makes a resumed
run train exactly as the uninterrupted one did.  The last step's save, a kept-best validation's and an early
stop's are never skipped: they wait for the previous save instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale import checkpoint, reshard
from freescale.components import Components, TrainerConfig
from freescale.config import to_dict
from freescale.distributed import DistContext
from freescale.rank_console import say
from freescale.resume import raw_state
from freescale.run_log import RunLog
from freescale.step_types import Commit


class TrainingSaves:
    """The saves of one training run (module docstring).  Every method that may save is collective over the
    group, called by every rank at the same step."""

    def __init__(self, cfg: TrainerConfig, parts: Components, log: RunLog, root: Path,
                 fence: checkpoint.Fence | None) -> None:
        self.cfg, self.root, self.log = cfg, root, log
        self._config = to_dict(cfg)
        """The configuration each save's metadata holds (fixed once training starts)."""
        slow = parts.hooks.wants("write")
        self.writer = checkpoint.CheckpointWriter(cfg.checkpoint.async_save, _checkpoint_group(parts.ctx), fence,
                                                  before_write=(lambda step: parts.hooks.at("write", step)) if slow
                                                  else None, write_share=cfg.checkpoint.write_share,
                                                  reuse_plans=cfg.checkpoint.reuse_plans)
        self.staging = parts.staging
        if self.staging is not None:  # the host copy of the tables the saves reuse, made and touched now
            log.write("checkpoint_buffers", seconds=self.staging.prepare(raw_state(parts)))
        self._lazy: tuple[int, dict[str, Any]] = (-1, {})
        """The save whose tables are being copied (its ``LazySnapshot`` is the staging's): step, metadata."""
        self._said_skipped = False
        self._poll = _BusyPoll(parts.side_group)
        self.last: Path | None = None
        """The newest checkpoint this run committed."""

    # ------------------------------------------------------------------ at each committed step
    def after_commit(self, parts: Components, commit: Commit, step_s: float, stop: bool) -> None:
        """After step ``commit.step`` committed (``stop``: the run stops after it): save if due, copy this
        step's share of the tables, hand a finished copy to the writer, note a committed save."""
        done = commit.step + 1
        urgent = self._urgent(done, parts, stop)
        answer = self._poll.answer(done) if self._periodic(done) else None
        if urgent or self._periodic(done):
            self._save_unless_busy(parts, commit, may_skip=not urgent, answer=answer)
        if self.staging is not None and self.staging.boundary(done, step_s):
            self.write_copied()
        self.writer.poll()
        self.note_committed()
        ahead = done + 1
        if not stop and ahead <= self.cfg.train.steps and self._periodic(ahead) and any(self._skips_or_lazy(ahead)):
            self._poll.ask(ahead, [int(self._busy()), self._copy_steps(ahead)])

    def _periodic(self, done: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every and done % every == 0)

    def _urgent(self, done: int, parts: Components, stop: bool) -> bool:
        """A save that cannot wait: the last step's, a validation's that may be the best, an early stop's."""
        c = self.cfg.checkpoint
        kept = parts.validation is not None and parts.validation.keep_best and parts.validation.due(done)
        return bool((c.save_final and (done == self.cfg.train.steps or stop)) or kept)

    def _skips_or_lazy(self, done: int, may_skip: bool = True) -> tuple[bool, bool]:
        """Whether a save after ``done`` steps may be skipped while one is busy, and copies its tables lazily:
        either needs the group's agreement first (``_BusyPoll``)."""
        skips = may_skip and self.cfg.checkpoint.skip_while_busy and self.writer.asynchronous
        lazy = self.writer.asynchronous and self.staging is not None and done < self.cfg.train.steps
        return skips, lazy

    def _copy_steps(self, done: int) -> int:
        """This rank's estimate of the steps a save after ``done`` steps copies its tables over."""
        c = self.cfg.checkpoint
        if not self._skips_or_lazy(done)[1] or self.staging is None:
            return 0
        within = c.every - done % c.every - 1 if c.every and not c.skip_while_busy else None
        return self.staging.steps_needed(within)

    def _save_unless_busy(self, parts: Components, commit: Commit, may_skip: bool,
                          answer: list[int] | None = None) -> None:
        """The group agrees on both (``answer``, asked a step before; else one all-reduce now): whether any
        rank is still busy with the previous save, and the step the new save's tables are copied by (the
        slowest rank's estimate)."""
        parts.engine.check_finite()  # every group, owner or not: never a step past a non-finite one unseen
        if not self.owns(parts, commit):
            return
        done = commit.step + 1
        skips, lazy = self._skips_or_lazy(done, may_skip)
        if not skips and not lazy:
            self.save(parts, commit)
            return
        c = self.cfg.checkpoint
        if answer is None:
            answer = self._poll.agree([int(self._busy()), self._copy_steps(done)])
        busy, steps = answer
        busy = int(skips and busy)
        if busy:
            self.log.write("checkpoint_skipped", step=done, reason="the previous save is still being copied or written")
            if not self._said_skipped and parts.ctx.is_main:  # (the owning group's rank 0)
                say(f"freescale: the save due at step {done} is skipped: the previous one is still being copied or "
                    f"written (checkpoint.every = {c.every} is shorter than a save takes here: its tables are copied "
                    "within checkpoint.stage_budget of each step, then written; the next multiple asks again; "
                    "checkpoint.skip_while_busy = false waits for it instead)")
            self._said_skipped = True
            return
        self.save(parts, commit, copy_steps=steps if lazy else None)

    def _busy(self) -> bool:
        """This rank still copies or writes a save (its next one would wait for it)."""
        return self.writer.busy or (self.staging is not None and self.staging.snapshot is not None)

    @staticmethod
    def owns(parts: Components, commit: Commit) -> bool:
        """Whether this group writes ``commit``'s checkpoint (with replica groups: collective over the group)."""
        return parts.replicas is None or parts.replicas.owns_checkpoint(commit)

    # ------------------------------------------------------------------ one save
    def save(self, parts: Components, commit: Commit, copy_steps: int | None = None) -> None:
        """Collective over the group, which owns ``commit``'s checkpoint.  A background save takes a host copy:
        of the tables, made over the next ``copy_steps`` steps (``staging.py``; None: at once); of everything
        else, made here.  The writer's thread does the rest."""
        parts.engine.check_finite()  # never a checkpoint after a non-finite step
        self.write_copied()  # a save whose tables are still being copied goes first (checkpoints in order)
        self.writer.poll()  # the one before it, if written: logged before this one is staged
        self.note_committed()
        start, done, writer = time.perf_counter(), commit.step + 1, self.writer
        meta = {"data": parts.feed.state_dict(), "world_size": parts.feed.group_size, "config": self._config,
                "ft": {"replicas": parts.groups}, "plan": reshard.plan_summary(parts.dmp),
                "validation": parts.validation.tracker.state_dict() if parts.validation is not None else None}
        live = raw_state(parts)
        if copy_steps is not None and self.staging is not None:
            self.staging.begin(live, done, copy_steps, reuse=not writer.writing)
            self._lazy = (done, meta)  # written once the tables' copy is done
            self.log.write("checkpoint_staged", step=done, seconds=time.perf_counter() - start,
                           tables_due=self.staging.due)
            return
        path = writer.start(self.root, done, live, meta, keep=self.cfg.checkpoint.keep, convert=_logical)
        self.note_committed()
        if path is not None:  # written in this call (checkpoint.async_save = false)
            self.note_committed((path, time.perf_counter() - start))
        else:  # copied; written and committed in the background, noted at a later step's poll
            self.log.write("checkpoint_staged", step=done, seconds=time.perf_counter() - start)

    def write_copied(self) -> None:
        """Collective (at the step every rank agreed on, or at the end): the tables' copy of the save in
        progress is completed, and the writer's thread writes it."""
        snapshot = self.staging.take() if self.staging is not None else None
        if snapshot is None:
            return
        step, meta = self._lazy
        taken = snapshot.finish()
        self.writer.start(self.root, step, snapshot.assemble, meta, keep=self.cfg.checkpoint.keep, convert=_logical)
        self.note_committed()  # the save before it, if its write had to be waited for
        self.log.write("checkpoint_tables_copied", step=step, **taken)

    def restored(self) -> None:
        """The whole state was replaced (caught up from a peer): a copy in progress would mix two states."""
        snapshot = self.staging.take() if self.staging is not None else None
        if snapshot is not None:
            snapshot.discard()
            self.log.write("checkpoint_discarded", step=self._lazy[0], reason="state restored from a peer")

    def note_committed(self, finished: tuple[Path, float] | None = None) -> None:
        """Log each save that committed (``finished``, or the writer's), and remember the last."""
        done: list[tuple[Any, ...]] = [finished] if finished is not None else []
        done += self.writer.committed
        self.writer.committed.clear()
        for path, seconds, *paced in done:  # (the writer's: its thread's CPU and sleep, its start's CPU and time)
            figures = dict(zip(("write_cpu_s", "paced_s", "start_cpu_s", "start_s"), paced, strict=False))
            self.log.write("checkpoint", step=int(path.name.rsplit("_", 1)[1]), path=str(path), seconds=seconds,
                           **figures)
            self.last = path

    # ------------------------------------------------------------------ at the end
    def complete(self) -> None:
        """Collective: the save in progress copied, written and committed (the end of training, or a stop
        every rank makes together)."""
        try:
            self.write_copied()
            self.writer.wait()
            self.note_committed()
        finally:
            self.writer.plans.forget()  # (kept for this run's saves only)

    def abandon(self) -> None:
        """Stopped (^C, the CLI's SIGTERM, a peer's failure): no half-written save left behind."""
        self.writer.abandon()
        self.writer.plans.forget()


def _logical(state: dict[str, Any], group: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state a checkpoint holds (``reshard.to_logical``: collective over ``group``) and its layouts."""
    app, layouts = reshard.to_logical(state["model"], state["optim"], group)
    return app, {"layouts": layouts}


class _BusyPoll:
    """The group's answer to "is any rank still copying or writing the previous save, and over how many steps
    would each copy the next one", asked one step before each periodic save (an asynchronous all-reduce on the
    gloo group the speed check shares, beside the training's collectives and the writer's:
    ``freescale.distributed.side_group``) and read at the save step: by then it is in, so the save step waits
    for no round trip.  (Asked at the save step, the all-reduce also waited for the slowest rank to reach it:
    0.6-8.6 ms, ``benchmarks/bench_saves.py``.)  The answer is a step old: it is asked after everything the step before the save did (a save begun then counts as busy), and a
    save that finishes during the save's own step is noticed at the next periodic save instead."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._asked: tuple[int, torch.Tensor, Any] | None = None

    def ask(self, done: int, values: list[int]) -> None:
        """After step ``done - 1`` committed: the save after ``done`` steps' question (collective, async)."""
        found = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group, async_op=True) if self.group else None
        self._asked = (done, found, work)

    def answer(self, done: int) -> list[int] | None:
        """The answer asked for ``done`` (collective: every rank asked, at the same step), or None if not asked."""
        asked, self._asked = self._asked, None
        if asked is None or asked[0] != done:
            return None
        _, found, work = asked
        if work is not None:
            work.wait()
        return [int(v) for v in found.tolist()]

    def agree(self, values: list[int]) -> list[int]:
        """The largest of each of ``values`` over the group's ranks, now (a save nobody asked about ahead)."""
        self.ask(-1, values)
        answer = self.answer(-1)
        assert answer is not None
        return answer


def _checkpoint_group(ctx: DistContext) -> Any:
    """A gloo group for background saves: their collectives run beside the training's, never on its group
    (and DCP's background save needs a CPU backend, which an NCCL-only default group lacks)."""
    if dist.is_initialized():
        return dist.new_group(backend="gloo")
    return None
