"""SM-free communication: how much a transfer beside it slows a compute kernel.

A victim kernel runs on one CUDA stream, alone and then while a transfer runs
on a second stream, for each transfer kind:

- ``sm_copy_<n>cta``: a Triton copy kernel on n CTAs (n = 8, 16, 32, 64): what an
  SM-based collective (NCCL's kernels) costs the compute beside it;
- ``ce_h2d``: ``cudaMemcpyAsync`` host-to-device from pinned memory (copy engine);
- ``ce_d2d``: ``cudaMemcpyAsync`` device-to-device (copy engine; with two GPUs,
  to the peer GPU: the path ``freescale.kernels.copy_engine`` uses).

Victims: a bf16 GEMM 8192^3 (compute-bound), a bf16 GEMM shaped to one wave
of 128x128 output tiles (exactly one tile per SM: any SM taken by the
transfer delays the whole wave), and a memory-bound elementwise kernel.

Per (victim, transfer), medians of CUDA-event timings: victim time alone and
beside the transfer, slowdown = beside / alone - 1; the transfer's GB/s alone
and while overlapped; overlap efficiency = (victim alone + transfers alone -
wall time of both together) / the shorter of the two, i.e. the fraction of the
shorter operation hidden (1.0 = perfect overlap, 0 = serialised).  Target (issue 5): slowdown <= 2% for the compute-bound
victims with copy-engine transfers, next to whatever the SM copy costs here.

    python benchmarks/bench_sm_free.py [--quick] [--json benchmarks/results/sm_free_<gpu>.json]

Needs CUDA; without it, says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np
import torch
from common import write_json

from freescale.tables import print_table


def _sm_copy_kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton's types
        pid, programs = tl.program_id(0), tl.num_programs(0)
        for start in range(pid * BLOCK, n, programs * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy


def timed(stream: torch.cuda.Stream, fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of ``fn`` on ``stream`` (CUDA events)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def victims(quick: bool) -> dict[str, Callable[[], object]]:
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    # One wave: a grid of tiles_m x tiles_n = sms output tiles of 128 x 128.
    tiles_m = max(1, int(sms**0.5))
    while sms % tiles_m:
        tiles_m -= 1
    wa = torch.randn(128 * tiles_m, 8192, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(8192, 128 * (sms // tiles_m), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256 << 20, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    y = torch.empty_like(x)
    return {
        f"gemm_{n}^3": lambda: torch.mm(a, b),
        f"gemm_one_wave_{sms}tiles": lambda: torch.mm(wa, wb),
        "memory_bound_512MiB": lambda: torch.mul(x, 1.0001, out=y),
    }


def transfers(quick: bool) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (launch one transfer, bytes moved)."""
    size = (256 if quick else 1024) << 20
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    peer = torch.empty(size, dtype=torch.uint8, device="cuda:1") if torch.cuda.device_count() > 1 else dst
    copy = _sm_copy_kernel()
    out: dict[str, tuple[Callable[[], object], int]] = {}
    def sm_copy(ctas: int) -> Callable[[], object]:
        return lambda: copy[(ctas,)](src, dst, size, BLOCK=4096)

    for ctas in (8, 16, 32, 64):
        out[f"sm_copy_{ctas}cta"] = (sm_copy(ctas), size)
    out["ce_h2d"] = (lambda: dst.copy_(host, non_blocking=True), size)
    out["ce_d2d" + ("_peer" if peer is not dst else "")] = (lambda: peer.copy_(src, non_blocking=True), size)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller GEMM and transfers, fewer iterations")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_sm_free: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    rows, iters = measure(args.quick)
    if args.json:
        write_json(args.json, "bench_sm_free", {"quick": args.quick, "iters": iters,
                                                "gpus": torch.cuda.device_count()}, rows)


def measure(quick: bool) -> tuple[list[dict[str, object]], int]:
    """Every (victim, transfer) pair, printed; returns the rows and the iterations per median."""
    iters = 5 if quick else 20
    compute, side = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
    vs, ts = victims(quick), transfers(quick)
    for fn in list(vs.values()) + [f for f, _ in ts.values()]:  # warm-up, compile the Triton copy
        fn()
    torch.cuda.synchronize()
    rows = []
    for t_name, (t_fn, t_bytes) in ts.items():
        t_alone = timed(side, t_fn, iters)
        for v_name, v_fn in vs.items():
            v_alone = timed(compute, v_fn, iters)
            repeats = max(1, int(np.ceil(v_alone / max(t_alone, 1e-3))) + 1)  # transfer covers the victim

            victim_ms, side_ms, wall_ms = [], [], []
            for _ in range(iters):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                torch.cuda.synchronize()
                ev[0].record(compute)
                side.wait_event(ev[0])
                with torch.cuda.stream(side):
                    for _ in range(repeats):
                        t_fn()
                    ev[1].record(side)
                with torch.cuda.stream(compute):
                    v_fn()
                    ev[2].record(compute)
                    compute.wait_event(ev[1])
                    ev[3].record(compute)
                ev[3].synchronize()
                victim_ms.append(ev[0].elapsed_time(ev[2]))
                side_ms.append(ev[0].elapsed_time(ev[1]))
                wall_ms.append(ev[0].elapsed_time(ev[3]))
            beside, side_t, wall = (float(np.median(x)) for x in (victim_ms, side_ms, wall_ms))
            transfers_alone = repeats * t_alone
            rows.append({
                "victim": v_name, "transfer": t_name, "victim_alone_ms": v_alone, "victim_beside_ms": beside,
                "slowdown": beside / v_alone - 1, "transfer_alone_ms": t_alone,
                "transfer_GBps_alone": t_bytes / (t_alone * 1e-3) / 1e9,
                "transfer_GBps_overlapped": repeats * t_bytes / (side_t * 1e-3) / 1e9,
                "overlap_efficiency": (v_alone + transfers_alone - wall) / min(v_alone, transfers_alone),
            })
            torch.cuda.synchronize()
    print(f"device: {torch.cuda.get_device_name(0)}")
    print_table(rows, ["victim", "transfer", "victim_alone_ms", "victim_beside_ms", "slowdown",
                       "transfer_GBps_alone", "transfer_GBps_overlapped", "overlap_efficiency"])
    return rows, iters


if __name__ == "__main__":
    main()
