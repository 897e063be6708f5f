"""HSTU for next-item retrieval (``model.task = "retrieval"``): every history position predicts the item after it.

Legend: B samples, T history tokens over the batch, D embedding width, N supervised positions, M negatives.

Forward, per batch::

    item_table (torchrec EmbeddingCollection, sharded by DMP)
      history_item_ids -> jagged [T, D]    candidate_item_id -> [B, D]    sampled_item_ids -> [M_u, D]
    HSTUNextItem: the history alone, causal (position i sees 0..i), relative bias as configured
      -> out_TD, L2-normalized: the query of each position
    target of history position i: history item i+1, the candidate after the last one
    training:   sampled softmax of each supervised position's target against the negatives shared by
                the rank's positions (some of the batch's own targets and the loader's uniform
                draws; cost N x M, not the N x N of every target against every other), logQ-corrected
                (``freescale.retrieval``); ``retrieval.positions = "last"`` supervises only the
                position before the candidate (format-2 data holds each transition in one sample
                already: "all" would train it once per later sample)
    evaluation: the query of each sample's last position and its held-out candidate
                (``tasks.Retrieval`` ranks it among all items where the table is sharded)

Scores are ``query . item / temperature`` with the query normalized and the item table raw; the
evaluation ranks by the same dot product.  A sample with an empty history has no query.  A
sample's loss is the sum over its supervised positions (the loader's ``loss_scale`` then makes
the step's loss the mean of that over the step's samples: a sample with a longer history weighs
more, as it holds more predictions); without a ``loss_scale``, the mean per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor

from freescale.config import require
from freescale.dataloader.batch import Batch
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, SAMPLED_ITEMS
from freescale.models.common import ModelOutput
from freescale.models.hstu import HSTUStack
from freescale.retrieval import expected_log_count, sampled_softmax_loss
from freescale.tasks import Retrieval

POSITIONS = ("all", "last")


@dataclass
class RetrievalConfig:
    in_batch_negatives: int = 256
    """This many of the batch's own targets (this rank's, evenly spaced over its positions: popular
    items, logQ-corrected) shared as negatives by every position; all of them when fewer."""
    uniform_negatives: int = 128
    """Item ids the loader draws uniformly per rank and step, looked up through the sharded table."""
    temperature: float = 0.05
    positions: str = "all"
    """``all`` history positions supervised, or the ``last`` (the one before the candidate)."""

    def validate(self) -> None:
        for key in ("in_batch_negatives", "uniform_negatives"):
            require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        require(self.in_batch_negatives + self.uniform_negatives > 0, "uniform_negatives",
                "no negatives: set in_batch_negatives or uniform_negatives above 0")
        require(self.temperature > 0, "temperature", f"must be positive, got {self.temperature}")
        require(self.positions in POSITIONS, "positions", f"must be one of {list(POSITIONS)}, got '{self.positions}'")


def next_item_index(lengths_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each history token, where its target is in ``cat([history tokens, candidates])`` (the next
    token of its sample, or the sample's candidate after its last), and whether it is the last."""
    total = lengths_B.sum()
    offsets_B1 = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths_B)
    sample_T = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=lengths_B.device), lengths_B)
    token_T = torch.arange(sample_T.numel(), device=lengths_B.device)
    is_last_T = token_T == offsets_B1[1:][sample_T] - 1
    return torch.where(is_last_T, total + sample_T, token_T + 1), is_last_T


class HSTUNextItem(HSTUStack):
    """Jagged history embeddings -> each position's output ``[T, D]`` (causal; no candidate token)."""

    def forward(self, history: JaggedTensor, history_time_T: torch.Tensor | None = None,
                candidate_time_B: torch.Tensor | None = None) -> torch.Tensor:
        x_TD, lengths_B = history.values(), history.lengths()
        offsets_B1 = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths_B)
        token_T = torch.arange(x_TD.shape[0], device=x_TD.device)
        sample_T = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=x_TD.device), lengths_B,
                                           output_size=x_TD.shape[0])
        last_T = offsets_B1[1:][sample_T] - 1
        query_time_T = key_time_T = None
        if history_time_T is not None and candidate_time_B is not None:
            key_time_T = history_time_T
            # Position i is asked for the next item when it happens: item i+1's time, the candidate's last.
            ahead_T = torch.cat([history_time_T, history_time_T[:1]])[token_T + 1]
            query_time_T = torch.where(token_T == last_T, candidate_time_B[sample_T], ahead_T)
        return self.final_norm(self.encode(x_TD, offsets_B1, last_T - token_T, None, query_time_T, key_time_T))


class RetrievalModel(nn.Module):
    """``forward(batch) -> (loss, (loss, loss_sum, positions, samples))`` in training, ``(0, (0, query_ND,
    target_ids_N))`` in evaluation (module docstring; ``freescale.tasks`` reads the outputs).  ``sequence``: the
    next-item encoder, jagged history ``[T, D]`` in, each position's output ``[T, D]`` out (``HSTUNextItem``;
    ``freescale.models.sasrec.SASRecNextItem``); ``reads_timestamps``: whether it takes the batch's times."""

    item_probs: torch.Tensor

    def __init__(self, sequence: nn.Module, embedding_dim: int, retrieval: RetrievalConfig, *, num_items: int,
                 embedding_device: torch.device, item_counts: torch.Tensor | None = None,
                 reads_timestamps: bool = False) -> None:
        super().__init__()
        self.retrieval = retrieval
        self.sparse_feature_names = [HISTORY_ITEMS, CANDIDATE_ITEM] + (
            [SAMPLED_ITEMS] if retrieval.uniform_negatives else [])
        self.sampled_items = retrieval.uniform_negatives
        self.reads_timestamps = reads_timestamps
        self.task = Retrieval("item_table")
        self.item_embeddings = EmbeddingCollection(
            tables=[EmbeddingConfig(name="item_table", embedding_dim=embedding_dim, num_embeddings=num_items,
                                    feature_names=list(self.sparse_feature_names))],
            device=embedding_device,
        )
        self.sequence = sequence
        # Add-one: an item never counted (seen only in histories, say) still has a finite log count.
        counts = (item_counts.double() if item_counts is not None else torch.zeros(num_items, dtype=torch.float64)) + 1
        self.register_buffer("item_probs", (counts / counts.sum()).float(), persistent=False)
        self.num_items = num_items

    def forward(self, batch: Batch) -> ModelOutput:
        embeddings = self.item_embeddings(batch.sparse)
        history = embeddings[HISTORY_ITEMS]
        out_TD = self.sequence(history, batch.history_timestamps, batch.candidate_timestamps)
        query_TD = F.normalize(out_TD, dim=-1)
        lengths_B = history.lengths()
        last_B = torch.cumsum(lengths_B, 0) - 1
        candidate_ids_B = batch.sparse[CANDIDATE_ITEM].values()
        if not self.training:
            zero = query_TD.new_zeros(())
            has = lengths_B > 0
            return zero, (zero, query_TD[last_B[has]], candidate_ids_B[has])
        next_T, is_last_T = next_item_index(lengths_B)
        target_ids_T = torch.cat([batch.sparse[HISTORY_ITEMS].values(), candidate_ids_B])[next_T]
        target_TD = torch.cat([history.values(), embeddings[CANDIDATE_ITEM].values()])[next_T]
        keep_T = is_last_T if self.retrieval.positions == "last" else torch.ones_like(is_last_T)
        query_ND, target_ND, target_ids_N = query_TD[keep_T], target_TD[keep_T], target_ids_T[keep_T]
        loss_N = self._loss(query_ND, target_ND, target_ids_N, embeddings, batch)
        total, positions = loss_N.sum(), torch.ones_like(loss_N).sum()
        loss = total * batch.loss_scale if batch.loss_scale is not None else total / positions.clamp(min=1)
        return loss, (loss.detach(), total.detach(), positions, torch.ones_like(lengths_B).sum())

    def _loss(self, query_ND: torch.Tensor, target_ND: torch.Tensor, target_ids_N: torch.Tensor,
              embeddings: dict[str, JaggedTensor], batch: Batch) -> torch.Tensor:
        """The sampled softmax of each supervised position against this rank's negatives (module docstring)."""
        negatives, negative_ids = [], []
        if self.retrieval.in_batch_negatives:
            # Evenly spaced positions: a deterministic draw (the same in every pipeline and on a replay);
            # with fewer positions than asked for, each once.
            wanted = self.retrieval.in_batch_negatives
            pick = torch.arange(wanted, device=target_ids_N.device) * target_ids_N.shape[0] // wanted
            pick = torch.unique_consecutive(pick[pick < target_ids_N.shape[0]])
            negatives.append(target_ND[pick])
            negative_ids.append(target_ids_N[pick])
        if self.retrieval.uniform_negatives:
            negatives.append(embeddings[SAMPLED_ITEMS].values())
            negative_ids.append(batch.sparse[SAMPLED_ITEMS].values())
        negative_MD, negative_ids_M = torch.cat(negatives), torch.cat(negative_ids)
        in_batch = negative_ids[0].numel() if self.retrieval.in_batch_negatives else 0

        def log_count(ids: torch.Tensor) -> torch.Tensor:
            return expected_log_count(self.item_probs[ids], in_batch, self.retrieval.uniform_negatives, self.num_items)

        return sampled_softmax_loss(query_ND, target_ND, target_ids_N, negative_MD, negative_ids_M,
                                    temperature=self.retrieval.temperature, log_count_N=log_count(target_ids_N),
                                    log_count_M=log_count(negative_ids_M))
