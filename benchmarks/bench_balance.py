"""Cost balancing in the model: imbalance, modeled bubble fraction and planning time.

For each case (ranks x samples per rank x length distribution x max_len) and
each partitioner, draws ``--steps`` global batches of history lengths, costs
them with the HSTU cost model derived from the dimensions below, partitions
them, and reports (DESIGN.md "Measures"):

- imbalance: max_rank(cost) / mean_rank(cost), mean over steps;
- bound: max(1, max_sample / mean_rank), the best any per-step partition can do;
- gap: imbalance / bound - 1 (target: <= 1% for every case);
- gbound, ggap: the same with the granular bound (whole samples cannot be split:
  among the j*k+1 heaviest some rank holds j+1; see partition.granular_lower_bound),
  which is what a per-step partition can actually reach when many histories are
  clipped at max_len;
- bubble: modeled bubble fraction, 1 - mean_rank / max_rank, mean over steps;
- bubble_cut: 1 - bubble / bubble(round_robin) (target: >= 90% at max_len <= 1024);
- plan_ms: median time of one partition call (target: 8192 samples over 256 ranks < 5 ms).

Then, at max_len 4096, the windowed planner (``window`` global batches planned
together): epoch time is the sum over steps of the slowest rank, ideal is the
sum of the mean; "excess" = epoch / ideal - 1, and "removed" is the share of
per-step LPT's excess that the window removes.

    python benchmarks/bench_balance.py [--quick] [--json benchmarks/results/balance.json]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import print_table, write_json

from freescale.dataloader.cost import CostModel
from freescale.dataloader.partition import granular_lower_bound, imbalance, lower_bound, partition
from freescale.dataloader.planner import BatchPlanner, EpochOrder
from freescale.dataloader.synthetic import sample_lengths

# A mid-sized HSTU layer stack (GR's public MovieLens/Books configs are near this).
HSTU_DIMS = dict(embedding_dim=256, num_blocks=4, num_heads=4, attention_dim=64, value_dim=64, head_width=512)
KK_MAX_SAMPLES = 16_384  # KK's pure-Python merge loop is too slow beyond this (reported as skipped)


def case_rows(
    rng: np.random.Generator, model: CostModel, ranks: int, per_rank: int, dist: str, max_len: int, steps: int
) -> list[dict[str, object]]:
    n = ranks * per_rank
    batches = [sample_lengths(rng, n, dist, max_len, zipf_alpha=1.1) for _ in range(steps)]
    results: dict[str, dict[str, float]] = {}
    for name in ("round_robin", "token_kk", "kk", "lpt"):
        if name in ("kk", "token_kk") and n > KK_MAX_SAMPLES:
            continue
        imb, bnd, gbnd, bub, times = [], [], [], [], []
        for lengths in batches:
            costs = model(lengths)
            start = time.perf_counter()
            parts = partition(name, costs, lengths, ranks)
            times.append(time.perf_counter() - start)
            value = imbalance(costs, parts)
            imb.append(value)
            bnd.append(lower_bound(costs, ranks))
            gbnd.append(granular_lower_bound(costs, ranks))
            bub.append(1.0 - 1.0 / value)
        results[name] = dict(imbalance=float(np.mean(imb)), bound=float(np.mean(bnd)), gbound=float(np.mean(gbnd)),
                             bubble=float(np.mean(bub)), plan_ms=1e3 * float(np.median(times)))
    rr_bubble = results["round_robin"]["bubble"]
    rows = []
    for name, r in results.items():
        rows.append({
            "dist": dist, "max_len": max_len, "ranks": ranks, "per_rank": per_rank, "partitioner": name,
            "imbalance": r["imbalance"], "bound": r["bound"], "gbound": r["gbound"],
            "gap": r["imbalance"] / r["bound"] - 1, "ggap": r["imbalance"] / r["gbound"] - 1,
            "bubble": r["bubble"], "bubble_cut": 1 - r["bubble"] / rr_bubble if rr_bubble > 0 else 0.0,
            "plan_ms": r["plan_ms"],
        })
    return rows


def planning_ms(rng: np.random.Generator, model: CostModel, repeats: int = 30) -> dict[str, float]:
    """Median and P90 time of one LPT partition of 8192 ml-20m samples (max_len 1024) over 256 ranks."""
    times = []
    for _ in range(repeats):
        lengths = sample_lengths(rng, 8192, "ml-20m", 1024)
        costs = model(lengths)
        start = time.perf_counter()
        partition("lpt", costs, lengths, 256)
        times.append(1e3 * (time.perf_counter() - start))
    return {"p50": float(np.median(times)), "p90": float(np.percentile(times, 90))}


def window_rows(rng: np.random.Generator, model: CostModel, quick: bool) -> list[dict[str, object]]:
    rows = []
    cases = [(64, 32, "ml-20m"), (256, 32, "ml-20m"), (64, 32, "ml-1m")] if not quick else [(64, 32, "ml-20m")]
    for ranks, per_rank, dist in cases:
        g = ranks * per_rank
        steps = 32 if quick else 64
        lengths = sample_lengths(rng, g * steps, dist, 4096)
        order = EpochOrder(np.full(steps, g), seed=0, shuffle=True, window_row_groups=steps)
        excess = {}
        for window in (1, 4, 16):
            planner = BatchPlanner(lengths, order, cost_model=model, partitioner="lpt", global_batch_size=g,
                                   window=window)
            plans = [planner.plan(0, s, tuple(range(ranks))) for s in range(planner.steps_per_epoch)]
            epoch = sum(p.loads().max() for p in plans)
            ideal = sum(p.loads().mean() for p in plans)
            excess[window] = epoch / ideal - 1
            rows.append({"dist": dist, "ranks": ranks, "per_rank": per_rank, "window": window,
                         "excess": excess[window], "removed": 1 - excess[window] / excess[1] if excess[1] else 0.0,
                         "sample_count_min": min(p.global_size for p in plans),
                         "sample_count_max": max(p.global_size for p in plans)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a subset of cases, 2 steps each (< 60 s)")
    parser.add_argument("--steps", type=int, default=5, help="global batches per case (default 5)")
    parser.add_argument("--json", help="write rows, machine and parameters to this path")
    args = parser.parse_args()
    model = CostModel.for_hstu(**HSTU_DIMS)
    rng = np.random.default_rng(0)
    if args.quick:
        grid = [(r, s) for r in (8, 64, 256) for s in (16, 32)]
        dists, max_lens, steps = ("ml-20m", "zipf"), (200, 1024, 4096), 2
    else:
        grid = [(r, s) for r in (8, 64, 256, 1024) for s in (16, 64, 256)]
        dists, max_lens, steps = ("ml-1m", "ml-20m", "zipf", "uniform"), (200, 1024, 4096), args.steps
    rows = []
    for dist in dists:
        for max_len in max_lens:
            for ranks, per_rank in grid:
                rows += case_rows(rng, model, ranks, per_rank, dist, max_len, steps)
    columns = ["dist", "max_len", "ranks", "per_rank", "partitioner", "imbalance", "bound", "gbound", "gap",
               "ggap", "bubble", "bubble_cut", "plan_ms"]
    print(f"cost model: {model}")
    print_table(rows, columns)

    lpt = [r for r in rows if r["partitioner"] == "lpt"]
    worst_gap = max(lpt, key=lambda r: r["gap"])
    worst_ggap = max(lpt, key=lambda r: r["ggap"])
    cut = [r["bubble_cut"] for r in lpt if r["max_len"] <= 1024 and r["bubble_cut"] is not None]
    timing = planning_ms(rng, model)
    targets = {
        "lpt_worst_gap_to_bound": worst_gap["gap"], "lpt_worst_gap_case": {k: worst_gap[k] for k in columns[:4]},
        "lpt_cases_within_1pct_of_bound": f"{sum(r['gap'] <= 0.01 for r in lpt)}/{len(lpt)}",
        "lpt_worst_gap_to_granular_bound": worst_ggap["ggap"],
        "lpt_cases_within_1pct_of_granular_bound": f"{sum(r['ggap'] <= 0.01 for r in lpt)}/{len(lpt)}",
        "lpt_min_bubble_cut_maxlen_le_1024": min(cut) if cut else None,
        "lpt_mean_bubble_cut_maxlen_le_1024": float(np.mean(cut)) if cut else None,
        "lpt_plan_ms_8192_over_256_p50": timing["p50"],
        "lpt_plan_ms_8192_over_256_p90": timing["p90"],
    }
    print("\ntargets:")
    for key, value in targets.items():
        print(f"  {key}: {value}")

    windows = window_rows(rng, model, args.quick)
    print("\nwindowed planner at max_len 4096 (lpt):")
    print_table(windows, ["dist", "ranks", "per_rank", "window", "excess", "removed", "sample_count_min",
                          "sample_count_max"])
    if args.json:
        write_json(args.json, "bench_balance",
                   {"quick": args.quick, "steps": steps, "hstu_dims": HSTU_DIMS, "cost_model": vars(model)},
                   rows + [{"targets": targets}] + [{"window": w} for w in windows])


if __name__ == "__main__":
    main()
