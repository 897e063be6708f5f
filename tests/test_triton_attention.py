"""Triton HSTU attention against the float64 torch reference.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest) at small
sizes; on CUDA the same tests run compiled, plus a larger bf16 case.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import available_backends, jagged_hstu_attention
from freescale.kernels.hstu_attention import RelativeBias, reference_hstu_attention, select_backend
from freescale.kernels.triton_hstu_attention import triton_hstu_attention
from tests.test_attention import random_bias

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32 kernels (fp32 accumulation) against float64: this is float32's band at these sizes.
TOL = {torch.float32: (2e-5, 2e-6), torch.bfloat16: (2e-2, 2e-2)}


def inputs(lengths: list[int], heads: int, attn: int, value: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    total = int(offsets[-1])
    make = lambda d: torch.randn(total, heads, d, generator=g).to(DEVICE, dtype)  # noqa: E731
    return make(attn), make(attn), make(value), offsets.to(DEVICE)


def check(lengths: list[int], heads: int, attn: int, value: int, targets: bool, window: int, seed: int,
          dtype: torch.dtype = torch.float32, max_seq_len: int = 40, bias: str = "") -> None:
    """Forward and every gradient against the float64 reference; ``bias``: "", "position", "time" or
    "position_time" (a ``RelativeBias`` with float32 tables; its gradients checked too)."""
    q, k, v, offsets = inputs(lengths, heads, attn, value, dtype, seed)
    num_targets = torch.tensor([min(2, n) for n in lengths], device=DEVICE) if targets else None
    tables = random_bias(offsets.cpu(), 7, 50, seed, bias) if bias else None

    def relative(dtype_: torch.dtype) -> tuple[object, list[torch.Tensor]]:
        if tables is None:
            return None, []
        leaves = [t.to(DEVICE, dtype_).requires_grad_() if t is not None else None
                  for t in (tables.pos_weight_P, tables.time_weight_K)]
        times = [t.to(DEVICE) for t in (tables.query_time_T, tables.key_time_T)]  # type: ignore[union-attr]
        return RelativeBias(leaves[0], leaves[1], *times), [t for t in leaves if t is not None]

    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    fast_bias, fast_tables = relative(torch.float32)
    out = triton_hstu_attention(qq, kk, vv, offsets, max_seq_len, 0.4, num_targets, window, fast_bias)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    out.backward(grad)
    rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
    ref_bias, ref_tables = relative(torch.float64)
    ref = reference_hstu_attention(rq, rk, rv, offsets, max_seq_len, 0.4, num_targets, window, ref_bias)
    ref.backward(grad.double())
    rtol, atol = TOL[dtype]
    pairs = [(out, ref), (qq.grad, rq.grad), (kk.grad, rk.grad), (vv.grad, rv.grad)]
    # A table's gradient sums every (query, key) pair of every head: float32's band grows with the sum.
    pairs += [(f.grad, r.grad) for f, r in zip(fast_tables, ref_tables)]
    for got, want in pairs:
        if got is None or want is None:  # no tokens at all: autograd may skip the backward
            assert q.shape[0] == 0
            continue
        assert not torch.isnan(got).any(), "an element was never written"
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    heads=st.integers(1, 2),
    targets=st.booleans(),
    window=st.sampled_from([0, 3, 17]),
    seed=st.integers(0, 10_000),
)
def test_forward_and_gradients_match_reference(lengths: list[int], heads: int, targets: bool, window: int, seed: int) -> None:
    check(lengths, heads, attn=8, value=12, targets=targets, window=window, seed=seed)


@pytest.mark.parametrize("lengths", [[0], [1], [1, 0, 1], [16], [17, 33], [0, 0],
                                     [0, 3, 40, 0, 1, 16, 17, 0, 5, 33, 0]])  # the work list's search over many
def test_edge_lengths(lengths: list[int]) -> None:
    check(lengths, heads=2, attn=16, value=16, targets=False, window=0, seed=0)


@pytest.mark.parametrize(("lengths", "bias", "targets", "window"), [
    ([0], "position_time", False, 0), ([1, 0, 1], "position_time", True, 0), ([17, 33], "position", False, 5),
    ([20, 3], "time", True, 0), ([40, 9, 1], "position_time", True, 17)])
def test_relative_bias_forward_and_gradients_match_reference(lengths: list[int], bias: str, targets: bool,
                                                             window: int) -> None:
    check(lengths, heads=2, attn=8, value=12, targets=targets, window=window, seed=len(lengths), bias=bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_long_sequences_on_gpu() -> None:
    check([1000, 1, 513, 2048], heads=4, attn=64, value=64, targets=True, window=0, seed=0,
          dtype=torch.bfloat16, max_seq_len=2048)


def test_selector_uses_triton_only_on_cuda() -> None:
    assert "triton" in available_backends()
    assert select_backend("auto", torch.device("cpu")) == "reference"
    assert select_backend("auto", torch.device("cuda")) == "triton"
    q, k, v, offsets = inputs([5, 3], 1, 8, 8, torch.float32, 0)
    a = jagged_hstu_attention(q, k, v, offsets, 8, 1.0, backend="triton")
    b = jagged_hstu_attention(q, k, v, offsets, 8, 1.0, backend="reference")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_work_list_holds_each_live_block_once_for_every_block_size() -> None:
    """``_work_lists`` (built on the device, no host sync) against a plain enumeration: row BLOCK // 32 lists every
    (sequence, block) that holds tokens, in order, then -1; the launch bound ``cdiv(T, BLOCK) + B`` covers it."""
    from freescale.kernels.triton_hstu_attention import WORK_BLOCKS, _work_lists

    lengths = [0, 3, 40, 0, 1, 16, 17, 0, 5, 33, 0, 129, 256]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    total = sum(lengths)
    work = _work_lists(offsets, total)
    for block in WORK_BLOCKS:
        want = [(b, k) for b, n in enumerate(lengths) for k in range(-(-n // block))]
        row = work[block // 32].tolist()
        got = [(v >> 32, v & 0xFFFFFFFF) for v in row if v >= 0]
        assert got == want and all(v == -1 for v in row[len(want):]), block
        assert len(want) <= -(-total // block) + len(lengths)

