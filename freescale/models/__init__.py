"""Models: ``hstu`` (sequence model over item histories) and ``dlrm``.

``build_model`` picks one from ``ModelConfig.kind`` and sizes its tables from the
dataset manifest.  Every model exposes ``sparse_feature_names`` (the KJT keys it
reads) and returns ``(loss, (loss, logits, labels))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from freescale.dataloader.schema import DatasetManifest
from freescale.models.dlrm import DLRMConfig, DLRMModel
from freescale.models.hstu import HSTUConfig, HSTUModel


@dataclass
class ModelConfig:
    kind: Literal["hstu", "dlrm"] = "hstu"
    hstu: HSTUConfig = field(default_factory=HSTUConfig)
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)


def build_model(
    cfg: ModelConfig, manifest: DatasetManifest, *, max_seq_len: int, embedding_device: torch.device
) -> nn.Module:
    """Build the configured model; embedding tables go on ``embedding_device`` ("meta" before DMP)."""
    if cfg.kind == "hstu":
        return HSTUModel(
            cfg.hstu, num_items=manifest.num_items, dense_dim=manifest.dense_dim,
            max_seq_len=max_seq_len, embedding_device=embedding_device,
        )
    return DLRMModel(
        cfg.dlrm, num_items=manifest.num_items, num_users=manifest.num_users,
        dense_dim=manifest.dense_dim, embedding_device=embedding_device,
    )


__all__ = ["DLRMConfig", "DLRMModel", "HSTUConfig", "HSTUModel", "ModelConfig", "build_model"]
