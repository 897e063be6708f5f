"""Compute kernels with a plain-torch reference for each.

- ``hstu_attention``: jagged causal pointwise attention, torch reference and the
  backend selector.
- ``triton_hstu_attention``: its Triton forward/backward kernels, registered as
  backend ``"triton"`` (chosen by ``"auto"`` on CUDA tensors) when Triton imports.
"""

from freescale.kernels.hstu_attention import (
    available_backends,
    jagged_hstu_attention,
    reference_hstu_attention,
    register_impl,
)

try:  # Triton is optional at run time: CPU training uses the reference.
    from freescale.kernels.triton_hstu_attention import triton_hstu_attention
except ImportError:  # pragma: no cover - depends on the installed stack
    pass
else:
    register_impl("triton", triton_hstu_attention)

__all__ = ["available_backends", "jagged_hstu_attention", "reference_hstu_attention", "register_impl"]
