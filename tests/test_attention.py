"""The jagged HSTU attention reference against a per-token loop in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import available_backends, jagged_hstu_attention, reference_hstu_attention
from freescale.kernels.hstu_attention import RelativeBias, jagged_to_padded, padded_to_jagged, time_bucket


def bucket_of(gap: int, num_buckets: int) -> int:
    """Four buckets per doubling of ``gap + 1``, in Python integers: the exponent, then which quarter
    of the octave (linear within it)."""
    x = max(gap, 0) + 1
    exponent = x.bit_length() - 1
    return min(4 * exponent + (((x - (1 << exponent)) * 4) >> exponent), num_buckets - 1)


def naive_bias(bias: RelativeBias | None, start: int, i: int, j: int) -> torch.Tensor | float:
    if bias is None:
        return 0.0
    term: torch.Tensor | float = 0.0
    if bias.pos_weight_P is not None:
        term = term + bias.pos_weight_P[min(i - j, bias.pos_weight_P.numel() - 1)]
    if bias.time_weight_K is not None:
        gap = int(bias.query_time_T[start + i]) - int(bias.key_time_T[start + j])  # type: ignore[index]
        term = term + bias.time_weight_K[bucket_of(gap, bias.time_weight_K.numel())]
    return term


def naive(q, k, v, offsets, max_seq_len, alpha, num_targets=None, max_attn_len=0, bias=None):  # type: ignore[no-untyped-def]
    """out[i] = sum_j mask(i,j) silu(alpha q_i.k_j + bias(i, j))/n v_j, one token at a time."""
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
                w = F.silu(alpha * (q[start + i] * k[start + j]).sum(-1) + naive_bias(bias, start, i, j)) / max_seq_len
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


def random_bias(offsets: torch.Tensor, positions: int, buckets: int, seed: int,
                which: str = "position_time") -> RelativeBias:
    """Tables in float64 and timestamps with gaps from seconds to a year, oldest first in each sequence."""
    g = torch.Generator().manual_seed(seed)
    total = int(offsets[-1])
    times = torch.cumsum(torch.randint(0, 2, (total,), generator=g) * (2 ** torch.randint(0, 25, (total,), generator=g)), 0)
    query = times.clone()  # the next token's time, the last token's own (as the model does)
    for b in range(offsets.numel() - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        query[start:max(end - 1, start)] = times[start + 1:end]
    return RelativeBias(
        pos_weight_P=torch.randn(positions, generator=g, dtype=torch.float64) if "position" in which else None,
        time_weight_K=torch.randn(buckets, generator=g, dtype=torch.float64) if "time" in which else None,
        query_time_T=query, key_time_T=times)


def test_time_buckets_are_log_spaced_and_exact() -> None:
    gaps = torch.tensor([-5, 0, 1, 2, 3, 86_400, 31_536_000, 2**40])
    assert time_bucket(gaps, 128).tolist() == [0, 0, 4, 6, 8, 65, 99, 127]
    some = torch.randint(0, 2**24, (5000,), generator=torch.Generator().manual_seed(0))
    assert time_bucket(some, 1000).tolist() == [bucket_of(int(x), 1000) for x in some]
    assert bool((time_bucket(torch.arange(100_000), 128).diff() >= 0).all())


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    targets=st.booleans(),
    which=st.sampled_from(["position", "time", "position_time"]),
    positions=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 1000),
)
def test_reference_with_relative_bias_matches_naive_loop(lengths: list[int], targets: bool, which: str,
                                                         positions: int, seed: int) -> None:
    q, k, v, offsets = jagged_inputs(lengths, 2, 4, 3, seed)
    num_targets = torch.tensor([min(1, n) for n in lengths]) if targets else None
    bias = random_bias(offsets, positions, 64, seed, which)
    got = reference_hstu_attention(q, k, v, offsets, 16, 0.5, num_targets, 0, bias)
    torch.testing.assert_close(got, naive(q, k, v, offsets, 16, 0.5, num_targets, 0, bias), rtol=1e-12, atol=1e-12)


def test_relative_bias_gradients_match_naive_loop() -> None:
    q, k, v, offsets = jagged_inputs([3, 0, 1, 9], 2, 4, 3, 2)
    bias = random_bias(offsets, 5, 40, 3)
    grads = []
    for fn in (reference_hstu_attention, naive):
        pos, time = (t.clone().requires_grad_() for t in (bias.pos_weight_P, bias.time_weight_K))  # type: ignore[union-attr]
        leaf = RelativeBias(pos, time, bias.query_time_T, bias.key_time_T)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv, offsets, 16, 0.7, None, 0, bias=leaf).pow(2).sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad, pos.grad, time.grad))
    assert grads[0][4].abs().sum() > 0  # the time table got gradients
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


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
