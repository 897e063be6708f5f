"""The SM-free backend's CUDA transport (``kernels/cuda_ipc_channels.py``) on one GPU: two ranks, both on cuda:0.

**Not yet run on a GPU.**  Two processes (spawn), a gloo default group for the set-up and the barriers, and a
``freescale_sm_free`` group on ``cuda:0`` (CUDA IPC between two processes on one device).  The reference is
computed locally: every rank rebuilds every rank's input from its seed (NCCL refuses two ranks on one device, and
gloo on CUDA tensors would compare against a path through host memory, not a second opinion on the bytes).  Rows:

- ``exact``, per rank and case: ``all_to_all_single`` equal to the reference, bit for bit: even (default) splits,
  uneven with empty chunks, nothing at all, bf16, int64 of 96 MiB per peer (the 32 MiB rings wrap three times),
  a non-contiguous output, all in flight together at two priorities; and an input written on the caller's stream
  just before the call, behind a 20 ms spin (the transfer must not move before the caller's stream gets there);
- ``bandwidth``, 1 / 16 / 64 / 256 MiB per rank (float32, equal splits): median ms of a call (host-observed, its
  ``wait`` returned) and GB/s of the bytes each rank sends its peer, beside a plain ``copy_`` of the same bytes
  within one process (``copy_GBps``);
- ``victim``: a bf16 matmul loop on rank 0's own side stream, alone and beside (a) the backend's exchange of 64 MiB
  issued from the default stream by both ranks until the loop is covered, (b) an SM copy of the same bytes
  (``torch.mul(x, 1)``, an elementwise kernel) on a second stream of rank 0, (c) a ``copy_`` (a
  ``cudaMemcpyAsync``) on that stream: the loop's ms and its slowdown ratio (beside / alone; medians of 3).

    python benchmarks/gpu_sm_free_backend.py [--quick] [--timeout-s 240] [--json PATH]

Exit status: 0 every exchange exact; 1 a mismatch, a rank failed, or the run overran ``--timeout-s`` (the ranks
are killed: a hang cannot eat the GPU window; the group's own timeout is 60 s); 2 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import write_json

WORLD = 2
DEVICE = torch.device("cuda", 0)
Splits = Callable[[int, int], int]
CASES: list[tuple[str, Splits, torch.dtype, int]] = [
    ("even", lambda s, d: 4, torch.float32, 16),
    ("uneven_empty", lambda s, d: (s * 7 + d * 3) % 5, torch.float32, 3),
    ("nothing", lambda s, d: 0, torch.float32, 8),
    ("bf16", lambda s, d: 1000 + 37 * s + d, torch.bfloat16, 64),
    ("int64_96MiB", lambda s, d: (3 << 20) + 1000 * s + 7 * d, torch.int64, 4),
]


def _inputs(rank: int, case: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Rank ``rank``'s input of case ``case`` on cuda:0 and its splits (any rank can make any rank's)."""
    _, splits_of, dtype, width = CASES[case]
    send = [splits_of(rank, d) for d in range(WORLD)]
    recv = [splits_of(s, rank) for s in range(WORLD)]
    g = torch.Generator(device=DEVICE).manual_seed(1000 * rank + case)
    data = torch.randint(-1000, 1000, (sum(send), width), generator=g, device=DEVICE).to(dtype)
    return data, send, recv


def _expected(rank: int, case: int) -> torch.Tensor:
    parts = []
    for src in range(WORLD):
        data, send, _ = _inputs(src, case)
        parts.append(data[sum(send[:rank]):sum(send[:rank + 1])])
    return torch.cat(parts)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.equal(got.contiguous().view(torch.uint8),
                                                        want.contiguous().view(torch.uint8)))


def _exact(rank: int, group: dist.ProcessGroup) -> list[dict[str, Any]]:
    """Every case in flight at once (the first two at priority 1), a non-contiguous output, a late input."""
    from freescale.kernels.sm_free_backend import priority

    cases = [_inputs(rank, c) for c in range(len(CASES))]
    outs = [torch.full((sum(recv), data.shape[1]), -7, device=DEVICE).to(data.dtype) for data, _, recv in cases]
    works = []
    for c, (out, (data, send, recv)) in enumerate(zip(outs, cases)):
        with priority(1 if c < 2 else 0):
            works.append(dist.all_to_all_single(out, data, recv, send, group=group, async_op=True))
    data, send, recv = cases[1]
    strided = torch.empty(data.shape[1], sum(recv), device=DEVICE).t()
    works.append(dist.all_to_all_single(strided, data, recv, send, group=group, async_op=True))
    for work in works:
        work.wait()
    rows = [{"check": "exact", "rank": rank, "case": name, "ok": _same(out, _expected(rank, c))}
            for c, ((name, *_), out) in enumerate(zip(CASES, outs))]
    default = torch.empty_like(cases[0][0])  # even, no split sizes given: equal parts
    dist.all_to_all_single(default, cases[0][0], group=group)
    rows.append({"check": "exact", "rank": rank, "case": "even_default_splits", "ok": _same(default, _expected(rank, 0))})
    rows.append({"check": "exact", "rank": rank, "case": "non_contiguous_output",
                 "ok": not strided.is_contiguous() and _same(strided, _expected(rank, 1))})
    data, send, recv = cases[3]
    late = torch.zeros_like(data)
    torch.cuda._sleep(40_000_000)  # ~20 ms of spinning on the caller's stream, then the input is written
    late.copy_(data)
    out = torch.empty(sum(recv), data.shape[1], device=DEVICE, dtype=data.dtype)
    dist.all_to_all_single(out, late, recv, send, group=group)
    rows.append({"check": "exact", "rank": rank, "case": "input_written_just_before", "ok": _same(out, _expected(rank, 3))})
    return rows


def _timed_call(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls after one warm-up, each started together on both ranks."""
    seconds = []
    for i in range(iters + 1):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _bandwidth(rank: int, group: dist.ProcessGroup, sizes: list[int], iters: int) -> list[dict[str, Any]]:
    rows = []
    for mib in sizes:
        data = torch.randn(mib << 18, device=DEVICE)  # float32: ``mib`` MiB
        out, copy = torch.empty_like(data), torch.empty_like(data)
        exchange = _timed_call(partial(dist.all_to_all_single, out, data, group=group), iters)
        local = _timed_call(partial(copy.copy_, data), iters)
        to_peer = data.numel() * 4 * (WORLD - 1) / WORLD
        rows.append({"check": "bandwidth", "rank": rank, "mib": mib, "sm_free_ms": 1e3 * exchange,
                     "sm_free_GBps": to_peer / exchange / 1e9, "copy_ms": 1e3 * local,
                     "copy_GBps": data.numel() * 4 / local / 1e9})
    return rows


def _nothing() -> None:
    pass


def _victim_run(victim: Callable[[], None], side: Callable[[], object] | None, repeats: int,
                stream: torch.cuda.Stream) -> float:
    """The victim's ms on ``stream`` with ``repeats`` calls of ``side`` issued on this thread meanwhile."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        victim()
        end.record(stream)
    for _ in range(repeats if side is not None else 0):
        assert side is not None
        side()
    end.synchronize()
    return float(start.elapsed_time(end))


def _victim(rank: int, group: dist.ProcessGroup, quick: bool) -> list[dict[str, Any]]:
    """Rank 0's matmul loop alone and beside each transfer (module docstring); rank 1 joins the exchanges."""
    n, reps = (4096, 50) if quick else (8192, 20)
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    data = torch.randn(64 << 18, device=DEVICE)
    out, dst = torch.empty_like(data), torch.empty_like(data)
    compute, side = torch.cuda.Stream(), torch.cuda.Stream()

    def victim() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=c)

    def on_side(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            with torch.cuda.stream(side):
                fn()
        return call

    transfers: dict[str, Callable[[], object]] = {
        "sm_free_exchange": lambda: dist.all_to_all_single(out, data, group=group),  # (from the default stream)
        "sm_copy": on_side(lambda: torch.mul(data, 1, out=dst)),
        "ce_copy": on_side(lambda: dst.copy_(data))}
    alone = [_victim_run(victim, None, 0, compute) for _ in range(4)][1:] if rank == 0 else [0.0]
    # One transfer's seconds (both ranks call ``_timed_call`` alike: its barriers; rank 1 joins only the exchange).
    once = {name: _timed_call(fn if name == "sm_free_exchange" or rank == 0 else _nothing, 3)
            for name, fn in transfers.items()}
    rows = [{"check": "victim", "beside": "alone", "victim_ms": statistics.median(alone), "slowdown": 1.0}]
    for name, fn in transfers.items():
        repeats = torch.tensor([math.ceil(1.5 * statistics.median(alone) / max(1e3 * once[name], 1e-3)) + 1])
        dist.broadcast(repeats, src=0)  # (the exchange is collective: both ranks issue it as often)
        count = min(int(repeats), 500)
        times = []
        for _ in range(3):
            dist.barrier()
            if rank == 0:
                times.append(_victim_run(victim, fn, count, compute))
            elif name == "sm_free_exchange":
                for _ in range(count):
                    fn()
        if rank == 0:
            beside = statistics.median(times)
            rows.append({"check": "victim", "beside": name, "victim_ms": beside,
                         "slowdown": beside / statistics.median(alone), "transfers": count,
                         "transfer_ms": 1e3 * once[name]})
    return rows if rank == 0 else []


def _rank(rank: int, port: int, quick: bool, out: str) -> None:
    """One rank: the checks, its rows to ``out``; ends with ``os._exit`` (no teardown of the IPC mappings under a
    peer still using them)."""
    try:
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        from freescale.kernels import sm_free_backend

        group = sm_free_backend.new_group(DEVICE)
        rows = _exact(rank, group)
        print(f"rank {rank}: exact {all(r['ok'] for r in rows)}", flush=True)
        sizes = [1, 16, 64] if quick else [1, 16, 64, 256]
        rows += _bandwidth(rank, group, sizes, 3 if quick else 5)
        rows += _victim(rank, group, quick)
        dist.barrier()
        Path(out).write_text(json.dumps({"rows": rows}))
        code = 0
    except BaseException as exc:  # (one line for the report; the traceback to the log)
        traceback.print_exc()
        Path(out).write_text(json.dumps({"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(quick: bool, timeout_s: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Both ranks; their rows and what went wrong (one line each)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank{r}.json") for r in range(WORLD)]
        procs = [ctx.Process(target=_rank, args=(r, port, quick, outs[r])) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        problems = [f"rank {r} overran {timeout_s:g} s (killed)" for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        rows: list[dict[str, Any]] = []
        for r, path in enumerate(outs):
            result: dict[str, Any] = json.loads(Path(path).read_text()) if Path(path).exists() else {"error": "no result"}
            rows += result.get("rows", [])
            if "error" in result and not any(line.startswith(f"rank {r} ") for line in problems):
                problems.append(f"rank {r}: {result['error']}")
    problems += [f"rank {r['rank']}: {r['case']} differs from the reference" for r in rows
                 if r["check"] == "exact" and not r["ok"]]
    return rows, problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes to 64 MiB, a 4096^3 victim")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="both ranks together (default 240)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sm_free_backend: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    from freescale.tables import print_table

    started = time.monotonic()
    rows, problems = run(args.quick, args.timeout_s)
    for check, columns in (("exact", ["rank", "case", "ok"]),
                           ("bandwidth", ["rank", "mib", "sm_free_ms", "sm_free_GBps", "copy_ms", "copy_GBps"]),
                           ("victim", ["beside", "victim_ms", "slowdown", "transfers", "transfer_ms"])):
        print_table([r for r in rows if r["check"] == check], columns)
    for line in problems:
        print(f"gpu_sm_free_backend: {line}")
    if args.json:
        write_json(args.json, "gpu_sm_free_backend", {"quick": args.quick, "world": WORLD, "device": "cuda:0",
                                                      "seconds": round(time.monotonic() - started, 1),
                                                      "problems": problems}, rows)
    sys.exit(1 if problems or not rows else 0)


if __name__ == "__main__":
    main()
