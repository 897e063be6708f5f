"""What the union update costs as replica groups grow: one TBE, the union of R groups' lookups.

Under fault tolerance every group applies every group's embedding gradients (``ft/sparse_sync.py``):
per step each rank all-gathers R groups' ids and output gradients at its position, runs fbgemm's
TBE forward over the union of them (while the vote is in flight) and its fused row-wise Adagrad
backward (the update).  A job without fault tolerance runs the forward and backward over its own
lookups only.  This times both on one fbgemm TBE (CPU, one thread), for R = 1 .. ``--groups``:
``own``: one group's forward + backward (what the step pays anyway); ``union``: the forward +
backward over R groups' lookups (different ids per group, Zipf-distributed over the rows, as
recommendation ids are); ``extra``: union - own, the update's added compute per step; and the
bytes each rank receives in the all-gather, ``(R - 1) x (ids x 8 + bags x dim x 4)`` (pooled
tables; int64 ids, fp32 gradients), from which ``--link-gbps`` gives the time on a network.
Medians of ``--repeats`` interleaved repeats.  The model beside it: ``extra(R) = slope x (R - 1)``
fitted to the measured R > 1 (the work scales with the union's ids), printed for R up to 64.

    python benchmarks/bench_union_update.py [--quick] [--groups 1,2,3,4,8,12] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from common import write_json

from freescale.tables import print_table


def make_tbe(rows: int, dim: int) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen([(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                 optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01)


def lookups(groups: int, bags: int, per_bag: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups`` groups' lookups in one batch (bags of ``per_bag`` Zipf ids each, group after group)."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.1, size=groups * bags * per_bag) - 1) % rows
    offsets = torch.arange(0, groups * bags * per_bag + 1, per_bag, dtype=torch.int64)
    return torch.from_numpy(ids.astype(np.int64)), offsets


def fwd_bwd(tbe: Any, ids: torch.Tensor, offsets: torch.Tensor, dim: int) -> float:
    start = time.perf_counter()
    out = tbe(ids, offsets)
    out.backward(torch.ones(out.shape[0], dim) * 1e-3)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="1,2,3,4,8,12")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--bags", type=int, default=4096, help="bags (samples x features) per group per step")
    parser.add_argument("--per-bag", type=int, default=20, help="ids per bag")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link-gbps", type=float, default=50.0, help="bytes/s of the cross-group link, in GB/s")
    parser.add_argument("--quick", action="store_true", help="100k rows, 1,024 bags, 3 repeats")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.bags, args.repeats = 100_000, 1024, 3
    torch.set_num_threads(1)
    groups = [int(g) for g in args.groups.split(",")]
    tbe = make_tbe(args.rows, args.dim)
    fwd_bwd(tbe, *lookups(1, 64, args.per_bag, args.rows, 0), args.dim)  # first-call set-up
    times: dict[int, list[float]] = {g: [] for g in groups}
    for r in range(args.repeats):
        for g in groups:  # interleaved: the machine's drift lands on every R alike
            times[g].append(fwd_bwd(tbe, *lookups(g, args.bags, args.per_bag, args.rows, 100 * r + g), args.dim))
    own = float(np.median(times[1])) if 1 in times else float(np.median(
        [fwd_bwd(tbe, *lookups(1, args.bags, args.per_bag, args.rows, 7), args.dim) for _ in range(args.repeats)]))
    per_group_bytes = args.bags * args.per_bag * 8 + args.bags * args.dim * 4
    rows = []
    for g in groups:
        union = float(np.median(times[g]))
        received = (g - 1) * per_group_bytes
        rows.append({"groups": g, "own_ms": round(own * 1e3, 2), "union_ms": round(union * 1e3, 2),
                     "spread_ms": f"{min(times[g]) * 1e3:.1f}..{max(times[g]) * 1e3:.1f}",
                     "extra_ms": round((union - own) * 1e3, 2), "union_vs_own": round(union / own, 2),
                     "received_MB": round(received / 1e6, 2),
                     "link_ms": round(received / (args.link_gbps * 1e9) * 1e3, 3), "kind": "measured"})
    fit = [(row["groups"] - 1, row["extra_ms"]) for row in rows if row["groups"] > 1]
    if fit:  # least squares through the origin: extra(R) = slope x (R - 1)
        per_extra = sum(x * y for x, y in fit) / sum(x * x for x, _ in fit)
        for g in (16, 32, 64):
            rows.append({"groups": g, "own_ms": round(own * 1e3, 2), "union_ms": round(own * 1e3 + (g - 1) * per_extra, 1),
                         "extra_ms": round((g - 1) * per_extra, 1),
                         "union_vs_own": round((own * 1e3 + (g - 1) * per_extra) / (own * 1e3), 1),
                         "received_MB": round((g - 1) * per_group_bytes / 1e6, 1),
                         "link_ms": round((g - 1) * per_group_bytes / (args.link_gbps * 1e9) * 1e3, 2),
                         "kind": f"modeled: (R-1) x {per_extra:.2f} ms"})
    print_table(rows, ["groups", "kind", "own_ms", "union_ms", "spread_ms", "extra_ms", "union_vs_own",
                       "received_MB", "link_ms"])
    print(f"one TBE: {args.rows:,} rows x {args.dim}, row-wise Adagrad, CPU, 1 thread; {args.bags:,} bags x "
          f"{args.per_bag} Zipf ids per group; link {args.link_gbps} GB/s for the all-gather's bytes")
    if args.json:
        write_json(args.json, "bench_union_update", {k: v for k, v in vars(args).items() if k != "json"}, rows)


if __name__ == "__main__":
    main()
