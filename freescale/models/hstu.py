"""HSTU-style sequence model: item history + candidate -> click logit.

Legend: B samples, T tokens over the batch (history plus one candidate per
sample), D embedding width, H heads, A attention dim per head, V value dim per head.

Forward, per batch::

    item_table (torchrec EmbeddingCollection, sharded by DMP)
      history_item_ids  -> jagged [T-B, D]     candidate_item_id -> [B, D]
    interleave: each sample's sequence is its history (oldest first) then its candidate
    x_TD += position embedding of recency (0 = the candidate, 1 = newest history item, ...)
    N x HSTUBlock:  u, v, q, k = silu(Linear(LayerNorm(x)))
                    x = x + Linear(LayerNorm(attention(q, k, v)) * u)    (norm x gate fused)
                    (``relative_bias``: the attention scores get each block's learned bias of the
                    distance between tokens and of the log-bucketed time gap, HSTU's relative
                    attention bias: query token i's time is when the token after it happened, the
                    candidate's its own; keys use their own time)
    read the candidate token of each sample -> LayerNorm -> concat (user embedding, dense) -> MLP -> logit
    (``history_cross``: the head also reads LayerNorm(mean of the history's item embeddings) *
    LayerNorm(the candidate's item embedding), an explicit history-candidate product; see HSTUConfig)

Two embedding modules, called in priority order: ``item_embeddings`` (history
and candidate: the attention stack needs them first) and then
``user_embeddings`` (a pooled side feature that only the head reads).  torchrec
awaits a sharded module's output all-to-all lazily, so the user embeddings
travel while the attention stack computes.

The attention is ``freescale.kernels.jagged_hstu_attention`` (pointwise SiLU, no
softmax, causal, the candidate is a target token that sees the history); the
norm-and-gate after it is ``freescale.kernels.layer_norm_mul`` (one fused kernel
on CUDA).  The
whole path stays jagged: no sample is padded to the batch's longest history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor

from freescale.config import require
from freescale.dataloader.batch import Batch
from freescale.dataloader.schema import CANDIDATE_ITEM, HISTORY_ITEMS, USER_ID
from freescale.kernels import available_backends, jagged_hstu_attention, layer_norm_mul, layer_norm_mul_backends
from freescale.kernels.hstu_attention import RelativeBias
from freescale.models.common import ModelOutput, bce_output, mlp

RELATIVE_BIASES = ("none", "position", "time", "position_time")


@dataclass
class HSTUConfig:
    embedding_dim: int = 32
    num_blocks: int = 2
    num_heads: int = 2
    attention_dim: int = 16
    """Per head, for q and k."""
    value_dim: int = 16
    """Per head, for v and u."""
    alpha: float = 0.0
    """Scale inside silu(alpha * q.k); 0 means 1/sqrt(attention_dim)."""
    max_attn_len: int = 0
    """Attend at most this many tokens back; 0 = unlimited."""
    head_layers: list[int] = field(default_factory=lambda: [64, 32])
    attention_backend: str = "auto"
    """``auto`` (Triton on CUDA, torch reference on CPU), ``triton`` or ``reference``."""
    norm_backend: str = "auto"
    """Same choice for the fused ``LayerNorm(attention) * u`` of each block."""
    relative_bias: str = "none"
    """``none``, ``position``, ``time`` or ``position_time``: learned attention-score bias per block by
    token distance and/or log-spaced time gap (``kernels.hstu_attention.RelativeBias``); tables start
    at zero, so a run starts from the model without them.  ``time`` reads the data's timestamps."""
    time_buckets: int = 128
    """Time-gap buckets (four per doubling of the gap in seconds; 128 reach past 100 years)."""
    dropout: float = 0.0
    """On the input tokens (item + recency embedding) and on each block's gated attention output before its
    output layer (where GR's HSTU puts it); 0 builds none.  Small logs want it: every history prefix is a
    training sample, so a pass supervises each transition once per later position (SASRec and GR use 0.2 on
    MovieLens).  Under ``freescale train`` the masks come from the generator the step engine seeds per (seed,
    rank slot, step) (``step_engine.step_seed``): a resumed step draws the masks the uninterrupted one did."""
    history_cross: bool = True
    """Ranking: the head also reads ``LayerNorm(mean history item embedding) * LayerNorm(candidate item
    embedding)`` (no parameters; both norms without weights, so the product is on the scale of the other
    inputs).  An MLP over concatenated inputs learns a product of two of them poorly; the ranking signal
    "is the candidate like what the user had" is one.  On a three-taste ``gen-log`` log the ranker without
    it stayed at AUC 0.50-0.55 (600-1,800 steps), with it 0.71 in 600 (``bench_quality.py``).  GR's ranking
    head multiplies the candidate's item MLP into the sequence output for the same reason.  Turn off to
    resume a checkpoint written before it existed (the head's first layer is ``embedding_dim`` narrower)."""

    def validate(self) -> None:
        for key in ("embedding_dim", "num_heads", "attention_dim", "value_dim"):
            require(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        require(self.num_blocks >= 0, "num_blocks", f"must be >= 0, got {self.num_blocks}")
        require(self.alpha >= 0, "alpha", f"must be >= 0, got {self.alpha}")
        require(self.max_attn_len >= 0, "max_attn_len", f"must be >= 0, got {self.max_attn_len}")
        require(self.relative_bias in RELATIVE_BIASES, "relative_bias",
                f"must be one of {list(RELATIVE_BIASES)}, got '{self.relative_bias}'")
        require(self.time_buckets > 0, "time_buckets", f"must be positive, got {self.time_buckets}")
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        require(all(w > 0 for w in self.head_layers), "head_layers", f"widths must be positive, got {self.head_layers}")
        for key, names in (("attention_backend", available_backends()), ("norm_backend", layer_norm_mul_backends())):
            choices = ["auto", *names]
            require(getattr(self, key) in choices, key, f"must be one of {choices}, got '{getattr(self, key)}'")


def _dropout(p: float) -> nn.Module:
    """Dropout at ``p``; at 0 nothing (no random draw: a run without it is the run it was before it existed)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class HSTUBlock(nn.Module):
    """One layer of jagged pointwise attention with SiLU gating (see module docstring)."""

    def __init__(self, cfg: HSTUConfig, max_seq_len: int) -> None:
        super().__init__()
        self.heads, self.attn_dim, self.value_dim = cfg.num_heads, cfg.attention_dim, cfg.value_dim
        self.max_seq_len = max_seq_len
        self.alpha = cfg.alpha or cfg.attention_dim**-0.5
        self.max_attn_len = cfg.max_attn_len
        self.backend = cfg.attention_backend
        self.norm_backend = cfg.norm_backend
        d = cfg.embedding_dim
        self.input_norm = nn.LayerNorm(d)
        self.uvqk = nn.Linear(d, cfg.num_heads * (2 * cfg.value_dim + 2 * cfg.attention_dim))
        self.attn_norm = nn.LayerNorm(cfg.num_heads * cfg.value_dim)
        self.output = nn.Linear(cfg.num_heads * cfg.value_dim, d)
        self.dropout = _dropout(cfg.dropout)
        self.position_bias = nn.Parameter(torch.zeros(max_seq_len)) if "position" in cfg.relative_bias else None
        self.time_bias = nn.Parameter(torch.zeros(cfg.time_buckets)) if "time" in cfg.relative_bias else None

    def forward(
        self, x_TD: torch.Tensor, seq_offsets_B1: torch.Tensor, num_targets_B: torch.Tensor | None,
        query_time_T: torch.Tensor | None = None, key_time_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total = x_TD.shape[0]
        hv, ha = self.heads * self.value_dim, self.heads * self.attn_dim
        u_TX, v_TX, q_TX, k_TX = torch.split(F.silu(self.uvqk(self.input_norm(x_TD))), [hv, hv, ha, ha], dim=-1)
        attn_THV = jagged_hstu_attention(
            q_TX.reshape(total, self.heads, self.attn_dim),
            k_TX.reshape(total, self.heads, self.attn_dim),
            v_TX.reshape(total, self.heads, self.value_dim),
            seq_offsets_B1,
            max_seq_len=self.max_seq_len,
            alpha=self.alpha,
            num_targets_B=num_targets_B,
            max_attn_len=self.max_attn_len,
            backend=self.backend,
            bias=self._bias(query_time_T, key_time_T),
        )
        norm = self.attn_norm
        gated_TX = layer_norm_mul(attn_THV.reshape(total, hv), u_TX, norm.weight, norm.bias, norm.eps, self.norm_backend)
        return x_TD + self.output(self.dropout(gated_TX))

    def _bias(self, query_time_T: torch.Tensor | None, key_time_T: torch.Tensor | None) -> RelativeBias | None:
        if self.position_bias is None and self.time_bias is None:
            return None
        if self.time_bias is not None and (query_time_T is None or key_time_T is None):
            raise ValueError("relative_bias with time: the batch carries no timestamps (the loader reads them "
                             "when the model's reads_timestamps is set)")
        return RelativeBias(self.position_bias, self.time_bias, query_time_T, key_time_T)


class HSTUStack(nn.Module):
    """Recency embedding, the blocks and the final norm over jagged token sequences: what the ranking
    (``HSTUSequence``) and the retrieval (``hstu_retrieval.HSTUNextItem``) stacks share."""

    def __init__(self, cfg: HSTUConfig, max_tokens: int) -> None:
        super().__init__()
        d = cfg.embedding_dim
        self.max_tokens = max_tokens
        self.recency_embedding = nn.Embedding(max_tokens, d)
        nn.init.normal_(self.recency_embedding.weight, std=0.02)
        self.input_dropout = _dropout(cfg.dropout)
        self.blocks = nn.ModuleList(HSTUBlock(cfg, max_tokens) for _ in range(cfg.num_blocks))
        self.final_norm = nn.LayerNorm(d)

    def encode(self, x_TD: torch.Tensor, seq_offsets_B1: torch.Tensor, recency_T: torch.Tensor,
               num_targets_B: torch.Tensor | None, query_time_T: torch.Tensor | None,
               key_time_T: torch.Tensor | None) -> torch.Tensor:
        """Every token's output ``[T, D]`` before ``final_norm`` (``recency_T``: tokens from the sequence's
        end); callers normalize the rows they read (ranking: one per sample)."""
        x_TD = self.input_dropout(x_TD + self.recency_embedding(recency_T.clamp(max=self.max_tokens - 1)))
        for block in self.blocks:
            x_TD = block(x_TD, seq_offsets_B1, num_targets_B, query_time_T, key_time_T)
        return x_TD


class HSTUSequence(HSTUStack):
    """Jagged history + candidate embeddings -> the candidate token's output, ``[B, D]`` (``[B, 2D]`` with
    ``history_cross``: the output, then the history-candidate product).

    One module (not a loop in ``HSTUModel.forward``) so that torchrec's pipelines, which FX-trace the
    model to find the sharded modules' inputs, see the attention stack as one call.
    """

    def __init__(self, cfg: HSTUConfig, max_tokens: int) -> None:
        super().__init__(cfg, max_tokens)
        self.history_cross = cfg.history_cross

    def forward(self, history: JaggedTensor, candidate: JaggedTensor, history_time_T: torch.Tensor | None = None,
                candidate_time_B: torch.Tensor | None = None) -> torch.Tensor:
        history_TD, candidate_BD = history.values(), candidate.values()
        num_history = history_TD.shape[0]
        seq_lengths_B = history.lengths() + 1
        seq_offsets_B1 = torch.ops.fbgemm.asynchronous_complete_cumsum(seq_lengths_B)
        total = num_history + candidate_BD.shape[0]

        # Token p of sample b: history item (p - b) of the concatenation, or the
        # candidate (num_history + b) when p is the last token of its sequence.
        sample_T = torch.repeat_interleave(
            torch.arange(seq_lengths_B.numel(), device=history_TD.device), seq_lengths_B, output_size=total
        )
        token_T = torch.arange(total, device=history_TD.device)
        last_T = seq_offsets_B1[1:][sample_T] - 1
        source_T = torch.where(token_T == last_T, num_history + sample_T, token_T - sample_T)
        x_TD = torch.cat([history_TD, candidate_BD])[source_T]

        query_time_T = key_time_T = None
        if history_time_T is not None and candidate_time_B is not None:
            key_time_T = torch.cat([history_time_T, candidate_time_B])[source_T]
            # A token's query is asked when the next one happens; the candidate's, at its own time.
            query_time_T = key_time_T[torch.where(token_T == last_T, token_T, token_T + 1)]
        out_TD = self.encode(x_TD, seq_offsets_B1, last_T - token_T, torch.ones_like(seq_lengths_B),
                             query_time_T, key_time_T)
        out_BD = self.final_norm(out_TD[seq_offsets_B1[1:] - 1])
        if not self.history_cross:
            return out_BD
        # Mean of each sample's history embeddings (zero for an empty history), normed, times the candidate's.
        history_sample_T = sample_T[token_T != last_T]
        sums_BD = history_TD.new_zeros(candidate_BD.shape).index_add_(0, history_sample_T, history_TD)
        mean_BD = sums_BD / history.lengths().clamp(min=1).unsqueeze(1).to(sums_BD.dtype)
        width = (candidate_BD.shape[1],)
        return torch.cat([out_BD, F.layer_norm(mean_BD, width) * F.layer_norm(candidate_BD, width)], dim=1)


class HSTUModel(nn.Module):
    """Item-history sequence model; ``forward(batch) -> (loss, (loss, logits, labels))``."""

    sparse_feature_names: ClassVar[list[str]] = [HISTORY_ITEMS, CANDIDATE_ITEM, USER_ID]

    def __init__(
        self, cfg: HSTUConfig, *, num_items: int, num_users: int, dense_dim: int, max_seq_len: int,
        embedding_device: torch.device,
    ) -> None:
        super().__init__()
        d = cfg.embedding_dim
        self.max_history = max_seq_len
        # Sequence = up to max_seq_len history items + 1 candidate; the attention
        # normaliser is that fixed length, never the batch's longest.
        self.max_tokens = max_seq_len + 1
        self.item_embeddings = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="item_table", embedding_dim=d, num_embeddings=num_items,
                    feature_names=[HISTORY_ITEMS, CANDIDATE_ITEM],
                )
            ],
            device=embedding_device,
        )
        self.user_embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="user_table", embedding_dim=d, num_embeddings=num_users, feature_names=[USER_ID],
                    pooling=PoolingType.SUM,
                )
            ],
            device=embedding_device,
        )
        self.sequence = HSTUSequence(cfg, self.max_tokens)
        self.head = mlp((3 if cfg.history_cross else 2) * d + dense_dim, [*cfg.head_layers, 1])
        self.reads_timestamps = "time" in cfg.relative_bias
        """Batches must carry timestamps (``Batch.history_timestamps``, ``candidate_timestamps``)."""

    def forward(self, batch: Batch) -> ModelOutput:
        embeddings = self.item_embeddings(batch.sparse)  # first: the attention stack needs these
        user = self.user_embeddings(batch.sparse)  # issued now, awaited at the head
        sequence_out = self.sequence(embeddings[HISTORY_ITEMS], embeddings[CANDIDATE_ITEM],
                                     batch.history_timestamps, batch.candidate_timestamps)
        logits_B = self.head(torch.cat([sequence_out, user[USER_ID], batch.dense], dim=-1)).squeeze(-1)
        return bce_output(logits_B, batch.labels, batch.loss_scale)
