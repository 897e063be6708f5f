"""Fused layer norm times gate, ``LayerNorm(x) * u``: the torch reference and the selector.

In every HSTU block the attention output is normalised and gated by the ``u``
projection before the output linear layer::

    y[t] = (normalize(x[t]) * weight + bias) * u[t]        x, u, y: [T, D] jagged rows

Unfused, torch runs a layer norm kernel, writes its ``[T, D]`` output, then a
multiply kernel reads it back with ``u``; backward runs the layer-norm backward
plus two more elementwise kernels and keeps the normalised tensor alive for
autograd.  The fused Triton kernel (``triton_layer_norm_mul``) reads ``x`` and
``u`` once and writes ``y`` once in the forward, keeps only per-row mean and
rstd (8 bytes a row) for backward, and computes ``dx``, ``du`` and the
weight/bias gradients in one pass.  The op is memory-bound, so the saving is
the bytes: about 5 ``[T, D]`` tensors moved forward+backward instead of 9.

Rows are tokens, so the op is jagged for free: no sequence structure, no
padding.  ``layer_norm_mul`` picks the implementation like the attention does
(Triton on CUDA, this reference elsewhere, overridable).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from freescale.kernels.registry import KernelRegistry


class LayerNormMulImpl(Protocol):
    def __call__(
        self, x_TD: torch.Tensor, u_TD: torch.Tensor, weight_D: torch.Tensor, bias_D: torch.Tensor, eps: float
    ) -> torch.Tensor: ...


def reference_layer_norm_mul(
    x_TD: torch.Tensor, u_TD: torch.Tensor, weight_D: torch.Tensor, bias_D: torch.Tensor, eps: float
) -> torch.Tensor:
    """Plain torch: ``F.layer_norm`` over the last dim, then the product with ``u``."""
    return F.layer_norm(x_TD, (x_TD.shape[-1],), weight_D, bias_D, eps) * u_TD


_REGISTRY: KernelRegistry[LayerNormMulImpl] = KernelRegistry("layer_norm_mul", reference_layer_norm_mul)
register_layer_norm_mul = _REGISTRY.register
layer_norm_mul_backends = _REGISTRY.names
select_layer_norm_mul_backend = _REGISTRY.select


def layer_norm_mul(
    x_TD: torch.Tensor,
    u_TD: torch.Tensor,
    weight_D: torch.Tensor,
    bias_D: torch.Tensor,
    eps: float = 1e-5,
    backend: str = "auto",
) -> torch.Tensor:
    """``LayerNorm(x; weight, bias, eps) * u`` over ``[T, D]`` rows; see the module docstring."""
    if x_TD.shape != u_TD.shape or x_TD.dim() != 2:
        raise ValueError(f"layer_norm_mul: x and u must both be [T, D], got {tuple(x_TD.shape)} and {tuple(u_TD.shape)}")
    if weight_D.shape != (x_TD.shape[1],) or bias_D.shape != (x_TD.shape[1],):
        raise ValueError(
            f"layer_norm_mul: weight and bias must be [{x_TD.shape[1]}], got {tuple(weight_D.shape)} and {tuple(bias_D.shape)}"
        )
    return _REGISTRY.get(backend, x_TD.device)(x_TD, u_TD, weight_D, bias_D, eps)
