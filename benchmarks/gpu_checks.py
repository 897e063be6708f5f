"""The Triton kernels against a float64 reference on the GPU, at the shapes the models use.

The unit tests (tests/test_triton_attention.py, tests/test_layer_norm_mul.py) check the
arithmetic at small sizes, interpreted on CPU and compiled on a GPU.  This script checks the
compiled kernels where the compiler's choices matter: head dims 32 / 64 / 128 (the autotuner's
tiles, ``tl.dot`` layouts), fp32 / bf16 / fp16, sequences up to 1,024 tokens with lengths 0 and 1
in the batch, with and without the relative position + time bias, targets and an attention window.

Per case: ``|got - ref| / |ref|`` (Frobenius) for the output and every gradient, against the
float64 torch reference on upcast copies of the same inputs; a NaN (an output element never
written: outputs are poisoned) fails.  Bands: fp32 (tf32x3 dots) 1e-5, bf16 / fp16 2e-2; a missing gradient fails.

    python benchmarks/gpu_checks.py [--shard I/N] [--json PATH]

``--shard`` runs every N-th case from the I-th, so that several processes compile in parallel
(``gpu_all.py`` does this).  Needs CUDA; without it, says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("FREESCALE_POISON_KERNEL_OUTPUTS", "1")  # before the kernels import

import torch
from common import write_json

from freescale.kernels import tile_table
from freescale.tables import print_table

DEVICE = "cuda"
LENGTHS = [0, 1, 2, 17, 300, 1024, 64, 511]
"""One batch: empty and one-token sequences beside long ones; the longest is the normaliser."""
NORM_ROWS = 4099
"""Not a multiple of any row block."""
BANDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPES = tile_table.DTYPES


def attention_cases() -> list[dict[str, Any]]:
    """Every dtype x head dim plain; the bias / targets / window variants at head dim 64."""
    plain = [{"op": "hstu_attention", "dtype": d, "dim": n, "variant": "plain"}
             for d, n in itertools.product(DTYPES, (32, 64, 128))]
    extra = [{"op": "hstu_attention", "dtype": d, "dim": 64, "variant": v}
             for d, v in itertools.product(("fp32", "bf16"), ("bias", "targets_window"))]
    return plain + extra


def norm_cases() -> list[dict[str, Any]]:
    return [{"op": "layer_norm_mul", "dtype": d, "dim": w, "variant": "plain"}
            for d, w in itertools.product(("fp32", "bf16"), (256, 1024))]


def _relative_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return float("nan")
    if torch.isnan(got).any():
        return float("inf")  # an unwritten (poisoned) element
    denominator = float(want.double().norm()) or 1.0
    return float((got.double() - want.double()).norm()) / denominator


def _attention_inputs(case: dict[str, Any], seed: int) -> dict[str, Any]:
    from freescale.kernels.hstu_attention import RelativeBias

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, dim, lengths = 2, case["dim"], LENGTHS
    max_len = max(lengths)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], device=DEVICE)
    total = int(offsets[-1])
    dtype = DTYPES[case["dtype"]]
    q, k, v, grad = (torch.randn(total, heads, dim, device=DEVICE, generator=g).to(dtype) for _ in range(4))
    targets = window = None
    if case["variant"] == "targets_window":
        targets, window = torch.tensor([min(3, n) for n in lengths], device=DEVICE), 100
    tables: list[torch.Tensor] = []
    times: list[torch.Tensor] = []
    if case["variant"] == "bias":
        tables = [0.1 * torch.randn(max_len, device=DEVICE, generator=g), 0.1 * torch.randn(128, device=DEVICE, generator=g)]
        stamps = torch.cumsum(torch.randint(0, 100_000, (total,), device=DEVICE, generator=g), 0)
        times = [stamps, stamps]
    return {"q": q, "k": k, "v": v, "grad": grad, "offsets": offsets, "max_len": max_len, "targets": targets,
            "window": window or 0, "tables": tables, "times": times, "bias_type": RelativeBias}


def check_attention(case: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    from freescale.kernels.hstu_attention import reference_hstu_attention
    from freescale.kernels.triton_hstu_attention import triton_hstu_attention

    x = _attention_inputs(case, seed)
    results: dict[str, list[torch.Tensor | None]] = {}
    impls: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]] = [
        ("triton", lambda t: t, triton_hstu_attention), ("reference", lambda t: t.double(), reference_hstu_attention)]
    for name, upcast, fn in impls:
        leaves = [upcast(x[n]).clone().requires_grad_() for n in ("q", "k", "v")]
        tables = [t.clone().double().requires_grad_() if name == "reference" else t.clone().requires_grad_()
                  for t in x["tables"]]
        bias = x["bias_type"](*tables, *x["times"]) if tables else None
        out = fn(*leaves, x["offsets"], x["max_len"], 0.3, x["targets"], x["window"], bias)
        out.backward(upcast(x["grad"]))
        results[name] = [out.detach(), *(t.grad for t in leaves + tables)]
    names = ["out", "dq", "dk", "dv"] + (["d_pos", "d_time"] if x["tables"] else [])
    return {n: _relative_error(got, want) for n, got, want in zip(names, results["triton"], results["reference"])}


def check_norm(case: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    from freescale.kernels.norm_mul import reference_layer_norm_mul
    from freescale.kernels.triton_layer_norm_mul import triton_layer_norm_mul

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dtype, width, rows = DTYPES[case["dtype"]], case["dim"], NORM_ROWS
    x, u, dy = (torch.randn(rows, width, device=DEVICE, generator=g).to(dtype) for _ in range(3))
    w, b = (1 + 0.1 * torch.randn(width, device=DEVICE, generator=g)).to(dtype), torch.randn(width, device=DEVICE, generator=g).to(dtype)
    results: dict[str, list[torch.Tensor | None]] = {}
    impls: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]] = [
        ("triton", lambda t: t, triton_layer_norm_mul), ("reference", lambda t: t.double(), reference_layer_norm_mul)]
    for name, upcast, fn in impls:
        leaves = [upcast(t).clone().requires_grad_() for t in (x, u, w, b)]
        out = fn(*leaves, 1e-5)
        out.backward(upcast(dy))
        results[name] = [out.detach(), *(t.grad for t in leaves)]
    names = ["out", "dx", "du", "dw", "db"]
    return {n: _relative_error(got, want) for n, got, want in zip(names, results["triton"], results["reference"])}


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        errors = check_attention(case) if case["op"] == "hstu_attention" else check_norm(case)
    except Exception as exc:  # noqa: BLE001 - a compiler's refusal is a finding, reported per case
        return {**case, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                "seconds": time.perf_counter() - started}
    worst = max(errors.values(), key=lambda v: float("inf") if v != v else v)  # NaN: a gradient never came
    return {**case, **{f"err_{k}": v for k, v in errors.items()}, "worst_error": worst,
            "band": BANDS[DTYPES[case["dtype"]]], "ok": all(v <= BANDS[DTYPES[case["dtype"]]] for v in errors.values()),
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard", default="0/1", help="I/N: run cases I, I+N, I+2N, ...")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: needs a CUDA GPU (tests/ run the same kernels interpreted on CPU)", file=sys.stderr)
        sys.exit(2)
    index, count = (int(p) for p in args.shard.split("/"))
    cases = (attention_cases() + norm_cases())[index::count]
    rows = [run_case(c) for c in cases]
    print_table(rows, ["op", "dtype", "dim", "variant", "worst_error", "band", "ok", "seconds"])
    if args.json:
        write_json(args.json, "gpu_checks", {"shard": args.shard, "device": torch.cuda.get_device_name(0)}, rows)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
