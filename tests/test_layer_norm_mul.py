"""Fused ``LayerNorm(x) * u``: Triton kernels against the float64 torch reference.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest), with outputs
poisoned so unwritten rows fail; on CUDA the same tests run compiled, plus bf16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import layer_norm_mul, layer_norm_mul_backends, reference_layer_norm_mul
from freescale.kernels.norm_mul import select_layer_norm_mul_backend
from freescale.kernels.triton_layer_norm_mul import triton_layer_norm_mul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def check(rows: int, width: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)  # noqa: E731
    x, u, dy = make(rows, width), make(rows, width), make(rows, width)
    w = (1 + 0.3 * torch.randn(width, generator=g)).to(DEVICE, dtype)
    b = (0.2 * torch.randn(width, generator=g)).to(DEVICE, dtype)
    got_in = [t.clone().requires_grad_() for t in (x, u, w, b)]
    want_in = [t.double().requires_grad_() for t in (x, u, w, b)]
    got = triton_layer_norm_mul(*got_in, eps=1e-5)
    want = reference_layer_norm_mul(*want_in, eps=1e-5)
    got.backward(dy)
    want.backward(dy.double())
    rtol, atol = TOL[dtype]
    for name, a, e in [("y", got, want)] + [
        (f"d{n}", gi.grad, wi.grad) for n, gi, wi in zip("xuwb", got_in, want_in)
    ]:
        assert a is not None and e is not None, name
        assert a.dtype == dtype, name
        assert not torch.isnan(a).any(), f"{name}: an element was never written"
        # Absolute band relative to the tensor's magnitude: dw/db are sums over
        # rows of products (values of order rows x scale^2 that cancel), and
        # float32 rounds each addend at its own magnitude, not the sum's.
        magnitude = float(e.abs().max()) if e.numel() else 1.0
        torch.testing.assert_close(a.double(), e, rtol=rtol, atol=atol * max(1.0, magnitude), msg=name)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 40), width=st.sampled_from([1, 3, 16, 33, 64]), seed=st.integers(0, 10_000),
       scale=st.sampled_from([1e-2, 1.0, 30.0]))
def test_forward_and_gradients_match_reference(rows: int, width: int, seed: int, scale: float) -> None:
    check(rows, width, seed, scale=scale)


@pytest.mark.parametrize("rows", [1, 4, 5, 13, 100])
def test_row_counts_around_block_and_program_boundaries(rows: int) -> None:
    check(rows, 24, seed=rows)


def test_no_rows() -> None:
    x = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    u = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    b = torch.zeros(8, device=DEVICE, requires_grad=True)
    y = triton_layer_norm_mul(x, u, w, b, 1e-5)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("width", [256, 1024, 4096])
def test_bf16_on_gpu(width: int) -> None:
    check(20_000, width, seed=0, dtype=torch.bfloat16)


def test_selector_and_shape_errors() -> None:
    assert {"reference", "triton"} <= set(layer_norm_mul_backends())
    assert select_layer_norm_mul_backend("auto", torch.device("cpu")) == "reference"
    assert select_layer_norm_mul_backend("auto", torch.device("cuda")) == "triton"
    x = torch.randn(6, 4, device=DEVICE)  # the triton backend takes CUDA tensors (or interpreted CPU ones)
    w, b = torch.ones(4, device=DEVICE), torch.zeros(4, device=DEVICE)
    torch.testing.assert_close(
        layer_norm_mul(x, x, w, b, backend="triton"), layer_norm_mul(x, x, w, b, backend="reference")
    )
    with pytest.raises(ValueError, match="x and u must both be"):
        layer_norm_mul(x, x[:, :3], w, b)
    with pytest.raises(ValueError, match=r"weight and bias must be \[4\]"):
        layer_norm_mul(x, x, w[:3], b)
    with pytest.raises(ValueError, match="layer_norm_mul backend 'cuda' is not available"):
        layer_norm_mul(x, x, w, b, backend="cuda")
