"""``StepEngine``: one step of one rank, from its planned batch to its outcome.

The trainer (``freescale.trainer``) calls ``run(step)`` and gets a ``StepOutcome``
(``freescale.step_types``) back: the commit, what the data side accounted, the
step's log fields and events, the model's output, the batch's plan and the
timings.  Nothing about the step is read anywhere else afterwards.

Inside a step, in order::

    sync.begin_step(step)        fault tolerance: the quorum request, whose round trip overlaps the forward
                                 (a restarted group's waiting join: a later step, its state and data position
                                 loaded; feed.read_in_flight then reads its share of the steps planned with it)
    feed.head(step)              the step's plan (made ahead on the loader's prefetch thread: StepFeed)
    pipeline.progress(batches)   input dist, lookups, output dist, dense forward and backward (the
                                 pipeline calls zero_grad / backward / step here: this object's,
                                 handed to the sync; ``step`` is the sync's exchange)
    sync.exchange()              for a step this rank sits out: zeros with weight 0, the same collectives

torchrec's pipelines call the optimizer's ``step`` from inside ``progress``
and return only the model's output: the exchange's result is kept here from
that call until ``run`` returns it.

One group's sync hands the step's finiteness back unsynced (a device flag):
the first bad step is kept on the device and raised by ``check_finite`` at
the trainer's log points, before a checkpoint and at the end (no host sync
in every step).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from freescale.comm_trace import CommTracer
from freescale.pipeline import PipelineConfig, StepOutput, StepPipeline, build_pipeline
from freescale.step_feed import StepFeed
from freescale.step_sync import nonfinite_message
from freescale.step_types import NonFiniteError, StepOutcome, StepSync, SyncResult
from freescale.testing import StepHooks

PRECISIONS = ("fp32", "bf16")


def precision_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """What the step's forward and backward run in: bf16 autocast on CUDA, else nothing.  The bf16 path
    has not yet run in a training step on a GPU."""
    if precision == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def step_seed(seed: int, slot: int, step: int) -> int:
    """The torch generator's seed for one rank slot's step (``freescale train`` seeds it before the step's
    forward): what the model draws (dropout masks) differs across ranks and steps, and repeats exactly when a
    resumed run trains the step again.  A loop of the user's own seeds nothing: call
    ``torch.manual_seed(step_seed(seed, slot, step))`` before its forward for the same."""
    return int(np.random.SeedSequence([seed, slot, step]).generate_state(1, np.uint64)[0])


class StepEngine:
    """Runs the steps of one rank (module docstring)."""

    def __init__(self, sync: StepSync, feed: StepFeed, pipeline_cfg: PipelineConfig, model: nn.Module,
                 device: torch.device, precision: str, *, seed: int = 0, slot: int = 0, hooks: StepHooks | None = None,
                 tracer: CommTracer | None = None) -> None:
        self.sync, self.feed, self.device, self.precision = sync, feed, device, precision
        self.seed, self.slot = seed, slot
        """``step_seed``'s: the run's seed and this rank's slot (group x group ranks + rank)."""
        self.hooks = hooks or StepHooks()
        self.audit = self.hooks.audit
        self.tracer = tracer
        self._cpu_start = 0.0
        self.pipeline: StepPipeline = build_pipeline(pipeline_cfg, model, self, device)
        self._step = -1
        self._exchanged: SyncResult | None = None
        """The sync's result of the step running now (set by the pipeline's ``step``; taken by ``run``)."""
        self._first_bad: torch.Tensor | None = None
        """[step, loss] of the first step whose reduced dense gradients were not finite (step -1: none)."""

    # ------------------------------------------------------------------ what the pipeline calls
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grad(set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        """The pipeline's loss is already scaled so that the in-group average of the ranks' gradients is the
        group's mean (the loader's ``loss_scale``); its weight across groups is the group's samples."""
        self.sync.backward(loss, self.feed.weight(self._step))
        self.hooks.stretch(self._step, time.thread_time() - self._cpu_start)  # (tests: a rank made slower)

    def step(self) -> None:
        self._exchanged = self.sync.exchange()

    # ------------------------------------------------------------------ what the trainer calls
    def run(self, step: int) -> StepOutcome:
        """One step (module docstring).  Raises ``JobFinished`` when another group finished the run."""
        if self.tracer is not None:
            self.tracer.step = step
        start, cpu_start = time.perf_counter(), time.thread_time()
        joined = self.sync.begin_step(step)
        if joined != step:  # ``[ft] join = "wait"``: the snapshot of the step before ``joined`` is loaded
            self.feed.read_in_flight()  # (the process's first step: its pipeline holds no batch to forget)
            step = joined
            if self.tracer is not None:
                self.tracer.step = step
        self._step, self._cpu_start = step, cpu_start
        trains = self.sync.can_train(step) and self.feed.trains(step)
        info = self.feed.head(step).info if trains else None
        output: StepOutput | None = None
        if trains:
            torch.manual_seed(step_seed(self.seed, self.slot, step))  # the forward of this step's batch draws next
            with precision_context(self.device, self.precision):
                output = self.pipeline.progress(self.feed.batches())
            result, self._exchanged = self._exchanged, None
            if result is None:
                raise RuntimeError(f"step {step}: the pipeline trained a batch but never called the optimizer's step")
        else:
            result = self.sync.exchange()
        commit = result.commit
        if not commit.applied or commit.restored:  # catching up: batches in flight were planned for nothing
            self.pipeline.reset()
            self.feed.discard_batches()
        if result.finite is not None:
            self._note_finite(step, result)
        busy_s, wall_s = time.thread_time() - cpu_start + self.hooks.stretched(), time.perf_counter() - start
        digests = self.sync.state_digests() if self.audit and commit.applied else {}  # (not timed: tests only)
        return StepOutcome(commit, result.accounted, result.record, result.events, output, info,
                           busy_s=busy_s, wall_s=wall_s, digests=digests)

    def check_finite(self) -> None:
        """Raise ``NonFiniteError`` if a step so far had non-finite reduced gradients (one group; the same on
        every rank: the reduced gradients are)."""
        if self._first_bad is None:
            return
        step, loss = self._first_bad.tolist()
        if step >= 0:
            raise NonFiniteError(nonfinite_message(int(step), torch.tensor(loss)))

    def detach(self) -> nn.Module:
        """The model usable on its own (evaluation)."""
        return self.pipeline.detach()

    def _note_finite(self, step: int, result: SyncResult) -> None:
        assert result.finite is not None
        bad = ~result.finite
        loss = result.loss.reshape(()).double() if result.loss is not None else torch.tensor(float("nan"))
        now = torch.stack([torch.tensor(float(step), dtype=torch.float64, device=loss.device), loss.to(bad.device)])
        if self._first_bad is None:
            self._first_bad = torch.tensor([-1.0, 0.0], dtype=torch.float64, device=bad.device)
        self._first_bad = torch.where((self._first_bad[0] < 0) & bad, now, self._first_bad)
