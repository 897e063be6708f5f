"""Stages 6-8 of a step for one replica group: the gradient exchange, the commit, the update.

A pipeline (``freescale.pipeline``) decides what overlaps what inside a step;
it never reduces gradients or steps an optimizer itself.  Where torchrec's
pipelines call ``optimizer.zero_grad()``, ``backward`` and ``optimizer.step()``,
the engine (``freescale.step_engine``) calls a ``StepSync``
(``freescale.step_types``)::

    sync.zero_grad()          # the optimizer's zero_grad, and the tables' rate for this step
    sync.backward(loss)       # loss.backward(), with the dense gradient buckets reduced during it
    sync.exchange()           # the optimizer's step: exchange, commit, update, account -> SyncResult

Two implementations:

- ``LocalSync`` (here, one replica group): dense gradients averaged in the group by
  DDP (``plain``, ``torchrec``) or by ``BucketedGrads`` (``prioritized``);
  every step commits; the fused embedding update already ran inside backward.
- ``freescale.ft.FaultTolerance`` (replica groups): the same in-group stage,
  then the weighted FTAR across groups bucket by bucket during backward, the
  commit vote, and the update applied only once committed (dense optimizer on
  the averaged gradients, the embedding sync of ``freescale.ft.embedding_sync``).

Both check the reduced dense gradients before updating (``train.nonfinite``):
they are identical on every rank that reduced them, so every rank reaches the
same decision with no extra collective.  ``LocalSync`` hands the check back
unsynced (``SyncResult.finite``): the engine reads it at its log points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from freescale.dense_update import DenseUpdate
from freescale.digest import state_digest
from freescale.distributed import collective_device
from freescale.grad_buckets import BucketedGrads
from freescale.step_types import Commit, SyncResult

if TYPE_CHECKING:
    from freescale.step_feed import StepFeed

NONFINITE = ("stop", "skip_step")


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


class LocalSync:
    """One replica group: every step commits (module docstring).

    The reduced dense gradients' finiteness is noted on the device each step (no host sync) and handed
    back in the ``SyncResult``; the engine checks it at its log points, before a checkpoint and at the end:
    the run stops there, naming the first bad step, and no checkpoint is written after it.  (The fused
    embedding update already ran inside backward: only stopping is exact here.)"""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dense: Sequence[nn.Parameter],
                 feed: StepFeed, update: DenseUpdate, grads: BucketedGrads | None = None) -> None:
        self.model, self.optimizer, self.dense, self.feed = model, optimizer, list(dense), feed
        self.grads, self.update = grads, update
        self._step = -1
        self._loss: torch.Tensor | None = None

    def begin_step(self, step: int) -> int:
        self._step, self._loss = step, None
        return step

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

    def exchange(self) -> SyncResult:
        step = self._step
        grads = [p.grad for p in self.dense if p.grad is not None]
        finite = torch.isfinite(torch.nn.utils.get_total_norm(grads)) if grads else None
        self.update.apply(step)
        commit = Commit(step, frozenset({0}), frozenset({0}))
        record = {"weight": self.feed.weight(step), **self.update.record}
        return SyncResult(commit, self.feed.commit(commit), record, finite=finite, loss=self._loss)

    def state_digests(self) -> dict[str, str]:
        return {"digest": state_digest(self.model, self.optimizer)}
