"""DLRM over the sequence dataset: dense features + pooled sparse features -> click logit.

    dense_features [B, D_dense] -> bottom MLP -> [B, E]
    item_table (mean-pooled): history_item_ids -> [B, E], candidate_item_id -> [B, E]
    user_table: user_id -> [B, E]          (torchrec EmbeddingBagCollection, sharded by DMP)
    pairwise dot products of the 4 vectors + the dense vector -> top MLP -> logit

torchrec's ``DLRM`` module does the arithmetic; this wrapper chooses the tables
from the dataset manifest and speaks the ``(loss, output)`` convention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DLRM

from freescale.config import require
from freescale.dataloader.batch import Batch
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, USER_ID
from freescale.models.common import ModelOutput, bce_output


@dataclass
class DLRMConfig:
    embedding_dim: int = 16
    bottom_layers: list[int] = field(default_factory=lambda: [32, 16])
    """Bottom MLP widths; the last must equal embedding_dim."""
    top_layers: list[int] = field(default_factory=lambda: [32, 16])
    """Top MLP hidden widths; a final width-1 layer is appended."""

    def validate(self) -> None:
        require(self.embedding_dim > 0, "embedding_dim", f"must be positive, got {self.embedding_dim}")
        require(bool(self.bottom_layers), "bottom_layers", "must not be empty")
        require(
            self.bottom_layers[-1] == self.embedding_dim,
            "bottom_layers",
            f"last width {self.bottom_layers[-1]} must equal embedding_dim {self.embedding_dim}",
        )
        require(all(w > 0 for w in self.bottom_layers + self.top_layers), "top_layers", "widths must be positive")


class DLRMModel(nn.Module):
    """``forward(batch) -> (loss, (loss, logits, labels))``."""

    sparse_feature_names: ClassVar[list[str]] = [HISTORY_ITEMS, CANDIDATE_ITEM, USER_ID]
    reads_timestamps = False

    def __init__(
        self, cfg: DLRMConfig, *, num_items: int, num_users: int, dense_dim: int, embedding_device: torch.device
    ) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(
                name="item_table", embedding_dim=cfg.embedding_dim, num_embeddings=num_items,
                feature_names=[HISTORY_ITEMS, CANDIDATE_ITEM], pooling=PoolingType.MEAN,
            ),
            EmbeddingBagConfig(
                name="user_table", embedding_dim=cfg.embedding_dim, num_embeddings=num_users,
                feature_names=[USER_ID], pooling=PoolingType.SUM,
            ),
        ]
        self.dlrm = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=embedding_device),
            dense_in_features=dense_dim,
            dense_arch_layer_sizes=list(cfg.bottom_layers),
            over_arch_layer_sizes=[*cfg.top_layers, 1],
        )

    def forward(self, batch: Batch) -> ModelOutput:
        """torchrec's DLRM, reordered so the embedding exchange overlaps the bottom MLP.

        Calling the (sharded) bag collection issues its output all-to-all and
        returns at once (torchrec awaits it lazily); the bottom MLP runs while
        the pooled embeddings travel, and ``to_dict`` waits for them.  Same
        modules and parameters as ``DLRM.forward``, same results.
        """
        arch = self.dlrm
        pooled = arch.sparse_arch.embedding_bag_collection(batch.sparse)
        dense_BD = arch.dense_arch(batch.dense)
        by_name = pooled.to_dict()
        sparse_BFD = torch.cat([by_name[n] for n in arch.sparse_arch.sparse_feature_names], dim=1).reshape(
            -1, arch.sparse_arch.F, arch.sparse_arch.D
        )
        logits_B = arch.over_arch(arch.inter_arch(dense_features=dense_BD, sparse_features=sparse_BFD)).squeeze(-1)
        return bce_output(logits_B, batch.labels, batch.loss_scale)
