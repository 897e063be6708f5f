"""The SM-free backend's all-to-all on CPU (shared memory between the host's ranks) beside gloo's, on the same inputs.

``--ranks`` processes (spawn) on this host; each call is ``dist.all_to_all_single`` of ``size`` bytes per rank
(float32, equal splits), on the default gloo group and on a ``freescale_sm_free`` group
(``freescale.kernels.sm_free_backend``), interleaved call by call so the machine's drift hits both alike.  Per
size: the median seconds of a call over ``--iters`` calls (after warm-up), both backends' GB/s (bytes each rank
sends and receives to and from its peers, over the call's time) and the ratio gloo / SM-free.  Every output is
checked equal to gloo's.  Besides: the same exchange while the main thread computes (a matmul loop): how long the
compute took beside each backend's exchange, over the compute alone.

    python benchmarks/bench_sm_free_backend.py [--quick] [--ranks 2] [--json benchmarks/results/sm_free_backend_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from common import write_json

from freescale.tables import print_table


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _compute(seconds_of_work: int) -> float:
    """A matmul loop (the victim); its seconds."""
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(seconds_of_work):
        a = torch.tanh(a @ a / 256)
    return time.perf_counter() - start


def _rank(rank: int, world: int, port: int, sizes: list[int], iters: int, out: str) -> None:
    import torch.distributed as dist

    from freescale.kernels import sm_free_backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        groups = {"gloo": None, "sm_free": sm_free_backend.new_group()}
        rows = []
        for size in sizes:
            data = torch.randn(size // 4 // world * world)
            outs = {name: torch.empty_like(data) for name in groups}
            seconds: dict[str, list[float]] = {name: [] for name in groups}
            for i in range(iters + 2):
                for name, group in groups.items():
                    dist.barrier()
                    start = time.perf_counter()
                    dist.all_to_all_single(outs[name], data, group=group)
                    if i >= 2:
                        seconds[name].append(time.perf_counter() - start)
            assert torch.equal(outs["gloo"], outs["sm_free"]), f"size {size}: the outputs differ"
            moved = 2 * data.numel() * 4 * (world - 1) / world  # sent to and received from peers
            row: dict[str, Any] = {"bytes_per_rank": data.numel() * 4}
            for name in groups:
                row[f"{name}_ms"] = 1e3 * statistics.median(seconds[name])
                row[f"{name}_gbps"] = moved / statistics.median(seconds[name]) / 1e9
            row["gloo_over_sm_free"] = row["gloo_ms"] / row["sm_free_ms"]
            rows.append(row)
        # Beside compute: the largest exchange issued async while this thread computes.
        data = torch.randn(sizes[-1] // 4 // world * world)
        work = 60
        alone = []
        beside: dict[str, list[float]] = {name: [] for name in groups}
        for _ in range(max(3, iters // 2)):
            dist.barrier()
            alone.append(_compute(work))
            for name, group in groups.items():
                dist.barrier()
                handle = dist.all_to_all_single(torch.empty_like(data), data, group=group, async_op=True)
                beside[name].append(_compute(work))
                handle.wait()
        victim = {"compute_alone_ms": 1e3 * statistics.median(alone),
                  **{f"compute_beside_{n}_x": statistics.median(v) / statistics.median(alone) for n, v in beside.items()}}
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "victim": victim}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 sizes, 5 calls each (< 60 s)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=0, help="timed calls per size and backend (default 15; 5 quick)")
    parser.add_argument("--json")
    args = parser.parse_args()
    sizes = [1 << 16, 1 << 20, 16 << 20] if args.quick else [1 << 14, 1 << 16, 1 << 18, 1 << 20, 4 << 20, 16 << 20,
                                                              64 << 20]
    iters = args.iters or (5 if args.quick else 15)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.start_processes(_rank, args=(args.ranks, _free_port(), sizes, iters, out), nprocs=args.ranks,
                           start_method="spawn", join=True)
        result = json.loads(Path(out).read_text())
    print(f"all_to_all_single on {args.ranks} ranks of this host, float32, equal splits; medians of {iters} calls")
    print_table(result["rows"], ["bytes_per_rank", "gloo_ms", "sm_free_ms", "gloo_gbps", "sm_free_gbps",
                                 "gloo_over_sm_free"])
    victim = result["victim"]
    print(f"a matmul loop of {victim['compute_alone_ms']:.1f} ms alone: "
          f"{victim['compute_beside_gloo_x']:.2f}x beside gloo's exchange of {sizes[-1] >> 20} MiB, "
          f"{victim['compute_beside_sm_free_x']:.2f}x beside the SM-free backend's")
    if args.json:
        write_json(args.json, "bench_sm_free_backend", {"quick": args.quick, "ranks": args.ranks, "iters": iters,
                                                         "sizes": sizes}, [*result["rows"], {"victim": victim}])


if __name__ == "__main__":
    main()
