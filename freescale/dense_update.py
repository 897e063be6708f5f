"""A committed step's update, in one place: clip the dense gradients, step the optimizers, follow the LR schedule.

Both step syncs call it: ``LocalSync`` after the group's all-reduce, and fault
tolerance's ``FaultTolerance._apply`` on the committed, sample-weighted average
of every group's gradients.  So clipping and the schedule are written once, and
every replica group computes them from the same inputs: the same norm, the same
factor, bit for bit.

- **Clipping** (``optim.clip_grad_norm``): the dense gradients' global 2-norm,
  scaled down to the limit when above it.  The dense gradients are reduced
  before this point, so every rank of a group (and every group) holds the same
  ones: the norm needs no further communication.  The fused embedding tables
  have no gradient to clip (fbgemm updates their rows inside backward, or in the
  union update) and row-wise Adagrad scales each row's step by its own history.
- **LR schedule** (``optim.lr_schedule``): a factor of the committed step alone
  (constant, or linear warm-up then cosine or linear decay to
  ``min_lr_ratio``), applied to each optimizer's base rate: the dense AdamW's and
  the fused tables' (fbgemm's ``set_learning_rate``).  Being a function of the
  step, it has no state to save or to send a recovering group: a checkpoint's
  step and a catch-up's step restore it.  The tables' rate is set before the
  update that uses it: before the step's backward without fault tolerance, before
  the union update with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SCHEDULES = ("constant", "warmup_cosine", "warmup_linear")


@dataclass(frozen=True)
class LRSchedule:
    """``factor(step)``: the share of the base learning rate at a step (0-based)."""

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    """Where the decay ends (the run's ``train.steps``)."""
    min_ratio: float = 0.0

    @property
    def active(self) -> bool:
        """It ever changes the rate."""
        return self.kind != "constant" or self.warmup_steps > 0

    def factor(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        done = min(1.0, max(0, step - self.warmup_steps) / span)
        decay = 0.5 * (1 + math.cos(math.pi * done)) if self.kind == "warmup_cosine" else 1.0 - done
        return self.min_ratio + (1 - self.min_ratio) * decay


class DenseUpdate:
    """Clip -> optimizer step -> the next rate, for the dense optimizers over ``params``; the fused tables'
    rate through ``tables`` (fbgemm TBEs).  ``record`` holds the last step's rate and gradient norm."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], params: Sequence[nn.Parameter],
                 schedule: LRSchedule, clip_norm: float = 0.0, tables: Sequence[Any] = (),
                 scheduler: Any | None = None) -> None:
        self.optimizers, self.params, self.schedule, self.clip_norm = list(optimizers), list(params), schedule, clip_norm
        self.tables = list(tables)
        self.scheduler = scheduler
        """A user's own ``torch.optim.lr_scheduler`` (the fault-tolerant wrapper form): stepped after every
        committed update here, so a recovering group's replayed steps step it too."""
        self._base = [[group["lr"] for group in opt.param_groups] for opt in self.optimizers]
        self._table_base = [tbe.get_learning_rate() for tbe in self.tables]
        self.record: dict[str, float] = {}

    def before_tables(self, step: int) -> None:
        """Set the fused tables' rate for ``step``'s update: before the lookups whose backward makes it, after
        anything that resets it (torchrec's fused optimizer sets its base rate in every ``zero_grad``)."""
        if self.schedule.active:
            factor = self.schedule.factor(step)
            for tbe, base in zip(self.tables, self._table_base):
                tbe.set_learning_rate(base * factor)

    def apply(self, step: int) -> None:
        """The dense update of committed ``step`` from the gradients in ``params``' ``.grad``."""
        factor = self.schedule.factor(step)
        if self.schedule.active:  # else the rates are left alone (a user's loop may run its own scheduler)
            for opt, bases in zip(self.optimizers, self._base):
                for group, base in zip(opt.param_groups, bases):
                    group["lr"] = base * factor
            self.record = {"lr_factor": factor}
        else:
            self.record = {}
        if self.clip_norm > 0:
            grads = [p for p in self.params if p.grad is not None]
            if grads:
                norm = torch.nn.utils.clip_grad_norm_(grads, self.clip_norm, foreach=True)
                self.record["grad_norm"] = float(norm)  # a host sync, only when clipping
        for opt in self.optimizers:
            opt.step()
        if self.scheduler is not None:
            self.scheduler.step()
