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

Beside it, the owner-sharded update (docs/fault-tolerance.md: designed, **not built**), its steps timed on
this one process for the rank at quorum position 0, the exchanges counted in bytes: ``convert`` its own step to
unique rows with row-summed gradients; ``merge`` the rows it owns (``id % R == 0``) as every group sends them;
``update`` them with fbgemm's own row-wise Adagrad (one single-id bag per row); ``copy_in`` every row any
group touched (weights and accumulator, what keeps the replicas identical) into its own table.
``owner_vs_own``: 1 + their sum over the group's own forward + backward.  The copy-in grows with the
rows the step touched over all groups (sublinear in R for Zipf ids, not constant): the bytes column says
what a rank receives.

And the cross-group sharded candidate (docs/fault-tolerance.md, not built): each table sharded across the
groups too, a shard held by an owner group and a buddy; the rank at position 0 of group 0 owns ``id % R == 0`` and is
buddy of ``id % R == 1``.  ``cross_vs_own``: its lookups and updates (fbgemm forward + fused backward over
every group's bags restricted to each of its two shards' ids) over the group's own forward + backward,
which they replace; ``cross_received_MB``: the other groups' ids in its shards, their bags' gradients
that reach them, and its own bags' partial sums from the other shards.

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


def row_summed(ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's step as (unique row ids, each row's summed gradient): sum pooling's per-id gradient is
    its bag's, and fbgemm's update sums a row's gradients within a batch anyway."""
    bag_of_id = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff())
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(unique.numel(), grad.shape[1]).index_add_(0, inverse, grad[bag_of_id])
    return unique, summed


def owner_sharded(tbe: Any, groups: int, bags: int, per_bag: int, rows: int, dim: int, seed: int) -> dict[str, float]:
    """The owner-sharded update's work on the rank at quorum position 0 (its compute, on one process; the
    exchanges as bytes): ``convert`` its own step to row-summed unique rows; ``merge`` the rows it owns
    (``id % R == 0``) as every group sends them (their row-summed gradients, summed); ``update`` them with
    fbgemm's own row-wise Adagrad (one single-id bag per row); ``copy_in`` every updated row of the step,
    the weights and the accumulator, into its own table (what keeps the replicas identical).  Returns
    milliseconds per phase and the bytes the rank receives."""
    ids, offsets = lookups(groups, bags, per_bag, rows, seed)
    per_group = bags * per_bag
    grad = torch.ones(groups * bags, dim) * 1e-3
    parts = [row_summed(ids[g * per_group:(g + 1) * per_group],
                        offsets[g * bags:(g + 1) * bags + 1] - g * per_group, grad[g * bags:(g + 1) * bags])
             for g in range(groups)]
    start = time.perf_counter()
    row_summed(ids[:per_group], offsets[:bags + 1], grad[:bags])
    convert = time.perf_counter() - start
    start = time.perf_counter()
    mine = [(u[u % groups == 0], gsum[u % groups == 0]) for u, gsum in parts]
    owned, inverse = torch.unique(torch.cat([u for u, _ in mine]), return_inverse=True)
    merged = torch.zeros(owned.numel(), dim).index_add_(0, inverse, torch.cat([gsum for _, gsum in mine]))
    merge = time.perf_counter() - start
    start = time.perf_counter()
    out = tbe(owned, torch.arange(owned.numel() + 1, dtype=torch.int64))
    out.backward(merged)
    update = time.perf_counter() - start
    touched = torch.unique(torch.cat([u for u, _ in parts]))
    new_rows, new_state = torch.randn(touched.numel(), dim), torch.rand(touched.numel())
    weights, (state,) = tbe.split_embedding_weights()[0], tbe.split_optimizer_states()[0]
    start = time.perf_counter()
    weights.index_copy_(0, touched, new_rows)
    state.index_copy_(0, touched, new_state)
    copy_in = time.perf_counter() - start
    received = (touched.numel() - owned.numel()) * (8 + 4 * (dim + 1)) + sum(
        u.numel() for u, _ in mine[1:]) * (8 + 4 * dim)
    return {"convert_ms": convert * 1e3, "merge_ms": merge * 1e3, "update_ms": update * 1e3,
            "copy_in_ms": copy_in * 1e3, "touched_rows": float(touched.numel()), "received_bytes": float(received)}


def cross_sharded(tbe: Any, groups: int, bags: int, per_bag: int, rows: int, dim: int, seed: int) -> dict[str, float]:
    """The cross-group sharded design (docs/fault-tolerance.md: a candidate, not built) on the rank at
    position 0 of group 0, owner of the rows ``id % R == 0`` and buddy of ``id % R == 1``: fbgemm's forward +
    fused backward over every group's bags restricted to each shard's ids (owner, then buddy), timed on this
    process; and the bytes it receives: the other groups' ids in its shards, the gradient of every other
    group's bag that touches one of them (a pooled bag's gradient goes to each shard its ids touch), and the partial
    pooled outputs of its own bags from the other shards."""
    ids, offsets = lookups(groups, bags, per_bag, rows, seed)
    bag_of = torch.repeat_interleave(torch.arange(groups * bags), offsets.diff())
    seconds, received = 0.0, 0
    for shard in (0, 1):
        keep = ids % groups == shard
        counts = torch.bincount(bag_of[keep], minlength=groups * bags)
        seconds += fwd_bwd(tbe, ids[keep], torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]), dim)
        foreign = counts[bags:] > 0  # bags of the other groups that reach this shard
        received += int(counts[bags:].sum()) * 8 + int(foreign.sum()) * dim * 4
    shards_per_own_bag = [torch.unique(ids[offsets[b]:offsets[b + 1]] % groups) for b in range(bags)]
    received += sum(int((s != 0).sum()) for s in shards_per_own_bag) * dim * 4
    return {"update_ms": seconds * 1e3, "received_bytes": float(received)}


def owner_row(runs: list[dict[str, float]], own: float, link_gbps: float) -> dict[str, Any]:
    """The owner-sharded design's medians beside the union's: its added work per step (all four phases:
    none of it is work a job without fault tolerance does) over the group's own update."""
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    added = med["convert_ms"] + med["merge_ms"] + med["update_ms"] + med["copy_in_ms"]
    return {"owner_ms": round(added, 2), "owner_vs_own": round(1 + added / (own * 1e3), 2),
            **{f"owner_{k}": round(v, 2) for k, v in med.items() if k.endswith("_ms")},
            "owner_rows_touched": int(med["touched_rows"]), "owner_received_MB": round(med["received_bytes"] / 1e6, 2),
            "owner_link_ms": round(med["received_bytes"] / (link_gbps * 1e9) * 1e3, 3)}


def cross_row(runs: list[dict[str, float]] | None, own: float, link_gbps: float) -> dict[str, Any]:
    """The cross-group sharded candidate's medians: its whole lookup + update work (owner and buddy; it
    replaces the group's own) over the group's own, and the bytes a rank receives."""
    if not runs:
        return {}
    work, nbytes = float(np.median([r["update_ms"] for r in runs])), float(np.median([r["received_bytes"] for r in runs]))
    return {"cross_ms": round(work, 2), "cross_vs_own": round(work / (own * 1e3), 2),
            "cross_received_MB": round(nbytes / 1e6, 2), "cross_link_ms": round(nbytes / (link_gbps * 1e9) * 1e3, 3)}


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
    designs: dict[int, list[dict[str, float]]] = {g: [] for g in groups}
    crossed: dict[int, list[dict[str, float]]] = {g: [] for g in groups if g > 1}
    for r in range(args.repeats):
        for g in groups:
            designs[g].append(owner_sharded(tbe, g, args.bags, args.per_bag, args.rows, args.dim, 100 * r + g))
            if g > 1:
                crossed[g].append(cross_sharded(tbe, g, args.bags, args.per_bag, args.rows, args.dim, 100 * r + g))
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
                     "link_ms": round(received / (args.link_gbps * 1e9) * 1e3, 3), "kind": "measured",
                     **owner_row(designs[g], own, args.link_gbps), **cross_row(crossed.get(g), own, args.link_gbps)})
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
    print("owner-sharded update (designed, not built: its steps' compute on this process, its bytes counted):")
    print_table([r for r in rows if "owner_ms" in r], ["groups", "owner_convert_ms", "owner_merge_ms",
                                                      "owner_update_ms", "owner_copy_in_ms", "owner_ms",
                                                      "owner_vs_own", "owner_rows_touched", "owner_received_MB",
                                                      "owner_link_ms"])
    print("cross-group sharded, owner + buddy copy (a candidate, not built: its compute on this process, "
          "its bytes counted):")
    print_table([r for r in rows if "cross_ms" in r], ["groups", "own_ms", "cross_ms", "cross_vs_own",
                                                      "cross_received_MB", "cross_link_ms", "received_MB"])
    print(f"one TBE: {args.rows:,} rows x {args.dim}, row-wise Adagrad, CPU, 1 thread; {args.bags:,} bags x "
          f"{args.per_bag} Zipf ids per group; link {args.link_gbps} GB/s for the all-gather's bytes")
    if args.json:
        write_json(args.json, "bench_union_update", {k: v for k, v in vars(args).items() if k != "json"}, rows)


if __name__ == "__main__":
    main()
