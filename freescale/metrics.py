"""Click-model metrics over all ranks: loss, AUC and normalized entropy (NE).

NE is the mean log loss divided by the entropy of the base click rate: 1.0 means
no better than always predicting the average click rate; lower is better.
Predictions are gathered from every rank before computing, so the numbers are
for the global set of samples, not rank 0's share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

from freescale.distributed import all_gather_varlen


@dataclass
class ClickMetrics:
    loss: float
    auc: float
    ne: float
    samples: int


def click_metrics(logits: torch.Tensor, labels: torch.Tensor) -> ClickMetrics:
    """Metrics of one set of logits/labels (already gathered)."""
    logits, labels = logits.double(), labels.double()
    n = labels.numel()
    if n == 0:
        return ClickMetrics(float("nan"), float("nan"), float("nan"), 0)
    loss = float(F.binary_cross_entropy_with_logits(logits, labels))
    rate = float(labels.mean())
    if 0.0 < rate < 1.0:
        entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        ne = loss / entropy
        auc = float(binary_auroc(torch.sigmoid(logits), labels.long()))
    else:
        ne, auc = float("nan"), float("nan")
    return ClickMetrics(loss=loss, auc=auc, ne=ne, samples=n)


class MetricWindow:
    """Accumulates this rank's logits and labels; ``compute`` gathers all ranks'."""

    def __init__(self) -> None:
        self._logits: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self._logits.append(logits.detach().float())
        self._labels.append(labels.detach().float())

    def compute(self, reset: bool = True) -> ClickMetrics:
        """Collective: every rank must call it at the same point."""
        device = self._logits[0].device if self._logits else torch.device("cpu")
        logits = torch.cat(self._logits) if self._logits else torch.zeros(0, device=device)
        labels = torch.cat(self._labels) if self._labels else torch.zeros(0, device=device)
        result = click_metrics(all_gather_varlen(logits).cpu(), all_gather_varlen(labels).cpu())
        if reset:
            self._logits.clear()
            self._labels.clear()
        return result
