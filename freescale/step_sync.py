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
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

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
    record: dict[str, Any]
    """Fields of the last step for the step's log record (quorum, weights, timings)."""
    last_commit: Commit

    def begin_step(self, step: int) -> None: ...

    def can_train(self, step: int) -> bool: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None: ...

    def step(self) -> Commit: ...


def all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    present = [t for t in tensors if t is not None]
    return not present or bool(torch.isfinite(torch.nn.utils.get_total_norm(present)).item())


def nonfinite_message(step: int, loss: torch.Tensor | None, group: Any = None, where: str = "") -> str:
    """One line, the same on every rank of ``group`` (a collective there: every rank of it calls this
    at the same step, as they all see the same reduced gradients): the step and each rank's loss."""
    mine = torch.tensor([float(loss) if loss is not None else float("nan")], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else mine.device
        losses = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(losses, mine.to(device), group=group)
        values = [float(t) for t in losses]
    else:
        values = [float(mine)]
    bad = [f"rank {r} ({v:.6g})" for r, v in enumerate(values) if not math.isfinite(v)]
    culprit = f"non-finite loss on {', '.join(bad)}" if bad else "finite losses but non-finite gradients"
    return (f"step {step}{where}: {culprit}; training stopped before the update (train.nonfinite = 'stop'): "
            "resume from the last checkpoint, or lower the learning rate")


class SyncedOptimizer:
    """What a torchrec pipeline sees as its optimizer: ``zero_grad`` and ``step`` go to the sync."""

    def __init__(self, sync: StepSync) -> None:
        self.sync = sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        self.sync.step()


class LocalSync:
    """One replica group: every step commits (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, dense: Sequence[nn.Parameter], feed: StepFeed,
                 rank: int, grads: BucketedGrads | None = None, nonfinite: str = "stop") -> None:
        self.optimizer, self.dense, self.feed, self.rank = optimizer, list(dense), feed, rank
        self.grads, self.nonfinite = grads, nonfinite
        self.record: dict[str, Any] = {}
        self.last_commit = Commit(-1, frozenset(), frozenset())
        self._step = -1
        self._loss: torch.Tensor | None = None

    def begin_step(self, step: int) -> None:
        self._step, self._loss = step, None

    def can_train(self, step: int) -> bool:
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

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
        if not all_finite([p.grad for p in self.dense]):
            # The fused embedding update already ran inside backward: only stopping is exact here.
            raise NonFiniteError(nonfinite_message(step, self._loss))
        self.optimizer.step()
        commit = Commit(step, frozenset({0}), frozenset({0}))
        self.record = {"weight": self.feed.weight(step)}
        self.feed.commit(commit)
        self.last_commit = commit
        return commit
