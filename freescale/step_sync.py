"""Stages 6-8 of a step: the gradient exchange, the commit, the update, behind one interface.

A pipeline (``freescale.pipeline``) decides what overlaps what inside a step;
it never reduces gradients or steps an optimizer itself.  It calls a
``StepSync`` at three points::

    sync.zero_grad()          # the pipeline's optimizer.zero_grad()
    sync.backward(loss)       # loss.backward(), with the dense gradient buckets reduced during it
    sync.step()               # the pipeline's optimizer.step(): exchange, commit, update, account

and the engine (``freescale.trainer``) calls ``begin_step(step)`` before the
pipeline runs the step, and ``step()`` itself for a step this rank sits out.
Two implementations:

- ``LocalSync`` (one replica group): dense gradients averaged in the group by
  DDP (``plain``, ``torchrec``) or by ``BucketedGrads`` (``prioritized``);
  every step commits; the fused embedding update already ran inside backward.
- ``freescale.ft.FaultTolerance`` (replica groups): the same in-group stage,
  then the weighted FTAR across groups bucket by bucket during backward, the
  commit vote, and the update applied only once committed (dense optimizer on
  the averaged gradients, the deferred union update of the embedding tables).

Both check the reduced dense gradients before updating (``train.nonfinite``):
they are identical on every rank that reduced them, so every rank reaches the
same decision with no extra collective.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from freescale.dense_update import DenseUpdate
from freescale.distributed import collective_device
from freescale.grad_buckets import BucketedGrads
from freescale.step_feed import Commit, StepFeed

NONFINITE = ("stop", "skip_step")


class JobFinished(Exception):
    """Another replica group finished the run (the lighthouse said so): nothing is left to train."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the run finished at step {step}")
        self.step = step


class NonFiniteError(RuntimeError):
    """A step's loss or gradients are not finite (``train.nonfinite = "stop"``): one line for the user."""


class StepSync(Protocol):
    """The step's exchange, commit and update, and the few run-level points a replica layer needs.
    The engine calls every one of them, with or without fault tolerance."""

    record: dict[str, Any]
    """Fields of the last step for the step's log record (quorum, weights, timings)."""
    last_commit: Commit
    events: deque[dict[str, Any]]
    """Events for the run log since the engine last took them (catch-up, staging, skipped steps); bounded."""
    warms_up: bool
    """Wants one forward/backward before the first step (``warm_up``): peers would wait for its lazy set-up."""

    def fresh_run(self) -> bool:
        """A checkpoint may be resumed from (fault tolerance: no group has progress yet)."""

    def start(self) -> None:
        """Before the first step (fault tolerance: wait for the peers)."""

    def warm_up(self, loss: torch.Tensor) -> None: ...

    def begin_step(self, step: int) -> None: ...

    def can_train(self, step: int) -> bool: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None: ...

    def step(self) -> Commit: ...

    def check_finite(self) -> None:
        """Raise ``NonFiniteError`` if a step so far had non-finite gradients (the engine calls it at
        its log points, before a checkpoint and at the end: no host sync in every step)."""

    def owns_checkpoint(self, commit: Commit) -> bool:
        """This rank's group writes the checkpoint after ``commit``."""

    def finish(self, last_step: int) -> None: ...

    def close(self) -> None: ...


def all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    present = [t for t in tensors if t is not None]
    return not present or bool(torch.isfinite(torch.nn.utils.get_total_norm(present)).item())


def nonfinite_message(step: int, loss: torch.Tensor | None, group: Any = None, where: str = "") -> str:
    """One line, the same on every rank of ``group`` (a collective there: every rank of it calls this
    at the same step, as they all see the same reduced gradients): the step, and the ranks whose
    loss was not finite (``loss`` None: this rank did not train the step)."""
    mine = torch.tensor([float(loss) if loss is not None else 0.0, 0.0 if loss is None else 1.0],
                        dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        device = collective_device(group)
        gathered = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine.to(device), group=group)
        rows = [t.tolist() for t in gathered]
    else:
        rows = [mine.tolist()]
    bad = [f"rank {r} ({v:.6g})" for r, (v, trained) in enumerate(rows) if trained and not math.isfinite(v)]
    if bad:
        culprit = f"non-finite loss on {', '.join(bad)}"
    elif not any(trained for _, trained in rows):
        culprit = "this group did not train the step; the gradients averaged from the others are not finite"
    else:
        culprit = "finite losses but non-finite gradients"
    return (f"step {step}{where}: {culprit}; training stopped and no checkpoint was written after it "
            "(train.nonfinite = 'stop'): resume from the last checkpoint, or lower the learning rate")


class SyncedOptimizer:
    """What a torchrec pipeline sees as its optimizer: ``zero_grad`` and ``step`` go to the sync."""

    def __init__(self, sync: StepSync) -> None:
        self.sync = sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        self.sync.step()


class LocalSync:
    """One replica group: every step commits (module docstring).

    Non-finite gradients are noted on the device each step (no host sync) and checked at the
    engine's log points, before a checkpoint and at the end: the run stops there, naming the first
    bad step; no checkpoint is written after it, so the last good one stays the one to resume from.
    (The fused embedding update already ran inside backward: only stopping is exact here.)"""

    warms_up = False

    def __init__(self, optimizer: torch.optim.Optimizer, dense: Sequence[nn.Parameter], feed: StepFeed,
                 update: DenseUpdate, grads: BucketedGrads | None = None) -> None:
        self.optimizer, self.dense, self.feed, self.grads, self.update = optimizer, list(dense), feed, grads, update
        self.record: dict[str, Any] = {}
        self.events: deque[dict[str, Any]] = deque()
        self.last_commit = Commit(-1, frozenset(), frozenset())
        self._step = -1
        self._loss: torch.Tensor | None = None
        self._first_bad: torch.Tensor | None = None
        """[step, loss] of the first step whose reduced dense gradients were not finite (step -1: none)."""

    def fresh_run(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def warm_up(self, loss: torch.Tensor) -> None:
        pass

    def begin_step(self, step: int) -> None:
        self._step, self._loss = step, None

    def can_train(self, step: int) -> bool:
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.update.before_tables(self._step)  # the fused tables update inside this step's backward

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None:
        self._loss = loss.detach()
        if self.grads is None:
            loss.backward()  # DDP reduces the dense buckets during it
            return
        self.grads.begin()
        loss.backward()
        self.grads.finish()

    def step(self) -> Commit:
        step = self._step
        self._note_finite(step)
        self.update.apply(step)
        commit = Commit(step, frozenset({0}), frozenset({0}))
        self.record = {"weight": self.feed.weight(step), **self.update.record}
        self.feed.commit(commit)
        self.last_commit = commit
        return commit

    def _note_finite(self, step: int) -> None:
        grads = [p.grad for p in self.dense if p.grad is not None]
        if not grads:
            return
        bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads))
        loss = self._loss.reshape(()).double() if self._loss is not None else torch.tensor(float("nan"))
        now = torch.stack([torch.tensor(float(step), dtype=torch.float64, device=loss.device), loss.to(bad.device)])
        if self._first_bad is None:
            self._first_bad = torch.tensor([-1.0, 0.0], dtype=torch.float64, device=bad.device)
        self._first_bad = torch.where((self._first_bad[0] < 0) & bad, now, self._first_bad)

    def check_finite(self) -> None:
        if self._first_bad is None:
            return
        step, loss = self._first_bad.tolist()
        if step >= 0:  # the same on every rank: the reduced gradients are
            raise NonFiniteError(nonfinite_message(int(step), torch.tensor(loss)))

    def owns_checkpoint(self, commit: Commit) -> bool:
        return True

    def finish(self, last_step: int) -> None:
        pass

    def close(self) -> None:
        pass
