"""Compute kernels with a plain-torch reference for each.

- ``hstu_attention``: jagged causal pointwise attention, torch reference and the
  backend selector.
- ``triton_hstu_attention``: its Triton forward/backward kernels, registered as
  backend ``"triton"`` (chosen by ``"auto"`` on CUDA tensors) when Triton imports.
- ``norm_mul`` / ``triton_layer_norm_mul``: the fused ``LayerNorm(x) * u`` (``layer_norm_mul``)
  of every HSTU block, same arrangement.
- ``registry``: the selector both share.
"""

if __name__ != "freescale.kernels":  # imported by its folder name, the repository root on sys.path
    raise ImportError(f"import freescale.kernels, not {__name__}: kernels/ is the package freescale.kernels, and a "
                      "second name would load its modules twice (duplicate registries, classes that differ)")

from freescale.kernels.hstu_attention import (
    available_backends,
    jagged_hstu_attention,
    reference_hstu_attention,
    register_impl,
)
from freescale.kernels.norm_mul import (
    layer_norm_mul,
    layer_norm_mul_backends,
    reference_layer_norm_mul,
    register_layer_norm_mul,
)

try:  # Triton is optional at run time: CPU training uses the references.
    # Imported as modules: the package's attribute of each name stays the module (``import
    # freescale.kernels.triton_hstu_attention as m`` binds the module, not its function of the same name).
    from freescale.kernels import triton_hstu_attention as _attention_kernels
    from freescale.kernels import triton_layer_norm_mul as _norm_kernels
except ImportError:  # pragma: no cover - depends on the installed stack
    pass
else:
    register_impl("triton", _attention_kernels.triton_hstu_attention)
    register_layer_norm_mul("triton", _norm_kernels.triton_layer_norm_mul)

__all__ = [
    "available_backends",
    "jagged_hstu_attention",
    "layer_norm_mul",
    "layer_norm_mul_backends",
    "reference_hstu_attention",
    "reference_layer_norm_mul",
    "register_impl",
    "register_layer_norm_mul",
]
