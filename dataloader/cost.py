"""Per-sample cost model: ``c(L) = a*L^2 + b*L + c0`` for a history of length L.

Attention is quadratic in the sequence length, projections, MLPs and embedding
traffic are linear, and every sample pays a constant (its head MLP, its share of
fixed per-batch work).  The defaults come from the model's dimensions as FLOPs
(forward + backward ~ 3x forward); ``calibrate`` replaces them with a least
squares fit of measured per-rank compute times, which is what matters on a
given machine (on CPUs the quadratic term is relatively cheaper than its FLOPs
say, on GPUs kernel launch overheads inflate c0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    quadratic: float
    linear: float
    constant: float

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        length = lengths.astype(np.float64)
        return (self.quadratic * length + self.linear) * length + self.constant

    @classmethod
    def for_hstu(
        cls, *, embedding_dim: int, num_blocks: int, num_heads: int, attention_dim: int, value_dim: int,
        head_width: int, num_targets: int = 1,
    ) -> CostModel:
        """FLOPs of one sample in the sequence model, history length L (+ targets)."""
        d, h, a, v = embedding_dim, num_heads, attention_dim, value_dim
        # per token per block: uvqk projection + output projection; per token pair: qk^T and AV (causal: half).
        per_token = num_blocks * 2 * (d * h * (2 * v + 2 * a) + h * v * d)
        per_pair = num_blocks * 2 * h * (a + v) / 2
        fwd_bwd = 3.0
        # (L + t)^2 and (L + t) expanded into a L^2 + b L + c0.
        t = num_targets
        return cls(
            quadratic=fwd_bwd * per_pair,
            linear=fwd_bwd * (per_token + 2 * t * per_pair),
            constant=fwd_bwd * (t * per_token + t * t * per_pair + 2 * head_width * (d + head_width)),
        )

    @classmethod
    def for_pooled(cls, *, embedding_dim: int, dense_flops: float) -> CostModel:
        """DLRM-like: pooling is linear in L, the MLPs are a constant per sample."""
        return cls(quadratic=0.0, linear=3.0 * 2 * embedding_dim, constant=3.0 * dense_flops)


def calibrate(
    sum_sq: np.ndarray, sum_len: np.ndarray, count: np.ndarray, seconds: np.ndarray
) -> CostModel:
    """Fit ``seconds ~ a*sum(L^2) + b*sum(L) + c0*count`` over (rank, step) observations.

    Each argument has one entry per observation: the rank's sum of squared
    lengths, sum of lengths and sample count in that step, and its measured
    compute time.  Coefficients are kept non-negative (a cost never falls with
    length): a negative least-squares coefficient is dropped and the rest refit.
    """
    design = np.stack([sum_sq, sum_len, count], axis=1).astype(np.float64)
    target = seconds.astype(np.float64)
    if design.shape[0] < 3:
        raise ValueError(f"calibrate needs at least 3 observations, got {design.shape[0]}")
    active = [0, 1, 2]
    while True:
        scale = np.abs(design[:, active]).max(axis=0)
        scale[scale == 0] = 1.0
        coef, *_ = np.linalg.lstsq(design[:, active] / scale, target, rcond=None)
        coef = coef / scale
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[active] = np.maximum(coef, 0.0)
    return CostModel(quadratic=float(full[0]), linear=float(full[1]), constant=float(full[2]))
