"""Pieces every model shares: the MLP builder and the (loss, output) convention.

Models return ``(loss, (loss.detach(), logits, labels))``: the first element is
what ``backward`` runs on, the second what metrics read.  This is the shape
torchrec's train pipelines expect from a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ModelOutput = tuple[torch.Tensor, tuple[torch.Tensor, ...]]
"""``(loss, outputs)``: the outputs are what the model's task reads (``freescale.tasks``): a ranker's
``(loss, logits, labels)``, a retrieval model's training sums or evaluation queries."""


def mlp(in_features: int, widths: list[int]) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them (none after the last)."""
    layers: list[nn.Module] = []
    for i, width in enumerate(widths):
        layers.append(nn.Linear(in_features, width))
        if i + 1 < len(widths):
            layers.append(nn.ReLU())
        in_features = width
    return nn.Sequential(*layers)


def bce_output(logits_B: torch.Tensor, labels_B: torch.Tensor, loss_scale: float | None = None) -> ModelOutput:
    """Binary cross-entropy of click logits, in the (loss, output) convention.

    Without ``loss_scale`` the mean over this rank's samples; with it, the sum times
    ``loss_scale`` (the loader sets it so that averaging over ranks gives the mean
    over the whole step's samples when ranks hold different numbers of samples).
    """
    if loss_scale is None:
        loss = F.binary_cross_entropy_with_logits(logits_B, labels_B)
    else:
        loss = F.binary_cross_entropy_with_logits(logits_B, labels_B, reduction="sum") * loss_scale
    return loss, (loss.detach(), logits_B.detach(), labels_B)
