"""Jagged HSTU attention on the GPU: Triton kernel vs torch reference vs padded SDPA.

For lengths drawn from the ml-20m fit clipped to max_len in {512, 2048, 4096, 8192} (``--tokens``
jagged tokens per batch, fewer where the padded batch would pass 2M tokens),
bf16, heads x dim in {4x64, 8x128}, times forward and forward+backward of:

- triton:    ``triton_hstu_attention`` (jagged, causal, pointwise SiLU);
- reference: the torch reference (bucketed padding), the kernel's ground truth;
- sdpa:      ``scaled_dot_product_attention`` on the batch padded to its
             longest sequence, causal (FlashAttention-style softmax attention:
             the baseline a padded Transformer pays).

TFLOP/s count only the attention FLOPs actually needed: 4 * sum_b L_b(L_b+1)/2
* H * D forward (qk^T and AV, causal, jagged), 2.5x that for forward+backward.
The chip's bf16 dense matmul rate is measured in the same run for the "half of
matmul rate" target.  Targets: triton >= 5x sdpa at max_len 4096;
triton TFLOP/s >= 0.5 x matmul TFLOP/s.

    python benchmarks/bench_kernels.py [--quick] [--json benchmarks/results/kernels_<gpu>.json]

A second table times the fused ``LayerNorm(x) * u`` (``triton_layer_norm_mul``)
against the eager torch pair (``F.layer_norm`` then multiply) over [tokens, D]
rows, D in {256, 1024} (heads x value dim), forward and forward+backward, and
reports effective GB/s over the bytes the fused kernels must move (forward:
read x, u, write y; backward: read x, u, dy, write dx, du).

Needs CUDA; on a machine without it, it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
import torch.nn.functional as F
from common import write_json

from freescale.tables import print_table

from freescale.dataloader.synthetic import sample_lengths
from freescale.kernels.hstu_attention import reference_hstu_attention


PADDED_BUDGET = 1 << 21
"""Most padded tokens per batch: 2M x 8 heads x 128 dims is 4 GiB per bf16 tensor, and SDPA's
forward+backward keeps eight of them (q, k, v, out and their gradients) on an 80 GB card."""


def bench(fn, warmup: int = 3, iters: int = 10) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of ``fn()`` with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def case(max_len: int, heads: int, dim: int, tokens: int, with_reference: bool) -> dict[str, object]:
    from freescale.kernels.triton_hstu_attention import triton_hstu_attention

    rng = np.random.default_rng(max_len)
    lengths: list[int] = []
    # Stop at `tokens` jagged tokens, or before the padded batch (what SDPA pays) would pass PADDED_BUDGET.
    while sum(lengths) < tokens:
        drawn = int(sample_lengths(rng, 1, "ml-20m", max_len)[0])
        if (len(lengths) + 1) * max(lengths + [drawn]) > PADDED_BUDGET:
            break
        lengths.append(drawn)
    lens = torch.tensor(lengths, device="cuda")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.cumsum(lens, 0)
    total = int(offsets[-1])
    make = lambda: torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(), make(), make()
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
    alpha = dim**-0.5
    flops = 4 * float((lens * (lens + 1) / 2).sum()) * heads * dim

    def run_triton(backward: bool) -> None:
        out = triton_hstu_attention(q, k, v, offsets, max_len, alpha)
        if backward:
            out.backward(grad)

    def run_reference(backward: bool) -> None:
        out = reference_hstu_attention(q, k, v, offsets, max_len, alpha)
        if backward:
            out.backward(grad)

    longest = int(lens.max())
    # Random [B, H, longest, D] inputs: SDPA's time depends on the padded shape only.
    padded = lambda: torch.randn(len(lengths), heads, longest, dim, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    qp, kp, vp = (padded().requires_grad_() for _ in range(3))
    gp = torch.randn_like(qp)

    def run_sdpa(backward: bool) -> None:
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
        if backward:
            out.backward(gp)

    row: dict[str, object] = {"max_len": max_len, "heads": heads, "dim": dim, "sequences": len(lengths),
                              "tokens": total, "padded_tokens": len(lengths) * longest}
    for name, fn in (("triton", run_triton), ("sdpa", run_sdpa)) + ((("reference", run_reference),) if with_reference else ()):
        fwd = bench(lambda: fn(False))
        both = bench(lambda: fn(True))
        row[f"{name}_fwd_ms"], row[f"{name}_fwdbwd_ms"] = fwd, both
    row["triton_fwd_tflops"] = flops / (row["triton_fwd_ms"] * 1e-3) / 1e12  # type: ignore[operator]
    row["triton_fwdbwd_tflops"] = 2.5 * flops / (row["triton_fwdbwd_ms"] * 1e-3) / 1e12  # type: ignore[operator]
    row["speedup_vs_sdpa_fwdbwd"] = row["sdpa_fwdbwd_ms"] / row["triton_fwdbwd_ms"]  # type: ignore[operator]
    if with_reference:
        row["speedup_vs_reference_fwdbwd"] = row["reference_fwdbwd_ms"] / row["triton_fwdbwd_ms"]  # type: ignore[operator]
    return row


def norm_case(tokens: int, width: int) -> dict[str, object]:
    from freescale.kernels.norm_mul import reference_layer_norm_mul
    from freescale.kernels.triton_layer_norm_mul import triton_layer_norm_mul

    make = lambda: torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    x, u = make(), make()
    w = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    row: dict[str, object] = {"tokens": tokens, "width": width}
    for name, fn in (("fused", triton_layer_norm_mul), ("torch", reference_layer_norm_mul)):
        row[f"{name}_fwd_ms"] = bench(lambda: fn(x, u, w, b, 1e-5))
        row[f"{name}_fwdbwd_ms"] = bench(lambda: fn(x, u, w, b, 1e-5).backward(dy))
    element = 2  # bf16
    fwd_bytes, bwd_bytes = 3 * tokens * width * element, 5 * tokens * width * element
    row["fused_fwd_GBps"] = fwd_bytes / (row["fused_fwd_ms"] * 1e-3) / 1e9  # type: ignore[operator]
    row["fused_fwdbwd_GBps"] = (fwd_bytes + bwd_bytes) / (row["fused_fwdbwd_ms"] * 1e-3) / 1e9  # type: ignore[operator]
    row["speedup_fwdbwd"] = row["torch_fwdbwd_ms"] / row["fused_fwdbwd_ms"]  # type: ignore[operator]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, max_len 1024 and 4096")
    parser.add_argument("--tokens", type=int, default=262_144, help="jagged tokens per batch")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (the Triton kernels are only interpreted on CPU, in tests)",
              file=sys.stderr)
        sys.exit(2)
    rows, peak = measure(args.quick, args.tokens)
    chosen = autotuned()
    print(f"autotuner's choices: {chosen}")
    if args.json:
        write_json(args.json, "bench_kernels", {"quick": args.quick, "tokens": args.tokens, "dtype": "bf16",
                                                "matmul_tflops": peak, "autotuned": chosen}, rows)


def autotuned() -> dict[str, dict[str, str]]:
    """Per attention kernel, the config the autotuner picked for each key (N bucket, head dims, dtypes)."""
    import importlib

    module = importlib.import_module("freescale.kernels.triton_hstu_attention")
    return {name: {str(key): str(config) for key, config in getattr(kernel, "cache", {}).items()}
            for name, kernel in (("forward", module._FWD), ("backward_dkdv", module._DKDV), ("backward_dq", module._DQ))}


def measure(quick: bool, tokens: int) -> tuple[list[dict[str, object]], float]:
    """Both tables, printed; returns their rows (``op`` names the table) and the matmul rate."""
    peak = matmul_tflops()
    shapes = [(4, 64)] if quick else [(4, 64), (8, 128)]
    lens = (512, 4096) if quick else (512, 2048, 4096, 8192)
    rows = [case(m, h, d, tokens, with_reference=m <= 2048) for m in lens for h, d in shapes]
    for r in rows:
        r["fraction_of_matmul_rate"] = r["triton_fwdbwd_tflops"] / peak  # type: ignore[operator]
        r["op"] = "hstu_attention"
    print(f"bf16 matmul 8192^3: {peak:.1f} TFLOP/s on {torch.cuda.get_device_name(0)}")
    print_table(rows, ["max_len", "heads", "dim", "tokens", "padded_tokens", "triton_fwd_ms", "triton_fwdbwd_ms",
                       "sdpa_fwdbwd_ms", "speedup_vs_sdpa_fwdbwd", "triton_fwdbwd_tflops", "fraction_of_matmul_rate"])
    norm_rows = [norm_case(tokens, width) for width in (256, 1024)]
    for r in norm_rows:
        r["op"] = "layer_norm_mul"
    print_table(norm_rows, ["tokens", "width", "fused_fwd_ms", "torch_fwd_ms", "fused_fwdbwd_ms", "torch_fwdbwd_ms",
                            "speedup_fwdbwd", "fused_fwdbwd_GBps"])
    return rows + norm_rows, peak


if __name__ == "__main__":
    main()
