"""Triton kernels for ``LayerNorm(x) * u`` (see ``layer_norm_mul`` for the formula and why).

Legend: T rows (tokens), D features, ``BLOCK_D`` = next power of two >= D
(a row fits in one tile: D is heads x value dim, at most a few thousand).

- forward, program per ``BLOCK_T`` rows: loads x and u tiles, computes mean and
  rstd in fp32, writes ``y`` in the input dtype plus mean and rstd (fp32) for
  backward.  Nothing else is stored: the normalised rows are recomputed.
- backward, a persistent grid of at most ``max_programs`` programs, each
  striding over row blocks: recomputes ``xhat`` from x, mean and rstd, writes
  ``du = dy * (xhat w + b)`` and
  ``dx = rstd (g - mean(g) - xhat mean(g xhat))`` with ``g = dy u w``, and
  accumulates its rows' ``dw = sum dy u xhat`` and ``db = sum dy u`` in fp32
  registers, written once per program to a ``[programs, D]`` buffer that torch
  sums.  No atomics, so results do not depend on scheduling, and the partial
  buffer stays small (programs, not rows).

With ``TRITON_INTERPRET=1`` they run on CPU tensors (the tests).  On CUDA the
row-block size and warps are autotuned per ``BLOCK_D``; configs aim at Hopper:
1-16 rows per program, pruned to tiles of at most 16k elements (larger ones
spill registers), 16 warps only for rows of 4096 and wider.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from freescale.kernels import tile_table

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_POISON = os.environ.get("FREESCALE_POISON_KERNEL_OUTPUTS") == "1"


def _output_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan")) if _POISON else torch.empty_like(t)


def _row_stat(rows: int, device: torch.device) -> torch.Tensor:
    out = torch.empty(rows, dtype=torch.float32, device=device)
    return out.fill_(float("nan")) if _POISON else out


@triton.jit
def _fwd_kernel(X, U, W, B, Y, Mean, Rstd, T, D, inv_d, stride_x, stride_u, stride_y, eps,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < T
    col_ok = offs_d < D
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows64[:, None] * stride_u + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) * inv_d  # not / D: a GPU's fp32 division is approximate (2 ulp)
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) * inv_d + eps)
    w = tl.load(W + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    y = (centered * rstd[:, None] * w[None, :] + b[None, :]) * u
    tl.store(Y + rows64[:, None] * stride_y + offs_d[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _bwd_kernel(X, U, W, B, DY, DX, DU, DW_partial, DB_partial, Mean, Rstd, T, D, inv_d,
                stride_x, stride_u, stride_dy, stride_dx, stride_du,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_d < D
    w = tl.load(W + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + offs_d, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(pid * BLOCK_T, T, programs * BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + rows64[:, None] * stride_u + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        normed = xhat * w[None, :] + b[None, :]
        du = dy * normed
        dn = dy * u  # gradient reaching the layer norm's output
        g = dn * w[None, :]
        g_mean = tl.sum(g, axis=1) * inv_d
        gx_mean = tl.sum(g * xhat, axis=1) * inv_d
        dx = rstd[:, None] * (g - g_mean[:, None] - xhat * gx_mean[:, None])
        tl.store(DX + rows64[:, None] * stride_dx + offs_d[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DU + rows64[:, None] * stride_du + offs_d[None, :], du.to(DU.dtype.element_ty), mask=mask)
        dw += tl.sum(tl.where(mask, dn * xhat, 0.0), axis=0)
        db += tl.sum(tl.where(mask, dn, 0.0), axis=0)
    tl.store(DW_partial + pid * BLOCK_D + offs_d, dw, mask=col_ok)
    tl.store(DB_partial + pid * BLOCK_D + offs_d, db, mask=col_ok)


def _configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_T": t}, num_warps=w)
        for t, w in [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 4), (4, 8), (8, 4), (8, 8), (16, 4), (16, 8)]
    ]


_MAX_TILE = 16384  # elements of one [BLOCK_T, BLOCK_D] tile; more spills registers


def prune_configs(kernel: str, configs, named_args, **kwargs):
    """Keep tiles of at most _MAX_TILE elements (always one row per program, at least), 16 warps
    only for rows of 4096 and wider; then only what ``tile_table`` keeps for this kernel, dtype
    and width on this GPU (configs that compile without spilling)."""
    meta = {**named_args, **kwargs}
    width = int(meta.get("BLOCK_D", 1))
    kept = [
        c for c in configs
        if (c.kwargs["BLOCK_T"] == 1 or c.kwargs["BLOCK_T"] * width <= _MAX_TILE)
        and (c.num_warps < 16 or width >= 4096)
    ] or configs[:1]
    dtype = tile_table.dtype_name(meta.get("X"))
    return tile_table.kept(kernel, kept, dtype, width, False, meta.get("TARGET"))


def _tuned(kernel, name):
    if _INTERPRET:
        return kernel
    prune = functools.partial(prune_configs, name)
    return triton.autotune(configs=_configs(), key=["BLOCK_D"], prune_configs_by={"early_config_prune": prune})(kernel)


_FWD, _BWD = _tuned(_fwd_kernel, "norm.forward"), _tuned(_bwd_kernel, "norm.backward")
_INTERPRET_ROWS = 4
_INTERPRET_PROGRAMS = 3  # fewer programs than row blocks, so the tests cover the striding


def _backward_programs(rows: int, device: torch.device) -> int:
    """Persistent grid size: a few programs per SM, never more than there are rows.

    It does not depend on the autotuned ``BLOCK_T``, so every program of every
    config writes its row of the partial dW/dB buffers (zeros when it has no rows).
    """
    if _INTERPRET:
        return max(1, min(_INTERPRET_PROGRAMS, rows))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(4 * sms, rows))


class _LayerNormMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, u, weight, bias, eps):
        x, u = x.contiguous(), u.contiguous()
        rows, width = x.shape
        block_d = triton.next_power_of_2(max(width, 1))
        y = _output_like(x)
        mean, rstd = _row_stat(rows, x.device), _row_stat(rows, x.device)
        if rows and width:
            args = (x, u, weight, bias, y, mean, rstd, rows, width, 1.0 / width, x.stride(0), u.stride(0), y.stride(0),
                    float(eps))
            if _INTERPRET:
                _FWD[(triton.cdiv(rows, _INTERPRET_ROWS),)](*args, BLOCK_T=_INTERPRET_ROWS, BLOCK_D=block_d)
            else:
                _FWD[lambda m: (triton.cdiv(rows, m["BLOCK_T"]),)](*args, BLOCK_D=block_d)
        ctx.save_for_backward(x, u, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, u, weight, bias, mean, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        rows, width = x.shape
        block_d = triton.next_power_of_2(max(width, 1))
        dx, du = _output_like(x), _output_like(u)
        if not (rows and width):
            return dx, du, torch.zeros_like(weight), torch.zeros_like(bias), None
        programs = _backward_programs(rows, x.device)
        dw_partial = x.new_empty((programs, block_d), dtype=torch.float32)
        db_partial = x.new_empty((programs, block_d), dtype=torch.float32)
        args = (x, u, weight, bias, dy, dx, du, dw_partial, db_partial, mean, rstd, rows, width, 1.0 / width,
                x.stride(0), u.stride(0), dy.stride(0), dx.stride(0), du.stride(0))
        if _INTERPRET:
            _BWD[(programs,)](*args, BLOCK_T=_INTERPRET_ROWS, BLOCK_D=block_d)
        else:
            _BWD[(programs,)](*args, BLOCK_D=block_d)
        dw = dw_partial.sum(0)[:width].to(weight.dtype)
        db = db_partial.sum(0)[:width].to(bias.dtype)
        return dx, du, dw, db, None


def triton_layer_norm_mul(
    x_TD: torch.Tensor, u_TD: torch.Tensor, weight_D: torch.Tensor, bias_D: torch.Tensor, eps: float
) -> torch.Tensor:
    """``LayerNorm(x) * u`` with the fused Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if not (x_TD.is_cuda or _INTERPRET):
        raise RuntimeError("the triton layer_norm_mul needs CUDA tensors (or TRITON_INTERPRET=1 for tests)")
    return _LayerNormMul.apply(x_TD, u_TD, weight_D.contiguous(), bias_D.contiguous(), eps)
