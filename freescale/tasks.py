"""What a model is trained for: the outputs of its steps, their metrics, and its evaluation.

Models return ``(loss, (loss.detach(), *outputs))`` (the shape torchrec's train pipelines expect);
``outputs`` belong to the model's task, which the model names as its ``task`` attribute:

* ``ranking`` (both models): ``(logits_B, labels_B)`` in training and evaluation; metrics loss,
  AUC and NE over every rank (``freescale.metrics``).
* ``retrieval`` (HSTU, ``model.task = "retrieval"``): in training ``(loss_sum, positions,
  samples)`` of the sampled softmax (``freescale.retrieval``), whose metric is the mean loss per
  supervised position; in evaluation ``(query_ND, target_ids_N)``, the query of each sample's last
  position and its held-out item, ranked against the whole item table where torchrec sharded it:
  HR@1/10/50, NDCG@10/50, MRR.

Windows are collective at ``compute`` (every rank of the group calls it at the same point; the
retrieval evaluator at every ``add`` too: it ranks against the sharded table) and return plain
floats, ``samples`` among them.  The trainer, the progress output and the run log go
through this module only: nothing else names a task's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from freescale.distributed import collective_device, spans_ranks
from freescale.metrics import MetricWindow
from freescale.retrieval import RankCounter, RetrievalWindow

TASKS = ("ranking", "retrieval")


class StepWindow(Protocol):
    def add(self, outputs: Sequence[torch.Tensor]) -> None: ...

    def compute(self) -> dict[str, float]: ...


class Task(Protocol):
    name: str
    headline: str | None
    """The metric printed beside the loss in progress lines (``None``: the loss alone)."""

    def window(self, group: dist.ProcessGroup | None = None) -> StepWindow: ...

    def evaluator(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> StepWindow: ...


class RankingWindow:
    """Loss, AUC and NE of click logits (``metrics.MetricWindow``)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._window = MetricWindow(group)

    def add(self, outputs: Sequence[torch.Tensor]) -> None:
        logits, labels = outputs[0], outputs[1]
        self._window.add(logits, labels)

    def compute(self) -> dict[str, float]:
        m = self._window.compute()
        return {"loss": m.loss, "auc": m.auc, "ne": m.ne, "samples": m.samples}


class Ranking:
    name: str = "ranking"
    headline: str | None = "auc"

    def window(self, group: dist.ProcessGroup | None = None) -> StepWindow:
        return RankingWindow(group)

    def evaluator(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> StepWindow:
        return RankingWindow(group)


class SampledLossWindow:
    """The sampled softmax's mean loss per supervised position, over every rank.  ``add`` stays on the
    outputs' device (no host synchronisation); ``compute`` reduces on the group's collective device."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._sums: torch.Tensor | None = None

    def add(self, outputs: Sequence[torch.Tensor]) -> None:
        step = torch.stack([t.detach().double().reshape(()) for t in outputs[:3]])
        self._sums = step if self._sums is None else self._sums + step.to(self._sums.device)

    def compute(self) -> dict[str, float]:
        sums = self._sums if self._sums is not None else torch.zeros(3, dtype=torch.float64)
        self._sums = None
        if spans_ranks(self._group):
            sums = sums.to(collective_device(self._group))
            dist.all_reduce(sums, group=self._group)
        loss, positions, samples = sums.tolist()
        return {"loss": loss / positions if positions else float("nan"), "positions": int(positions),
                "samples": int(samples)}


class RankWindow:
    """Evaluation of next-item retrieval: each query's held-out item ranked among all items."""

    def __init__(self, counter: RankCounter, group: dist.ProcessGroup | None = None) -> None:
        self._counter, self._window, self._samples = counter, RetrievalWindow(group), 0

    def add(self, outputs: Sequence[torch.Tensor]) -> None:
        query, target = outputs[0], outputs[1]
        greater, ties = self._counter.count(query, target)
        self._window.add(greater, ties)

    def compute(self) -> dict[str, float]:
        result = self._window.compute()
        return {**result.values, "samples": result.queries}


class Retrieval:
    name: str = "retrieval"
    headline: str | None = None

    def __init__(self, item_table: str) -> None:
        self.item_table = item_table
        """The embedding table the queries are scored against (its ``<name>.weight`` in the state dict)."""

    def window(self, group: dist.ProcessGroup | None = None) -> StepWindow:
        return SampledLossWindow(group)

    def evaluator(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> StepWindow:
        suffix = f"{self.item_table}.weight"
        weights = [w for key, w in model.state_dict().items() if key.endswith(suffix)]
        if len(weights) != 1:
            raise ValueError(f"retrieval evaluation: the model has {len(weights)} tables named '{self.item_table}'")
        return RankWindow(RankCounter.of_sharded(weights[0], group), group)


def task_of(model: nn.Module) -> Task:
    """The task a model names (``task`` attribute, through ``DistributedModelParallel``'s ``module``);
    a model that names none is a click ranker."""
    inner = getattr(model, "module", model)
    found: Task | None = getattr(inner, "task", None) or getattr(model, "task", None)
    return found or Ranking()
