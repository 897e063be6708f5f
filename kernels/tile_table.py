"""Which autotune configs each Triton kernel keeps on each GPU target: read off the compiler, not guessed.

``benchmarks/compile_kernels.py`` compiles every candidate config of every kernel ahead of time for
sm_90a (H100/H200) and sm_100a (B200) and reads registers, spills and shared memory off ``ptxas``;
``--write-kept`` stores, per (kernel, target, dtype, tile width, bias), the configs that compile
without spilling and fit in shared memory (``kept_configs.json`` beside this file).  The
autotuners' early pruning keeps only those, so a GPU never benchmarks (or picks) a config that
spills or cannot launch.  Where every candidate spills, the entry keeps the one that spills
least and says so (``exception``): the README lists those.

A combination the table does not hold (another head dim, a target not compiled for) keeps every
candidate the kernel's own rules allow: the table narrows, it never invents.  ``_meta`` says which
Triton's compiler judged it; the GPU machines measured so far run an older one (3.6 vs 3.8), whose
register allocation differs a little: the 32 B spill allowance absorbs that (one H100 run).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

TABLE = Path(__file__).with_name("kept_configs.json")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
"""The table's dtype names (also Triton's pointer element types) -> torch dtypes."""


def dtype_name(tensor: Any) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` of a tensor argument ("" for anything else)."""
    return DTYPE_NAMES.get(getattr(tensor, "dtype", None), "")  # type: ignore[arg-type]


def config_name(tile: list[int], warps: int, stages: int) -> str:
    """``64x32/4w/2s``: the tile (constexprs in order), warps and pipeline stages."""
    return f"{'x'.join(str(v) for v in tile)}/{warps}w/{stages}s"


def config_id(config: Any) -> str:
    """:func:`config_name` of a ``triton.Config``."""
    return config_name(list(config.kwargs.values()), config.num_warps, config.num_stages)


def entry_key(dtype: str, width: int, bias: bool) -> str:
    return f"{dtype}/{width}/{'bias' if bias else 'plain'}"


@functools.cache
def _table() -> dict[str, Any]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


@functools.cache
def device_target(device_index: int = 0) -> str:
    """``sm_90a`` (Hopper) or ``sm_100a`` (Blackwell data-center) for the current GPU; another GPU
    (an A100, a consumer Blackwell) gets "" and keeps every candidate: the table says nothing of it."""
    if not torch.cuda.is_available():
        return ""
    major, _ = torch.cuda.get_device_capability(device_index)
    return {9: "sm_90a", 10: "sm_100a"}.get(major, "")


def kept(kernel: str, configs: list[Any], dtype: str, width: int, bias: bool, target: str | None = None) -> list[Any]:
    """The candidates the table keeps for this kernel and shape on ``target`` (default: this GPU's)."""
    entry = _table().get(kernel, {}).get(target or device_target(), {}).get(entry_key(dtype, width, bias))
    if entry is None:
        return configs
    allowed = set(entry["configs"])
    chosen = [c for c in configs if config_id(c) in allowed]
    return chosen or configs
