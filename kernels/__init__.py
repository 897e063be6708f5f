"""Compute kernels with a plain-torch reference for each.

- ``hstu_attention``: jagged causal pointwise attention (reference; Triton kernel
  registers itself as a backend).
"""

from freescale.kernels.hstu_attention import (
    available_backends,
    jagged_hstu_attention,
    reference_hstu_attention,
    register_impl,
)

__all__ = ["available_backends", "jagged_hstu_attention", "reference_hstu_attention", "register_impl"]
