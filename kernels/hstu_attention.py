"""Jagged causal pointwise (HSTU) attention: the torch reference and the selector.

Legend: T total tokens over the batch, B sequences, H heads, A attention dim per
head, V value dim per head, N longest sequence in the batch.

For sequence ``b`` with tokens ``seq_offsets[b] .. seq_offsets[b+1]`` (length L,
the last ``num_targets[b]`` of them candidate tokens)::

    out[i] = sum_j  mask(i, j) * silu(alpha * q[i] . k[j]) / max_seq_len * v[j]
    mask(i, j) = j <= i                                   (causal)
             and (j < L - num_targets  or  j == i)        (targets see history, not each other)
             and (max_attn_len == 0  or  i - j <= max_attn_len)

With a :class:`RelativeBias` (HSTU's relative attention bias), the score gets a
learned term before the SiLU, shared by the heads::

    silu(alpha * q[i] . k[j]  +  pos_weight[min(i - j, P - 1)]
                              +  time_weight[time_bucket(query_time[i] - key_time[j])])

``i - j`` is the distance in the sequence; ``time_bucket`` is log-spaced (four
buckets per doubling of the gap in seconds, exact integer arithmetic on the
float32 bits, so every implementation buckets alike).

There is no softmax.  The normaliser is the configured ``max_seq_len``, not the
batch's longest sequence, so a sample's output does not depend on which other
samples share its batch (balancing moves samples between ranks freely).

``jagged_hstu_attention`` picks an implementation: the reference below runs
everywhere; a Triton kernel registers itself under ``"triton"`` and is chosen
on CUDA.  The reference pads to ``[B, N, H, *]`` internally (padding only inside
this function; inputs and outputs stay jagged) and is meant for CPU training,
tests and as the ground truth for kernels.  It pads within power-of-two length
buckets so its cost follows the jagged sum of L^2 (what the cost model and the
balancer assume), not batch x longest^2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from freescale.kernels.registry import KernelRegistry

TIME_BUCKET_SUB_BITS = 2
"""log2 of the time buckets per doubling of the gap (4: each bucket spans a factor 2^(1/4))."""


def time_bucket(gap: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-spaced bucket of a time gap in seconds (int64): the exponent and top two mantissa bits of
    ``float32(max(gap, 0) + 1)``, so 0 s -> 0, 1 s -> 4, 2 s -> 6, 1 day -> 65, 1 year -> 99; clamped
    to ``num_buckets - 1``.  Integer arithmetic on the float's bits: the Triton kernels compute the
    very same buckets (a float ``log`` would differ by an ulp at bucket edges)."""
    bits = (gap.clamp(min=0) + 1).to(torch.float32).view(torch.int32)
    shift = 23 - TIME_BUCKET_SUB_BITS
    return ((bits >> shift) - (127 << TIME_BUCKET_SUB_BITS)).clamp(0, num_buckets - 1).long()


@dataclass(frozen=True)
class RelativeBias:
    """The learned additive score bias of the module docstring; either table may be ``None``.

    ``pos_weight_P``: one value per distance ``i - j`` (the last one for every distance beyond);
    ``time_weight_K``: one value per time bucket, with ``query_time_T`` and ``key_time_T`` (int64
    seconds, jagged like ``q``): the gap is ``query_time[i] - key_time[j]``."""

    pos_weight_P: torch.Tensor | None = None
    time_weight_K: torch.Tensor | None = None
    query_time_T: torch.Tensor | None = None
    key_time_T: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.time_weight_K is not None and (self.query_time_T is None or self.key_time_T is None):
            raise ValueError("RelativeBias: a time_weight_K needs query_time_T and key_time_T")

    def tokens(self, index: torch.Tensor) -> RelativeBias:
        """The same bias over the tokens ``index`` of the jagged batch."""
        if self.time_weight_K is None:
            return self
        return replace(self, query_time_T=self.query_time_T[index], key_time_T=self.key_time_T[index])  # type: ignore[index]

    def padded(self, seq_offsets_B1: torch.Tensor, longest: int) -> torch.Tensor:
        """The bias as ``[B, N, N]`` over sequences padded to ``longest`` (where ``i >= j``)."""
        batch = seq_offsets_B1.numel() - 1
        idx = torch.arange(longest, device=seq_offsets_B1.device)
        bias = torch.zeros((), device=seq_offsets_B1.device)
        if self.pos_weight_P is not None:
            distance = (idx.view(-1, 1) - idx.view(1, -1)).clamp(0, self.pos_weight_P.numel() - 1)
            bias = bias + self.pos_weight_P[distance].expand(batch, longest, longest)
        if self.time_weight_K is not None:
            query = jagged_to_padded(self.query_time_T, seq_offsets_B1, longest)  # type: ignore[arg-type]
            key = jagged_to_padded(self.key_time_T, seq_offsets_B1, longest)  # type: ignore[arg-type]
            gap = query.view(batch, -1, 1) - key.view(batch, 1, -1)
            bias = bias + self.time_weight_K[time_bucket(gap, self.time_weight_K.numel())]
        return bias


class AttentionImpl(Protocol):
    def __call__(
        self,
        q_THA: torch.Tensor,
        k_THA: torch.Tensor,
        v_THV: torch.Tensor,
        seq_offsets_B1: torch.Tensor,
        max_seq_len: int,
        alpha: float,
        num_targets_B: torch.Tensor | None,
        max_attn_len: int,
        bias: RelativeBias | None,
    ) -> torch.Tensor: ...


def jagged_to_padded(x_TD: torch.Tensor, seq_offsets_B1: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[T, *]`` jagged -> ``[B, max_len, *]`` zero-padded (differentiable)."""
    lengths_B = seq_offsets_B1[1:] - seq_offsets_B1[:-1]
    num_seqs = lengths_B.numel()
    seq_T = torch.repeat_interleave(torch.arange(num_seqs, device=x_TD.device), lengths_B, output_size=x_TD.shape[0])
    pos_T = torch.arange(x_TD.shape[0], device=x_TD.device) - seq_offsets_B1[:-1][seq_T]
    out = x_TD.new_zeros((num_seqs, max_len, *x_TD.shape[1:]))
    return out.index_put((seq_T, pos_T), x_TD)


def padded_to_jagged(x_BN: torch.Tensor, seq_offsets_B1: torch.Tensor, total: int) -> torch.Tensor:
    """Inverse of :func:`jagged_to_padded` (drops the padding)."""
    lengths_B = seq_offsets_B1[1:] - seq_offsets_B1[:-1]
    seq_T = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=x_BN.device), lengths_B, output_size=total)
    pos_T = torch.arange(total, device=x_BN.device) - seq_offsets_B1[:-1][seq_T]
    return x_BN[seq_T, pos_T]


def attention_mask(
    lengths_B: torch.Tensor, max_len: int, num_targets_B: torch.Tensor | None, max_attn_len: int
) -> torch.Tensor:
    """Boolean ``[B, N, N]`` mask: ``mask[b, i, j]`` is True where token i may attend to j."""
    idx = torch.arange(max_len, device=lengths_B.device)
    i, j = idx.view(1, -1, 1), idx.view(1, 1, -1)
    valid = (i < lengths_B.view(-1, 1, 1)) & (j <= i)
    if num_targets_B is not None:
        history_B = (lengths_B - num_targets_B).view(-1, 1, 1)
        valid = valid & ((j < history_B) | (j == i))
    if max_attn_len > 0:
        valid = valid & (i - j <= max_attn_len)
    return valid


def reference_hstu_attention(
    q_THA: torch.Tensor,
    k_THA: torch.Tensor,
    v_THV: torch.Tensor,
    seq_offsets_B1: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets_B: torch.Tensor | None = None,
    max_attn_len: int = 0,
    bias: RelativeBias | None = None,
) -> torch.Tensor:
    """Plain torch implementation of the module docstring's formula; returns ``[T, H, V]``.

    Sequences are grouped by length into power-of-two buckets and padded only to
    their bucket's longest, so the work is within 4x of the jagged sum of L^2
    rather than batch x longest^2: a rank holding one long history and many
    short ones does not pay for padding every short one to the long one.
    """
    total = q_THA.shape[0]
    lengths_B = seq_offsets_B1[1:] - seq_offsets_B1[:-1]
    if total == 0 or lengths_B.numel() == 0:  # empty, but still in the autograd graph (DDP expects every table)
        tables = [] if bias is None else [t for t in (bias.pos_weight_P, bias.time_weight_K) if t is not None]
        return v_THV * 0.0 + sum((0.0 * t.sum() for t in tables), v_THV.new_zeros(()))
    bucket_B = torch.ceil(torch.log2(lengths_B.clamp(min=1).double())).long()
    if bool((bucket_B == bucket_B[0]).all()):
        return _padded_attention(q_THA, k_THA, v_THV, seq_offsets_B1, max_seq_len, alpha, num_targets_B, max_attn_len,
                                 bias)
    out_THV = v_THV.new_zeros(v_THV.shape)
    for bucket in torch.unique(bucket_B).tolist():
        seqs = torch.nonzero(bucket_B == bucket).squeeze(1)
        sub_lengths = lengths_B[seqs]
        sub_offsets = torch.zeros(seqs.numel() + 1, dtype=seq_offsets_B1.dtype, device=seq_offsets_B1.device)
        sub_offsets[1:] = torch.cumsum(sub_lengths, 0)
        sub_total = int(sub_offsets[-1])
        if sub_total == 0:
            continue
        owner = torch.repeat_interleave(torch.arange(seqs.numel(), device=seqs.device), sub_lengths, output_size=sub_total)
        tokens = seq_offsets_B1[:-1][seqs][owner] + torch.arange(sub_total, device=seqs.device) - sub_offsets[:-1][owner]
        sub_out = _padded_attention(
            q_THA[tokens], k_THA[tokens], v_THV[tokens], sub_offsets, max_seq_len, alpha,
            None if num_targets_B is None else num_targets_B[seqs], max_attn_len,
            None if bias is None else bias.tokens(tokens),
        )
        out_THV = out_THV.index_copy(0, tokens, sub_out)
    return out_THV


def _padded_attention(
    q_THA: torch.Tensor,
    k_THA: torch.Tensor,
    v_THV: torch.Tensor,
    seq_offsets_B1: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets_B: torch.Tensor | None,
    max_attn_len: int,
    bias: RelativeBias | None = None,
) -> torch.Tensor:
    """The formula on all sequences padded to their longest (one batched einsum)."""
    total = q_THA.shape[0]
    lengths_B = seq_offsets_B1[1:] - seq_offsets_B1[:-1]
    longest = int(lengths_B.max())
    q_BNHA = jagged_to_padded(q_THA, seq_offsets_B1, longest)
    k_BNHA = jagged_to_padded(k_THA, seq_offsets_B1, longest)
    v_BNHV = jagged_to_padded(v_THV, seq_offsets_B1, longest)
    scores_BHNN = torch.einsum("bnha,bmha->bhnm", q_BNHA, k_BNHA) * alpha
    if bias is not None:
        scores_BHNN = scores_BHNN + bias.padded(seq_offsets_B1, longest).unsqueeze(1).to(scores_BHNN.dtype)
    mask_B1NN = attention_mask(lengths_B, longest, num_targets_B, max_attn_len).unsqueeze(1)
    weights_BHNN = F.silu(scores_BHNN) * mask_B1NN / max_seq_len
    out_BNHV = torch.einsum("bhnm,bmhv->bnhv", weights_BHNN, v_BNHV)
    return padded_to_jagged(out_BNHV, seq_offsets_B1, total)


_REGISTRY: KernelRegistry[AttentionImpl] = KernelRegistry("attention", reference_hstu_attention)


def register_impl(name: str, impl: AttentionImpl, preferred_on_cuda: bool = True) -> None:
    """Make ``impl`` selectable as ``backend=name`` (kernels call this when they import)."""
    _REGISTRY.register(name, impl, preferred_on_cuda)


def available_backends() -> list[str]:
    return _REGISTRY.names()


def select_backend(backend: str, device: torch.device) -> str:
    """``auto``: the first registered CUDA kernel on CUDA tensors, else the reference."""
    return _REGISTRY.select(backend, device)


def jagged_hstu_attention(
    q_THA: torch.Tensor,
    k_THA: torch.Tensor,
    v_THV: torch.Tensor,
    seq_offsets_B1: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets_B: torch.Tensor | None = None,
    max_attn_len: int = 0,
    backend: str = "auto",
    bias: RelativeBias | None = None,
) -> torch.Tensor:
    """HSTU attention over jagged ``[T, H, *]`` tensors; see the module docstring."""
    impl = _REGISTRY.get(backend, q_THA.device)
    return impl(q_THA, k_THA, v_THV, seq_offsets_B1, max_seq_len, alpha, num_targets_B, max_attn_len, bias)
