"""Triton kernels for jagged HSTU attention, forward and backward.

Same formula and mask as ``hstu_attention.reference_hstu_attention`` (see its
module docstring); legend: T tokens, H heads, A attention dim, V value dim,
B sequences, N = max_seq_len (the normaliser and the longest allowed sequence).

Work decomposition (one program per (block of rows, sequence x head)):

- a work list, not a padded grid: axis 0 has one program per live (sequence, block of rows), read
  from a list built on the device for every block size the configs use (``_work_lists``: prefix sums
  of the sequences' block counts and a ``searchsorted``; ``_work_item``: one load), bounded by
  ``ceil(T / BLOCK) + B`` without a host sync; axis 1 the heads.  (A grid of ``B*H x ceil(N / BLOCK)`` launched mostly
  programs that exit at once where sequences are short next to N: on an H100 the kernels reached
  5-9% of the bf16 matmul peak so.)
- forward, program (block m of sequence b, head h): query rows ``m*BLOCK_M ..`` of sequence b, head
  h; walks the key blocks that the causal (and ``max_attn_len``) window allows,
  accumulating ``(silu(alpha q k^T) * mask / N) @ v`` in fp32.  Nothing is padded.
- backward, two kernels without atomics: ``_bwd_dkdv`` (program per key block)
  walks the query blocks that can see it and accumulates dK and dV;
  ``_bwd_dq`` (program per query block) walks key blocks and accumulates dQ.
  Both recompute the scores instead of storing the T x T weights.

A :class:`~freescale.kernels.hstu_attention.RelativeBias` adds its position and
time-bucket terms to every score tile (recomputed in backward like the scores);
its tables' gradients are scattered from ``_bwd_dq`` with atomic adds into fp32
buffers (the tables are small and shared by every head and sequence; the
autotuner zeroes them between its trial runs).  On a GPU the atomics' order
varies, so those two gradients (and what follows from them) are not bit-identical
from run to run; every element contends for a few hundred addresses (checked against
float64 on an H100, not timed there: a per-tile reduction first is the known remedy).

With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (tests do this
at small sizes).  On CUDA the block sizes are autotuned per (N bucket, A, V, dtypes)
among candidates up to 128 x 128 tiles forward and 64 x 64 / 128 x 32 backward, pruned
before any compile to those ``tile_table`` keeps for the GPU's target, dtype, head dim
and bias: the configs that compiled there without spilling more than 32 B per thread
(``benchmarks/compile_kernels.py``; head dims of 256, not in the table, drop the 128-row
tiles).  fp32 inputs use ``input_precision="tf32x3"`` (three TF32 tensor-core products per
dot: about fp32's accuracy, within the tests' fp32 band against float64), not plain TF32.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from freescale.kernels import tile_table
from freescale.kernels.hstu_attention import TIME_BUCKET_SUB_BITS, RelativeBias

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this so that any element a kernel fails to write is NaN, not stale memory.
_POISON = os.environ.get("FREESCALE_POISON_KERNEL_OUTPUTS") == "1"


def _output_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan")) if _POISON else torch.empty_like(t)


@triton.jit
def _mask(m, n, length, history, max_attn_len):
    """May query token m attend to key token n?  m, n: broadcastable index grids
    (``[M, 1]`` and ``[1, N]`` for a scores tile, ``[1, M]`` and ``[N, 1]`` for its transpose)."""
    causal = (n <= m) & (m < length) & (n < length)
    target_ok = (n < history) | (n == m)
    window_ok = (max_attn_len == 0) | (m - n <= max_attn_len)
    return causal & target_ok & window_ok


@triton.jit
def _bias(PosW, TimeW, QTime, KTime, start, m, n, length, num_pos, num_buckets,
          HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, SUB_BITS: tl.constexpr):
    """The score bias for query tokens m and key tokens n (index grids as for ``_mask``), with the
    table indices it read (backward scatters into them): ``hstu_attention.time_bucket`` bit for bit."""
    distance = tl.minimum(tl.maximum(m - n, 0), num_pos - 1)
    bucket = distance * 0
    bias = tl.zeros(distance.shape, dtype=tl.float32)
    if HAS_POS:
        bias += tl.load(PosW + distance).to(tl.float32)
    if HAS_TIME:
        query = tl.load(QTime + start + m, mask=m < length, other=0)
        key = tl.load(KTime + start + n, mask=n < length, other=0)
        bits = (tl.maximum(query - key, 0) + 1).to(tl.float32).to(tl.int32, bitcast=True)
        bucket = tl.minimum(tl.maximum((bits >> (23 - SUB_BITS)) - (127 << SUB_BITS), 0), num_buckets - 1)
        bias += tl.load(TimeW + bucket).to(tl.float32)
    return bias, distance, bucket


@triton.jit
def _sequence(seq_offsets, num_targets, b, HAS_TARGETS: tl.constexpr):
    """First token, length and history length (length minus targets) of sequence b."""
    start = tl.load(seq_offsets + b).to(tl.int64)  # row * stride must not wrap at 2^31
    length = (tl.load(seq_offsets + b + 1) - start).to(tl.int32)
    history = length
    if HAS_TARGETS:
        history = length - tl.load(num_targets + b).to(tl.int32)
    return start, length, history


@triton.jit
def _work_item(Work, width, BLOCK: tl.constexpr):
    """This program's (sequence, block of BLOCK rows, whether it has one): entry p of the work list's row for
    BLOCK (``_work_lists``: ``b << 32 | block``, -1 past the batch's last block)."""
    tl.static_assert((BLOCK == 16) | (BLOCK == 32) | (BLOCK == 64) | (BLOCK == 128))  # a row of WORK_BLOCKS
    item = tl.load(Work + (BLOCK // 32) * width + tl.program_id(0))
    return (item >> 32).to(tl.int32), (item & 0xFFFFFFFF).to(tl.int32), item >= 0


@triton.jit
def _rows(ptr, start, offs_t, stride_t, head_offset, offs_d, dim, length):
    """A [rows, D] tile of a [T, H, D] tensor: tokens start+offs_t of one head, zero-padded."""
    return tl.load(ptr + (start + offs_t)[:, None] * stride_t + head_offset + offs_d[None, :],
                   mask=(offs_t[:, None] < length) & (offs_d[None, :] < dim), other=0.0)


@triton.jit
def _store_rows(ptr, value, start, offs_t, stride_t, head_offset, offs_d, dim, length):
    tl.store(ptr + (start + offs_t)[:, None] * stride_t + head_offset + offs_d[None, :],
             value.to(ptr.dtype.element_ty), mask=(offs_t[:, None] < length) & (offs_d[None, :] < dim))


@triton.jit
def _score_grad(s, dw, keep, inv_n):
    """Weights w = silu(s) * mask / N of scores s = alpha q.k + bias, and the loss gradient
    w.r.t. s: dS = dW * silu'(s) * mask / N, where dW = dO . v (q.k's is alpha dS, the bias's dS)."""
    sig = tl.sigmoid(s)
    w = tl.where(keep, s * sig * inv_n, 0.0)
    ds = tl.where(keep, dw * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)
    return w, ds


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, seq_offsets, Work, W, num_targets, PosW, TimeW, QTime, KTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    alpha, inv_n, max_attn_len, H, A, Vd, num_pos, num_buckets,
    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, SUB_BITS: tl.constexpr,
    HAS_TARGETS: tl.constexpr, N_BUCKET, BLOCK_A: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, block, live = _work_item(Work, W, BLOCK_M)  # live blocks on axis 0 (up to 2^31), heads on axis 1
    if not live:
        return
    h = tl.program_id(1)
    start, length, history = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    first_m = block * BLOCK_M
    offs_m = first_m + tl.arange(0, BLOCK_M)
    offs_a = tl.arange(0, BLOCK_A)
    offs_v = tl.arange(0, BLOCK_V)
    q = _rows(Q, start, offs_m, stride_qt, h * stride_qh, offs_a, A, length)
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    lo = 0
    if max_attn_len > 0:
        lo = tl.maximum(first_m - max_attn_len, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first_m + BLOCK_M, length)
    for first_n in range(lo, hi, BLOCK_N):
        offs_n = first_n + tl.arange(0, BLOCK_N)
        k = _rows(K, start, offs_n, stride_kt, h * stride_kh, offs_a, A, length)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
        if HAS_POS or HAS_TIME:
            bias, _, _ = _bias(PosW, TimeW, QTime, KTime, start, offs_m[:, None], offs_n[None, :], length, num_pos,
                               num_buckets, HAS_POS, HAS_TIME, SUB_BITS)
            s += bias
        w = s * tl.sigmoid(s) * inv_n
        w = tl.where(_mask(offs_m[:, None], offs_n[None, :], length, history, max_attn_len), w, 0.0)
        v = _rows(V, start, offs_n, stride_vt, h * stride_vh, offs_v, Vd, length)
        acc += tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    _store_rows(Out, acc, start, offs_m, stride_ot, h * stride_oh, offs_v, Vd, length)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, dO, dK, dV, seq_offsets, Work, W, num_targets, PosW, TimeW, QTime, KTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    alpha, inv_n, max_attn_len, H, A, Vd, num_pos, num_buckets,
    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, SUB_BITS: tl.constexpr,
    HAS_TARGETS: tl.constexpr, N_BUCKET, BLOCK_A: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, block, live = _work_item(Work, W, BLOCK_N)
    if not live:
        return
    h = tl.program_id(1)
    start, length, history = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    first_n = block * BLOCK_N
    offs_n = first_n + tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, BLOCK_A)
    offs_v = tl.arange(0, BLOCK_V)
    k = _rows(K, start, offs_n, stride_kt, h * stride_kh, offs_a, A, length)
    v = _rows(V, start, offs_n, stride_vt, h * stride_vh, offs_v, Vd, length)
    dk = tl.zeros((BLOCK_N, BLOCK_A), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    lo = first_n // BLOCK_M * BLOCK_M
    hi = length
    if max_attn_len > 0:
        hi = tl.minimum(first_n + BLOCK_N + max_attn_len, length)
    for first_m in range(lo, hi, BLOCK_M):
        offs_m = first_m + tl.arange(0, BLOCK_M)
        q = _rows(Q, start, offs_m, stride_qt, h * stride_qh, offs_a, A, length)
        do = _rows(dO, start, offs_m, stride_dot, h * stride_doh, offs_v, Vd, length)
        # Transposed [N, M] tiles straight from the dots (no register transposes).
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * alpha
        if HAS_POS or HAS_TIME:
            bias_t, _, _ = _bias(PosW, TimeW, QTime, KTime, start, offs_m[None, :], offs_n[:, None], length, num_pos,
                                 num_buckets, HAS_POS, HAS_TIME, SUB_BITS)
            s_t += bias_t
        dw_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        keep_t = _mask(offs_m[None, :], offs_n[:, None], length, history, max_attn_len)
        w_t, ds_t = _score_grad(s_t, dw_t, keep_t, inv_n)
        dv += tl.dot(w_t.to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot((ds_t * alpha).to(q.dtype), q, input_precision=PRECISION)
    _store_rows(dK, dk, start, offs_n, stride_kt, h * stride_kh, offs_a, A, length)
    _store_rows(dV, dv, start, offs_n, stride_vt, h * stride_vh, offs_v, Vd, length)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, dO, dQ, seq_offsets, Work, W, num_targets, PosW, TimeW, QTime, KTime, dPosW, dTimeW,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    alpha, inv_n, max_attn_len, H, A, Vd, num_pos, num_buckets,
    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, SUB_BITS: tl.constexpr,
    HAS_TARGETS: tl.constexpr, N_BUCKET, BLOCK_A: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, block, live = _work_item(Work, W, BLOCK_M)
    if not live:
        return
    h = tl.program_id(1)
    start, length, history = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    first_m = block * BLOCK_M
    offs_m = first_m + tl.arange(0, BLOCK_M)
    offs_a = tl.arange(0, BLOCK_A)
    offs_v = tl.arange(0, BLOCK_V)
    q = _rows(Q, start, offs_m, stride_qt, h * stride_qh, offs_a, A, length)
    do = _rows(dO, start, offs_m, stride_dot, h * stride_doh, offs_v, Vd, length)
    dq = tl.zeros((BLOCK_M, BLOCK_A), dtype=tl.float32)
    lo = 0
    if max_attn_len > 0:
        lo = tl.maximum(first_m - max_attn_len, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(first_m + BLOCK_M, length)
    for first_n in range(lo, hi, BLOCK_N):
        offs_n = first_n + tl.arange(0, BLOCK_N)
        k = _rows(K, start, offs_n, stride_kt, h * stride_kh, offs_a, A, length)
        v = _rows(V, start, offs_n, stride_vt, h * stride_vh, offs_v, Vd, length)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
        if HAS_POS or HAS_TIME:
            bias, distance, bucket = _bias(PosW, TimeW, QTime, KTime, start, offs_m[:, None], offs_n[None, :], length,
                                           num_pos, num_buckets, HAS_POS, HAS_TIME, SUB_BITS)
            s += bias
        dw = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        keep = _mask(offs_m[:, None], offs_n[None, :], length, history, max_attn_len)
        _, ds = _score_grad(s, dw, keep, inv_n)
        dq += tl.dot((ds * alpha).to(k.dtype), k, input_precision=PRECISION)
        if HAS_POS:
            tl.atomic_add(dPosW + distance, ds, mask=keep)
        if HAS_TIME:
            tl.atomic_add(dTimeW + bucket, ds, mask=keep)
    _store_rows(dQ, dq, start, offs_m, stride_qt, h * stride_qh, offs_a, A, length)


# Small tiles on 8 warps (fewer registers per thread) are there for fp32 inputs, whose tf32x3 dots
# hold twice the operand registers; kernels/tile_table.py keeps, per dtype and head dim, only the
# configs that compile without spilling (benchmarks/compile_kernels.py).
_FP32_FRIENDLY = [(32, 32, 8, 2), (16, 32, 4, 2), (64, 32, 8, 2)]


def _forward_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2),
                            *_FP32_FRIENDLY]
    ]


def _backward_configs() -> list[triton.Config]:
    """Smaller tiles than forward: backward keeps q, k, v, dO tiles and two fp32
    accumulators live, and 128 x 128 tiles overflow Hopper's 227 KB of shared memory."""
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
        for m, n, w, st in [(64, 64, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2), (128, 32, 8, 2),
                            *_FP32_FRIENDLY, (32, 16, 8, 2)]  # 32x16: the one fp32 dK/dV tile at head dim 128
                                                              # that spills nothing on sm_90a
    ]


def prune_configs(kernel: str, configs, named_args, **kwargs):
    """Head dims of 256 leave no room for 128-row tiles (dropped before compiling); then only the
    configs ``tile_table`` keeps for this kernel, dtype, head dim and bias on this GPU."""
    meta = {**named_args, **kwargs}
    widest = max(int(meta.get("BLOCK_A", 0)), int(meta.get("BLOCK_V", 0)))
    small = [c for c in configs if max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) < 128]
    configs = small if widest >= 256 and small else configs
    dtype = tile_table.dtype_name(meta.get("Q"))
    bias = bool(meta.get("HAS_POS") or meta.get("HAS_TIME"))
    return tile_table.kept(kernel, configs, dtype, widest, bias, meta.get("TARGET"))


# N_BUCKET (next power of two of max_seq_len) exists only as an autotuning key: a plain int, not a
# constexpr, so a new bucket re-tunes among already compiled kernels instead of compiling five more.
_KEY = ["N_BUCKET", "BLOCK_A", "BLOCK_V"]


def _tuned(kernel, name, configs, reset_to_zero=None):
    """``reset_to_zero``: buffers the kernel accumulates into (atomics), zeroed before each trial run."""
    if _INTERPRET:
        return kernel
    prune = functools.partial(prune_configs, name)
    return triton.autotune(configs=configs, key=_KEY, reset_to_zero=reset_to_zero,
                           prune_configs_by={"early_config_prune": prune})(kernel)


_FWD = _tuned(_fwd_kernel, "attention.forward", _forward_configs())
_DKDV = _tuned(_bwd_dkdv_kernel, "attention.backward_dkdv", _backward_configs())
_DQ = _tuned(_bwd_dq_kernel, "attention.backward_dq", _backward_configs(), reset_to_zero=["dPosW", "dTimeW"])
_INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


WORK_BLOCKS = (16, 32, 64, 128)
"""The row-block sizes the kernels' configs use: ``_work_lists`` has a row of prefix sums for each."""


def _work_lists(seq_offsets: torch.Tensor, total: int) -> torch.Tensor:
    """The work list per block size BLOCK in ``WORK_BLOCKS``, at row BLOCK // 32 (16, 32, 64 -> 0, 1, 2; 128 -> 4;
    row 3 unused): entry p is the p-th live (sequence b, block) of the batch as ``b << 32 | block``, then -1.  Built
    on the device from the prefix sums of the sequences' block counts (a ``searchsorted``: no host sync); a row
    has ``cdiv(total, 16) + B`` entries, the bound on live blocks at the smallest size."""
    batch = seq_offsets.numel() - 1
    lengths = (seq_offsets[1:] - seq_offsets[:-1]).to(torch.int64)
    width = triton.cdiv(total, WORK_BLOCKS[0]) + batch
    work = torch.full((5, width), -1, dtype=torch.int64, device=seq_offsets.device)
    index = torch.arange(width, dtype=torch.int64, device=seq_offsets.device)
    for block in WORK_BLOCKS:
        ends = torch.cumsum((lengths + block - 1) // block, 0)  # the first block past each sequence's
        sequence = torch.searchsorted(ends, index, right=True)
        first = ends - (lengths + block - 1) // block
        live = sequence < batch
        at = sequence.clamp(max=batch - 1)
        work[block // 32] = torch.where(live, (at << 32) | (index - first[at]), -1)
    return work


def _launch(kernel, rows_per_block_key: str, total: int, batch: int, heads: int, *args, **meta):
    """Grid (live row blocks, heads): one program per (sequence, block of rows) that holds tokens, on axis 0
    (``_work_item``); ``total`` tokens in ``batch`` sequences have at most ``cdiv(total, BLOCK) + batch`` such
    blocks, a bound known without a host sync (the programs past the batch's last block exit at once)."""
    if _INTERPRET:
        grid = (triton.cdiv(total, _INTERPRET_BLOCKS[rows_per_block_key]) + batch, heads)
        kernel[grid](*args, **meta, **_INTERPRET_BLOCKS)
    else:
        kernel[lambda m: (triton.cdiv(total, m[rows_per_block_key]) + batch, heads)](*args, **meta)


def _precision(t: torch.Tensor) -> str | None:
    """fp32 inputs: "tf32x3" (three TF32 tensor-core products, about fp32's accuracy), not plain TF32
    (1e-3) nor "ieee" (FMA loops that spill 30-80 KB per thread at head dim 128 on sm_90a:
    benchmarks/compile_kernels.py); others: the default."""
    return "tf32x3" if t.dtype == torch.float32 else None


def _dims(q: torch.Tensor, v: torch.Tensor) -> dict[str, int]:
    return {"BLOCK_A": max(16, triton.next_power_of_2(q.shape[2])), "BLOCK_V": max(16, triton.next_power_of_2(v.shape[2]))}


def _bias_args(seq_offsets: torch.Tensor, pos_w: torch.Tensor | None, time_w: torch.Tensor | None,
               query_time: torch.Tensor | None, key_time: torch.Tensor | None) -> tuple[list, list, dict]:
    """The kernels' bias pointers (``seq_offsets`` stands in for an absent one), sizes and flags."""
    tensors = [t.contiguous() if t is not None else seq_offsets for t in (pos_w, time_w, query_time, key_time)]
    sizes = [pos_w.numel() if pos_w is not None else 1, time_w.numel() if time_w is not None else 1]
    flags = {"HAS_POS": pos_w is not None, "HAS_TIME": time_w is not None, "SUB_BITS": TIME_BUCKET_SUB_BITS}
    return tensors, sizes, flags


class _HSTUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, max_attn_len,
                pos_w, time_w, query_time, key_time):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        total, heads, _ = q.shape
        out = _output_like(v)
        batch = seq_offsets.numel() - 1
        work = _work_lists(seq_offsets, total) if total and batch else None
        if work is not None:
            targets = num_targets if num_targets is not None else seq_offsets
            bias, sizes, flags = _bias_args(seq_offsets, pos_w, time_w, query_time, key_time)
            _launch(
                _FWD, "BLOCK_M", total, batch, heads,
                q, k, v, out, seq_offsets, work, work.shape[1], targets, *bias,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                float(alpha), 1.0 / max_seq_len, int(max_attn_len), heads, q.shape[2], v.shape[2], *sizes, **flags,
                HAS_TARGETS=num_targets is not None, N_BUCKET=triton.next_power_of_2(max_seq_len), **_dims(q, v),
                PRECISION=_precision(q),
            )
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets, pos_w, time_w, query_time, key_time, work)
        ctx.args = (max_seq_len, alpha, max_attn_len)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, seq_offsets, num_targets, pos_w, time_w, query_time, key_time, work = ctx.saved_tensors
        max_seq_len, alpha, max_attn_len = ctx.args
        d_out = d_out.contiguous()
        dq, dk, dv = _output_like(q), _output_like(k), _output_like(v)  # every token row is written
        d_pos = torch.zeros(pos_w.shape, dtype=torch.float32, device=q.device) if pos_w is not None else None
        d_time = torch.zeros(time_w.shape, dtype=torch.float32, device=q.device) if time_w is not None else None
        total, heads, _ = q.shape
        batch = seq_offsets.numel() - 1
        if total and batch:
            targets = num_targets if num_targets is not None else seq_offsets
            bias, sizes, flags = _bias_args(seq_offsets, pos_w, time_w, query_time, key_time)
            common = (
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                d_out.stride(0), d_out.stride(1), float(alpha), 1.0 / max_seq_len, int(max_attn_len),
                heads, q.shape[2], v.shape[2], *sizes,
            )
            meta = dict(HAS_TARGETS=num_targets is not None, N_BUCKET=triton.next_power_of_2(max_seq_len),
                        PRECISION=_precision(q), **_dims(q, v), **flags)
            _launch(_DKDV, "BLOCK_N", total, batch, heads, q, k, v, d_out, dk, dv, seq_offsets, work, work.shape[1], targets,
                    *bias, *common, **meta)
            # An absent table's gradient gets scratch, never an input: the autotuner zeroes these buffers.
            grads = [d if d is not None else torch.zeros(1, dtype=torch.float32, device=q.device) for d in (d_pos, d_time)]
            _launch(_DQ, "BLOCK_M", total, batch, heads, q, k, v, d_out, dq, seq_offsets, work, work.shape[1], targets,
                    *bias, *grads, *common, **meta)
        d_pos = d_pos.to(pos_w.dtype) if d_pos is not None else None
        d_time = d_time.to(time_w.dtype) if d_time is not None else None
        return dq, dk, dv, None, None, None, None, None, d_pos, d_time, None, None


def triton_hstu_attention(
    q_THA: torch.Tensor,
    k_THA: torch.Tensor,
    v_THV: torch.Tensor,
    seq_offsets_B1: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets_B: torch.Tensor | None = None,
    max_attn_len: int = 0,
    bias: RelativeBias | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention with Triton kernels; sequences must not exceed ``max_seq_len``."""
    if not (q_THA.is_cuda or _INTERPRET):
        raise RuntimeError("the triton HSTU attention needs CUDA tensors (or TRITON_INTERPRET=1 for tests)")
    bias = bias or RelativeBias()
    return _HSTUAttention.apply(
        q_THA, k_THA, v_THV, seq_offsets_B1, max_seq_len, alpha, num_targets_B, max_attn_len,
        bias.pos_weight_P, bias.time_weight_K, bias.query_time_T, bias.key_time_T,
    )
