"""SASRec (Kang & McAuley, ICDM 2018) as a next-item encoder: the field's standard neural reference, trained by
this engine (``model.kind = "sasrec"``, ``model.task = "retrieval"``).

A causal transformer over the history: a learned embedding of each position (counted from the sequence's end,
as HSTU's recency embedding is), then blocks of pre-norm softmax self-attention and a point-wise feed-forward
layer, each with dropout and a residual, then a final norm.  Everything else is the retrieval model's
(``hstu_retrieval.RetrievalModel``): the item table, the sampled softmax with its negatives and logQ correction,
the evaluation over the whole vocabulary; so SASRec and HSTU are compared with everything else held equal.

Two switches walk SASRec towards HSTU one difference at a time (the quality benchmark's ablation): ``attention =
"silu"`` replaces the softmax by HSTU's pointwise ``silu(q.k / sqrt(d_head)) / max_tokens`` (no normalization over
the keys: each weight is independent), and ``ffn_multiplier = 0`` drops the feed-forward layer (HSTU has none: its
gate takes that place).  Neither is the paper's SASRec; the defaults are.

The jagged histories are laid out left-aligned in a padded ``[B, L, D]`` batch for torch's attention: with the
causal mask a real token attends only to tokens at or before it, which are real, so no padding mask is needed
and the padded rows are dropped on the way back.  (Kang & McAuley's original attends over padding masked out
the same way and shares the item table between input and output, as this does.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor

from freescale.config import require
from freescale.dataloader.cost import CostModel


@dataclass
class SASRecConfig:
    embedding_dim: int = 64
    num_blocks: int = 2
    num_heads: int = 1
    dropout: float = 0.2
    """On the embeddings, the attention weights and each block's two outputs (the paper's 0.2 for MovieLens)."""
    ffn_multiplier: int = 1
    """The feed-forward layer's width over ``embedding_dim`` (the paper: 1); 0: no feed-forward layer (as HSTU)."""
    attention: str = "softmax"
    """``softmax`` (the paper) or ``silu``: HSTU's pointwise weights (module docstring)."""

    def validate(self) -> None:
        for key in ("embedding_dim", "num_heads"):
            require(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        require(self.ffn_multiplier >= 0, "ffn_multiplier", f"must be >= 0, got {self.ffn_multiplier}")
        require(self.attention in ATTENTIONS, "attention", f"must be one of {list(ATTENTIONS)}, got '{self.attention}'")
        require(self.num_blocks >= 0, "num_blocks", f"must be >= 0, got {self.num_blocks}")
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        require(self.embedding_dim % self.num_heads == 0, "num_heads",
                f"must divide embedding_dim ({self.embedding_dim}), got {self.num_heads}")


ATTENTIONS = ("softmax", "silu")


class PointwiseSelfAttention(nn.Module):
    """HSTU's attention weights in SASRec's block: ``silu(q.k / sqrt(d_head)) / max_tokens`` where causal, 0
    elsewhere, dropout on the weights (as the softmax attention's), then the output projection."""

    def __init__(self, cfg: SASRecConfig, max_tokens: int) -> None:
        super().__init__()
        d = cfg.embedding_dim
        self.heads, self.max_tokens = cfg.num_heads, max_tokens
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        # Initialized as torch's MultiheadAttention initializes its projections: the ablation changes the formula only.
        nn.init.xavier_uniform_(self.qkv.weight)
        nn.init.zeros_(self.qkv.bias)
        nn.init.zeros_(self.out.bias)
        self.weight_dropout = nn.Dropout(cfg.dropout)

    def forward(self, h_BLD: torch.Tensor, causal_LL: torch.Tensor) -> torch.Tensor:
        batch, width, d = h_BLD.shape
        q_BHLE, k_BHLE, v_BHLE = (t.reshape(batch, width, self.heads, -1).transpose(1, 2)
                                  for t in self.qkv(h_BLD).chunk(3, dim=-1))
        scores_BHLL = q_BHLE @ k_BHLE.transpose(-1, -2) / q_BHLE.shape[-1] ** 0.5
        weights_BHLL = F.silu(scores_BHLL).masked_fill(causal_LL, 0.0) / self.max_tokens
        out_BHLE = self.weight_dropout(weights_BHLL) @ v_BHLE
        return self.out(out_BHLE.transpose(1, 2).reshape(batch, width, d))


class SASRecBlock(nn.Module):
    """Pre-norm causal self-attention, then a point-wise feed-forward layer (unless ``ffn_multiplier`` is 0), each
    residual."""

    def __init__(self, cfg: SASRecConfig, max_tokens: int) -> None:
        super().__init__()
        d = cfg.embedding_dim
        self.attention_norm = nn.LayerNorm(d)
        self.attention = (nn.MultiheadAttention(d, cfg.num_heads, dropout=cfg.dropout, batch_first=True)
                          if cfg.attention == "softmax" else PointwiseSelfAttention(cfg, max_tokens))
        self.ffn_norm = nn.LayerNorm(d) if cfg.ffn_multiplier else None
        self.ffn = nn.Sequential(nn.Linear(d, d * cfg.ffn_multiplier), nn.GELU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(d * cfg.ffn_multiplier, d)) if cfg.ffn_multiplier else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BLD: torch.Tensor, causal_LL: torch.Tensor) -> torch.Tensor:
        h_BLD = self.attention_norm(x_BLD)
        if isinstance(self.attention, nn.MultiheadAttention):
            attended, _ = self.attention(h_BLD, h_BLD, h_BLD, attn_mask=causal_LL, need_weights=False, is_causal=True)
        else:
            attended = self.attention(h_BLD, causal_LL)
        x_BLD = x_BLD + self.dropout(attended)
        if self.ffn is None or self.ffn_norm is None:
            return x_BLD
        return x_BLD + self.dropout(self.ffn(self.ffn_norm(x_BLD)))


class SASRecNextItem(nn.Module):
    """Jagged history embeddings -> each position's output ``[T, D]`` (causal), as ``HSTUNextItem`` returns."""

    def __init__(self, cfg: SASRecConfig, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.recency_embedding = nn.Embedding(max_tokens, cfg.embedding_dim)
        nn.init.normal_(self.recency_embedding.weight, std=0.02)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(SASRecBlock(cfg, max_tokens) for _ in range(cfg.num_blocks))
        self.final_norm = nn.LayerNorm(cfg.embedding_dim)

    def forward(self, history: JaggedTensor, history_time_T: torch.Tensor | None = None,
                candidate_time_B: torch.Tensor | None = None) -> torch.Tensor:
        x_TD, lengths_B = history.values(), history.lengths()
        total, batch = x_TD.shape[0], lengths_B.numel()
        if total == 0:
            return self.final_norm(x_TD)
        starts_B = torch.cumsum(lengths_B, 0) - lengths_B
        sample_T = torch.repeat_interleave(torch.arange(batch, device=x_TD.device), lengths_B, output_size=total)
        position_T = torch.arange(total, device=x_TD.device) - starts_B[sample_T]
        recency_T = lengths_B[sample_T] - 1 - position_T
        x_TD = self.embedding_dropout(x_TD + self.recency_embedding(recency_T.clamp(max=self.max_tokens - 1)))
        width = int(lengths_B.max())
        x_BLD = x_TD.new_zeros(batch, width, x_TD.shape[1])
        x_BLD[sample_T, position_T] = x_TD
        causal_LL = torch.ones(width, width, dtype=torch.bool, device=x_TD.device).triu(1)  # True: not attended
        for block in self.blocks:
            x_BLD = block(x_BLD, causal_LL)
        return self.final_norm(x_BLD[sample_T, position_T])


def sasrec_cost(cfg: SASRecConfig) -> CostModel:
    """FLOPs of one sample, history length L, forward and backward (the planner's cost model): per token per
    block the q, k, v and output projections and the feed-forward layer; per token pair (causal: half) q.k and
    the weighted sum of v."""
    d = cfg.embedding_dim
    per_token = cfg.num_blocks * 2 * (4 * d * d + 2 * d * d * cfg.ffn_multiplier)  # 0 without the FFN
    per_pair = cfg.num_blocks * 2 * d / 2
    return CostModel(quadratic=3.0 * per_pair, linear=3.0 * per_token, constant=0.0)


__all__ = ["PointwiseSelfAttention", "SASRecBlock", "SASRecConfig", "SASRecNextItem", "sasrec_cost"]
