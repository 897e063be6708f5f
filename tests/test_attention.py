"""The jagged HSTU attention reference against a per-token loop in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import available_backends, jagged_hstu_attention, reference_hstu_attention
from freescale.kernels.hstu_attention import jagged_to_padded, padded_to_jagged


def naive(q, k, v, offsets, max_seq_len, alpha, num_targets=None, max_attn_len=0):  # type: ignore[no-untyped-def]
    """out[i] = sum_j mask(i,j) silu(alpha q_i.k_j)/n v_j, one token at a time."""
    out = torch.zeros_like(v)
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        length = end - start
        history = length - (int(num_targets[b]) if num_targets is not None else 0)
        for i in range(length):
            for j in range(i + 1):
                if num_targets is not None and j >= history and j != i:
                    continue
                if max_attn_len and i - j > max_attn_len:
                    continue
                w = F.silu(alpha * (q[start + i] * k[start + j]).sum(-1)) / max_seq_len  # [H]
                out[start + i] += w.unsqueeze(-1) * v[start + j]
    return out


def jagged_inputs(lengths: list[int], heads: int, attn: int, value: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    total = int(offsets[-1])
    q = torch.randn(total, heads, attn, generator=g, dtype=torch.float64)
    k = torch.randn(total, heads, attn, generator=g, dtype=torch.float64)
    v = torch.randn(total, heads, value, generator=g, dtype=torch.float64)
    return q, k, v, offsets


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    heads=st.integers(1, 2),
    targets=st.booleans(),
    window=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_reference_matches_naive_loop(lengths: list[int], heads: int, targets: bool, window: int, seed: int) -> None:
    q, k, v, offsets = jagged_inputs(lengths, heads, 4, 3, seed)
    num_targets = torch.tensor([min(2, n) for n in lengths]) if targets else None
    got = reference_hstu_attention(q, k, v, offsets, 16, 0.5, num_targets, window)
    want = naive(q, k, v, offsets, 16, 0.5, num_targets, window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_output_does_not_depend_on_batch_neighbours() -> None:
    q, k, v, offsets = jagged_inputs([5, 30, 2], 2, 4, 4, 0)
    together = jagged_hstu_attention(q, k, v, offsets, max_seq_len=32, alpha=0.3)
    alone = jagged_hstu_attention(q[:5], k[:5], v[:5], offsets[:2], max_seq_len=32, alpha=0.3)
    torch.testing.assert_close(together[:5], alone, rtol=1e-12, atol=1e-15)


def test_gradients_match_naive_loop() -> None:
    q, k, v, offsets = jagged_inputs([3, 0, 1, 6], 2, 4, 3, 1)
    grads = []
    for fn in (reference_hstu_attention, naive):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv, offsets, 8, 0.7, torch.tensor([1, 0, 1, 2]), 0).pow(2).sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_padding_round_trip_and_empty_batch() -> None:
    x = torch.arange(12.0).view(6, 2)
    offsets = torch.tensor([0, 2, 2, 6])
    padded = jagged_to_padded(x, offsets, 4)
    assert padded.shape == (3, 4, 2) and padded[1].abs().sum() == 0
    assert torch.equal(padded_to_jagged(padded, offsets, 6), x)
    empty = torch.zeros(0, 1, 4)
    assert reference_hstu_attention(empty, empty, empty, torch.tensor([0, 0]), 4, 1.0).shape == (0, 1, 4)


def test_selector() -> None:
    assert "reference" in available_backends()
    q, k, v, offsets = jagged_inputs([3], 1, 2, 2, 0)
    try:
        jagged_hstu_attention(q, k, v, offsets, 4, 1.0, backend="cutlass")
    except ValueError as exc:
        assert "attention backend 'cutlass' is not available" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("unknown backend accepted")
