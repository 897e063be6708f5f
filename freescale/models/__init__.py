"""Models: ``hstu`` (sequence model over item histories), ``dlrm``, and ``sasrec`` (the standard neural reference for
next-item retrieval).

``build_model`` picks one from ``ModelConfig.kind`` and ``task`` and sizes its tables from the
dataset manifest.  Every model exposes ``sparse_feature_names`` (the KJT keys it reads) and
returns ``(loss, (loss, *outputs))``, the outputs of its task (``freescale.tasks``: a ranker's
``(logits, labels)``; ``hstu_retrieval`` for next-item retrieval).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from freescale.config import require
from freescale.dataloader.cost import CostModel
from freescale.dataloader.schema import DatasetManifest
from freescale.models.dlrm import DLRMConfig, DLRMModel
from freescale.models.hstu import HSTUConfig, HSTUModel
from freescale.models.hstu_retrieval import HSTUNextItem, RetrievalConfig, RetrievalModel
from freescale.models.sasrec import SASRecConfig, SASRecNextItem, sasrec_cost
from freescale.tasks import TASKS


@dataclass
class ModelConfig:
    kind: Literal["hstu", "dlrm", "sasrec"] = "hstu"
    task: str = "ranking"
    """``ranking`` (click logits; hstu and dlrm) or ``retrieval`` (next item over the vocabulary; hstu and
    sasrec)."""
    hstu: HSTUConfig = field(default_factory=HSTUConfig)
    dlrm: DLRMConfig = field(default_factory=DLRMConfig)
    sasrec: SASRecConfig = field(default_factory=SASRecConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)

    def validate(self) -> None:
        require(self.task in TASKS, "task", f"must be one of {list(TASKS)}, got '{self.task}'")
        require(self.task == "ranking" or self.kind in ("hstu", "sasrec"), "task",
                f"'{self.task}' needs kind = 'hstu' or 'sasrec' (dlrm scores a candidate: ranking only)")
        require(self.kind != "sasrec" or self.task == "retrieval", "kind",
                "'sasrec' predicts the next item: set model.task = 'retrieval'")


def build_model(
    cfg: ModelConfig, manifest: DatasetManifest, *, max_seq_len: int, embedding_device: torch.device,
    item_counts: torch.Tensor | None = None,
) -> nn.Module:
    """Build the configured model; embedding tables go on ``embedding_device`` ("meta" before DMP).
    ``item_counts``: how often each item is a training target (retrieval's logQ correction)."""
    if cfg.task == "retrieval":
        sasrec = cfg.kind == "sasrec"
        encoder = SASRecNextItem(cfg.sasrec, max_seq_len) if sasrec else HSTUNextItem(cfg.hstu, max_seq_len)
        return RetrievalModel(encoder, cfg.sasrec.embedding_dim if sasrec else cfg.hstu.embedding_dim, cfg.retrieval,
                              num_items=manifest.num_items, embedding_device=embedding_device, item_counts=item_counts,
                              reads_timestamps=not sasrec and "time" in cfg.hstu.relative_bias)
    if cfg.kind == "hstu":
        return HSTUModel(
            cfg.hstu, num_items=manifest.num_items, num_users=manifest.num_users, dense_dim=manifest.dense_dim,
            max_seq_len=max_seq_len, embedding_device=embedding_device,
        )
    return DLRMModel(
        cfg.dlrm, num_items=manifest.num_items, num_users=manifest.num_users,
        dense_dim=manifest.dense_dim, embedding_device=embedding_device,
    )


def cost_model_for(cfg: ModelConfig, dense_dim: int) -> CostModel:
    """Per-sample cost ``a*L^2 + b*L + c0`` (FLOPs) derived from the model's dimensions."""
    if cfg.kind == "sasrec":
        return sasrec_cost(cfg.sasrec)
    if cfg.kind == "hstu":
        h = cfg.hstu
        return CostModel.for_hstu(
            embedding_dim=h.embedding_dim, num_blocks=h.num_blocks, num_heads=h.num_heads,
            attention_dim=h.attention_dim, value_dim=h.value_dim,
            head_width=max(h.head_layers, default=1) + dense_dim,
        )
    d = cfg.dlrm
    widths = [dense_dim, *d.bottom_layers]
    bottom = sum(2 * a * b for a, b in itertools.pairwise(widths))
    interactions = 4 * 3 // 2 + d.embedding_dim
    tops = [interactions, *d.top_layers, 1]
    top = sum(2 * a * b for a, b in itertools.pairwise(tops))
    return CostModel.for_pooled(embedding_dim=d.embedding_dim, dense_flops=bottom + top)


__all__ = [
    "DLRMConfig",
    "DLRMModel",
    "HSTUConfig",
    "HSTUModel",
    "ModelConfig",
    "RetrievalConfig",
    "RetrievalModel",
    "SASRecConfig",
    "build_model",
    "cost_model_for",
]
