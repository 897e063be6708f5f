"""Cost balancing at 8 ... 16,384 ranks: imbalance against what is achievable, planning time, GIL hold.

For each case (ranks x samples per rank x length distribution) and each partitioner, draws
``--steps`` global batches of history lengths, costs them with the HSTU cost model derived from
the dimensions below and partitions them.  Reported (docs/design.md "Measures"):

- imbalance: max_rank(cost) / mean_rank(cost), mean over steps;
- gbound: the pigeonhole bound (among the j*k+1 heaviest samples some rank holds j+1;
  ``partition.granular_lower_bound``): no partition of the batch does better;
- ref: the best partition found by a long local search (``balance_kernels.refined_owner``, 64
  partners, 20 steps per rank) started from every partitioner's result: "achievable";
- gap_ref = imbalance / ref - 1 (target <= 1%), ggap = imbalance / gbound - 1;
- plan_ms P50/P90: one partition call; ``lpt_plan`` rows time ``BatchPlanner.plan`` (the whole
  step: window, costs, parts) at 32 samples per rank on ml-20m lengths;
- gil_ms: the longest the main thread waited for the GIL while the call ran on another thread;
- samples per rank: the most any rank holds over the mean, against LPT with only its 8x ceiling, LPT held to 2x
  and the equal-count partition's balance, with no free samples and half of them free (``count_rows``); where a
  rank holds more than 2x, whether 2x would have cost balance.

Distributions: ml-1m / ml-20m (lognormal fits), zipf, uniform, bimodal (~3 long histories per
rank, 80-100% of max_len, the rest 1-60), longtail (median ~500, up to 16,384) and ties (four
lengths only).  Peers (benchmark only; see ``balance_peers.py`` for how to get them): NVIDIA
recsys-examples' C++ equal-size KK and verl's Python KK, when ``--recsys-examples DIR`` is given.

Then a training run with a planning window of 16 at a simulated 1,024 ranks (rank 0 of 1,024
reads its rows, a 30 ms step of matmuls): the loader's wait per step, with the next window
planned halfway through the current one (the loader's default) and at its first step ("burst").

    python benchmarks/bench_balance.py [--quick] [--recsys-examples DIR] [--json benchmarks/results/balance.json]
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from balance_peers import Peer
from balance_peers import load as load_peers
from balance_window import window_rows
from common import write_json

from freescale.dataloader import balance_kernels
from freescale.dataloader.cost import CostModel
from freescale.dataloader.epoch_order import EpochOrder
from freescale.dataloader.partition import (
    KK_MAX_CELLS,
    LPT_COUNT_CEILING_SHARE,
    LPT_HEAD_SHARE,
    LPT_MAX_COUNT_SHARE,
    LPT_REFINE_PARTNERS,
    LPT_RESOLUTION,
    LPT_TOLERANCE,
    Parts,
    granular_lower_bound,
    imbalance,
    partition,
)
from freescale.dataloader.planner import BatchPlanner
from freescale.dataloader.synthetic import sample_lengths
from freescale.tables import print_table

# A mid-sized HSTU layer stack (GR's public MovieLens/Books configs are near this).
HSTU_DIMS = dict(embedding_dim=256, num_blocks=4, num_heads=4, attention_dim=64, value_dim=64, head_width=512)
VERL_MAX_CELLS = 1 << 19  # verl's KK is pure Python (one k-list per sample): slower than minutes beyond this
MAX_LEN = {"longtail": 16_384}
PLAN_SHAPES = [(16_384, 32), (4_096, 128)]
"""Ranks x samples per rank of the planning-time rows with the model's own costs: 524,288 samples each."""


def draw(rng: np.random.Generator, n: int, per_rank: int, dist: str) -> np.ndarray:
    max_len = MAX_LEN.get(dist, 1024)
    if dist == "bimodal":
        long = rng.random(n) < min(1.0, 3 / per_rank)
        return np.where(long, rng.integers(int(0.8 * max_len), max_len + 1, n), rng.integers(1, 61, n))
    if dist == "longtail":
        return np.clip(np.rint(rng.lognormal(np.log(500), 1.2, n)), 1, max_len).astype(np.int64)
    if dist == "ties":
        return rng.choice(np.array([16, 64, 256, max_len]), size=n, p=[0.55, 0.3, 0.12, 0.03])
    if dist == "loguniform":  # every scale equally likely: 1 .. max_len
        return np.clip(np.rint(np.exp(rng.uniform(0.0, np.log(max_len), n))), 1, max_len).astype(np.int64)
    if dist == "outlier":  # short histories, one in a thousand at the longest
        return np.where(rng.random(n) < 1e-3, max_len, rng.integers(1, 101, n))
    return sample_lengths(rng, n, dist, max_len, zipf_alpha=1.1)


def gil_hold_ms(call: Callable[[], Any], repeats: int = 3) -> float:
    """Run ``call`` on a thread; the longest gap the main thread saw between two of its steps.
    The least of ``repeats`` runs: a GIL hold is there every time, the OS taking a core away
    from the main thread (2 cores, other processes) is not."""
    return min(_gil_gap_ms(call) for _ in range(repeats))


def _gil_gap_ms(call: Callable[[], Any]) -> float:
    done = threading.Event()
    worker = threading.Thread(target=lambda: (call(), done.set()))
    last, worst = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    worker.join()
    return 1e3 * worst


Run = Callable[[np.ndarray, np.ndarray, int], tuple[Parts, float]]


def _timed(name: str, equal_count: bool) -> Run:
    def run(costs: np.ndarray, lengths: np.ndarray, k: int) -> tuple[Parts, float]:
        start = time.perf_counter()
        parts = partition(name, costs, lengths, k, equal_count)
        return parts, time.perf_counter() - start
    return run


def partitioners(peers: dict[str, Peer]) -> dict[str, Run]:
    """Ours (timed around ``partition``: everything a plan pays) and the peers (their call only)."""
    ours = {name: _timed(name, False) for name in ("round_robin", "token_kk", "kk", "lpt")}
    ours["lpt_equal"] = _timed("lpt", True)
    theirs: dict[str, Run] = {name: (lambda c, lengths, k, peer=peer, eq=name == "recsys_kk": peer(c, k, eq))
                              for name, peer in peers.items()}
    return {**ours, **theirs}


def feasible(name: str, n: int, k: int) -> bool:
    if name in ("kk", "token_kk"):
        return n * k <= KK_MAX_CELLS
    if name == "verl_kk":
        return n * k <= VERL_MAX_CELLS
    return True


def reference(costs: np.ndarray, k: int, starts: list[Parts]) -> float:
    """Best imbalance of a long local search from each start (and each start itself)."""
    best = min(imbalance(costs, p) for p in starts)
    for parts in starts:
        owner = np.empty(costs.size, dtype=np.int64)
        owner[parts.index] = parts.owner()
        improved = balance_kernels.refined_owner(costs, owner, k, True, 64, 20 * k + 1000)
        best = min(best, imbalance(costs, Parts.of_owner(improved, k)))
    return best


def case_rows(rng: np.random.Generator, model: CostModel, ranks: int, per_rank: int, dist: str, steps: int,
              run: dict[str, Run]) -> list[dict[str, Any]]:
    n = ranks * per_rank
    stats: dict[str, dict[str, list[float]]] = {name: {"imb": [], "ms": [], "gil": []} for name in run}
    refs, gbounds = [], []
    for step in range(steps):
        lengths = draw(rng, n, per_rank, dist)
        costs = model(lengths)
        found = []
        for name, fn in run.items():
            if not feasible(name, n, ranks) or (name == "verl_kk" and step > 0):
                continue
            parts, seconds = fn(costs, lengths, ranks)
            stats[name]["ms"].append(1e3 * seconds)
            stats[name]["imb"].append(imbalance(costs, parts))
            if step == 0:
                stats[name]["gil"].append(gil_hold_ms(lambda fn=fn: fn(costs, lengths, ranks)))
            if name != "round_robin":
                found.append(parts)
        gbounds.append(granular_lower_bound(costs, ranks))
        refs.append(max(gbounds[-1], reference(costs, ranks, found)))
    rows = []
    for name, s in stats.items():
        if not s["imb"]:
            rows.append({"dist": dist, "ranks": ranks, "per_rank": per_rank, "partitioner": name, "refused": True})
            continue
        used = len(s["imb"])
        imb, ref, gb = float(np.mean(s["imb"])), float(np.mean(refs[:used])), float(np.mean(gbounds[:used]))
        rows.append({"dist": dist, "ranks": ranks, "per_rank": per_rank, "partitioner": name, "imbalance": imb,
                     "imbalance_steps": s["imb"],
                     "gbound": gb, "ref": ref, "gap_ref": imb / ref - 1, "ggap": imb / gb - 1,
                     "plan_ms_p50": float(np.median(s["ms"])), "plan_ms_p90": float(np.percentile(s["ms"], 90)),
                     "gil_ms": s["gil"][0] if s["gil"] else None})
    return rows


def planner_rows(rng: np.random.Generator, model: CostModel, ranks_list: list[int], steps: int) -> list[dict[str, Any]]:
    """``BatchPlanner.plan`` per step at 32 samples per rank (ml-20m), P50/P90 over ``steps``."""
    rows = []
    for ranks in ranks_list:
        g = ranks * 32
        lengths = sample_lengths(rng, g * (steps + 1), "ml-20m", 1024)
        order = EpochOrder(np.full(steps + 1, g), seed=0, shuffle=True, window_row_groups=steps + 1)
        planner = BatchPlanner(lengths, order, cost_model=model, partitioner="lpt", global_batch_size=g)
        live = tuple(range(ranks))
        planner.plan(0, 0, live)  # the epoch's order is computed once per epoch: not a step's cost
        times = []
        for s in range(1, steps + 1):
            start = time.perf_counter()
            planner.plan(0, s, live).imbalance()
            times.append(1e3 * (time.perf_counter() - start))
        # A step planned afresh, on a planner of its own each time (nothing cached, nothing to free).
        fresh = [BatchPlanner(lengths, order, cost_model=model, partitioner="lpt", global_batch_size=g)
                 for _ in range(3)]
        gil = gil_hold_ms(lambda: fresh.pop().plan(0, 1, live))
        rows.append({"partitioner": "lpt_plan", "ranks": ranks, "samples": g, "plan_ms_p50": float(np.median(times)),
                     "plan_ms_p90": float(np.percentile(times, 90)), "gil_ms": gil})
    return rows


def real_cost_rows(rng: np.random.Generator, dists: tuple[str, ...], steps: int) -> list[dict[str, Any]]:
    """``BatchPlanner.plan`` at 524,288 samples (16,384 ranks x 32 and 4,096 x 128) with the tiny HSTU's own cost
    model (``configs/tiny_hstu.toml``'s dimensions, quadratic term included), every distribution: the planner's
    cost where a user trains."""
    from freescale.models import ModelConfig, cost_model_for

    model = cost_model_for(ModelConfig(kind="hstu"), 8)
    rows = []
    for (ranks, per_rank), dist in itertools.product(PLAN_SHAPES, dists):
        g = ranks * per_rank
        lengths = draw(rng, g * (steps + 1), per_rank, dist)
        order = EpochOrder(np.full(steps + 1, g), seed=0, shuffle=True, window_row_groups=steps + 1)
        planner = BatchPlanner(lengths, order, cost_model=model, partitioner="lpt", global_batch_size=g)
        live = tuple(range(ranks))
        planner.plan(0, 0, live)
        times, imbalances, counts = [], [], []
        for s in range(1, steps + 1):
            start = time.perf_counter()
            plan = planner.plan(0, s, live)
            times.append(1e3 * (time.perf_counter() - start))
            imbalances.append(plan.imbalance())
            counts.append(int(plan.rows.sizes.max()))
        rows.append({"dist": dist, "ranks": ranks, "per_rank": per_rank, "samples": g,
                     "plan_ms_p50": float(np.median(times)),
                     "plan_ms_p90": float(np.percentile(times, 90)), "imbalance": float(np.mean(imbalances)),
                     "max_rank_samples": max(counts)})
    return rows


def count_rows(dists: tuple[str, ...], quick: bool) -> list[dict[str, Any]]:
    """The per-rank sample count LPT leaves (the most any rank holds, over the mean), beside the equal-count
    partition's balance and LPT's with its 8x ceiling as the only cap (free samples still dealt out by count; before
    that, they piled onto the lightest rank up to the cap: 8x in 12 of 28 such cases): under the tiny HSTU's
    model and one with no constant term (a calibrated fit can find none: an empty history then costs nothing),
    with no free samples and with half of them free (length 0)."""
    from freescale.models import ModelConfig, cost_model_for

    models = {"tiny_hstu": cost_model_for(ModelConfig(kind="hstu"), 8), "no_constant": CostModel(1.0, 10.0, 0.0)}
    rows = []
    for (name, model), free, dist, (ranks, per_rank) in itertools.product(
            models.items(), (0.0, 0.5), dists, [(64, 32)] if quick else [(64, 32), (256, 8), (1024, 32)]):
        rng = np.random.default_rng(zlib.crc32(f"{name}{free}{dist}{ranks}{per_rank}".encode()))
        lengths = draw(rng, ranks * per_rank, per_rank, dist)
        lengths[rng.random(lengths.size) < free] = 0
        costs = np.ascontiguousarray(model(lengths), dtype=np.float64)
        parts = partition("lpt", costs, lengths, ranks)
        loose = -(-LPT_COUNT_CEILING_SHARE * costs.size // ranks)
        index, offsets, _ = balance_kernels.lpt_refined(
            costs, ranks, False, 4 * ranks + 64, LPT_REFINE_PARTNERS, LPT_RESOLUTION, LPT_TOLERANCE, LPT_HEAD_SHARE,
            LPT_TOLERANCE, loose, loose, np.ones(ranks))
        at_8x = Parts(index, offsets)
        twice = -(-LPT_MAX_COUNT_SHARE * costs.size // ranks)
        index, offsets, _ = balance_kernels.lpt_refined(
            costs, ranks, False, 4 * ranks + 64, LPT_REFINE_PARTNERS, LPT_RESOLUTION, LPT_TOLERANCE, LPT_HEAD_SHARE,
            LPT_TOLERANCE, twice, twice, np.ones(ranks))
        at_2x = Parts(index, offsets)
        rows.append({"model": name, "free": free, "dist": dist, "ranks": ranks, "per_rank": per_rank,
                     "max_count_x": float(parts.sizes.max()) / per_rank, "imbalance": imbalance(costs, parts),
                     "cap_8x_max_count_x": float(at_8x.sizes.max()) / per_rank,
                     "cap_8x_imbalance": imbalance(costs, at_8x), "cap_2x_imbalance": imbalance(costs, at_2x),
                     "equal_count_imbalance": imbalance(costs, partition("lpt", costs, lengths, ranks, True))})
    return rows


def targets(rows: list[dict[str, Any]], plans: list[dict[str, Any]]) -> dict[str, Any]:
    lpt = [r for r in rows if r["partitioner"] == "lpt" and not r.get("refused")]
    worst = max(lpt, key=lambda r: r["gap_ref"])
    beaten = []
    for r in lpt:
        peers = [p for p in rows if (p["dist"], p["ranks"], p["per_rank"]) == (r["dist"], r["ranks"], r["per_rank"])
                 and p["partitioner"] not in ("lpt", "lpt_equal") and not p.get("refused")]
        for p in peers:  # on the steps both ran (verl's KK runs the first only)
            ours = float(np.mean(r["imbalance_steps"][: len(p["imbalance_steps"])]))
            if p["imbalance"] < ours - 1e-9:
                beaten.append({"dist": r["dist"], "ranks": r["ranks"], "per_rank": r["per_rank"],
                               "peer": p["partitioner"], "by": ours - p["imbalance"]})
    by_samples = {p["samples"]: p for p in plans}
    slower = []
    for r in lpt:
        kk = next((p for p in rows if p["partitioner"] == "recsys_kk" and not p.get("refused")
                   and (p["dist"], p["ranks"], p["per_rank"]) == (r["dist"], r["ranks"], r["per_rank"])), None)
        if kk is not None and r["plan_ms_p50"] >= kk["plan_ms_p50"]:
            slower.append((r["dist"], r["ranks"]))
    return {
        "lpt_worst_gap_to_reference": worst["gap_ref"],
        "lpt_worst_case": {k: worst[k] for k in ("dist", "ranks", "per_rank")},
        "lpt_cases_within_1pct_of_reference": f"{sum(r['gap_ref'] <= 0.01 for r in lpt)}/{len(lpt)}",
        "lpt_cases_where_a_peer_is_better": len(beaten),
        "lpt_most_a_peer_is_better_by": max(beaten, key=lambda b: b["by"]) if beaten else None,
        "lpt_cases_slower_than_recsys_kk": slower,
        **{f"plan_ms_p50_at_{s}": by_samples[s]["plan_ms_p50"] for s in (8192, 131072, 524288) if s in by_samples},
        "lpt_plan_worst_gil_ms": max(p["gil_ms"] for p in plans),
        "lpt_worst_gil_ms": max(r["gil_ms"] for r in lpt if r["gil_ms"] is not None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer cases and steps (< 60 s)")
    parser.add_argument("--steps", type=int, default=3, help="global batches per case (default 3)")
    parser.add_argument("--recsys-examples", help="a clone of NVIDIA/recsys-examples: run its KK and verl's beside ours")
    parser.add_argument("--data", default="/tmp/freescale_bench_balance", help="where the window run's data is made")
    parser.add_argument("--json", help="write rows, machine and parameters to this path")
    args = parser.parse_args()
    model = CostModel.for_hstu(**HSTU_DIMS)
    balance_kernels.warm_up()
    peers, missing = load_peers(args.recsys_examples)
    rng = np.random.default_rng(0)
    if args.quick:
        grid, dists, steps = [(8, 32), (256, 32), (4096, 32)], ("ml-20m", "bimodal", "longtail", "ties"), 1
        plan_ranks = [256, 4096, 16384]
    else:
        grid = [(r, 32) for r in (8, 64, 256, 1024, 4096, 16384)] + [(256, 8), (256, 128)]
        dists = ("ml-1m", "ml-20m", "zipf", "uniform", "bimodal", "longtail", "ties")
        steps, plan_ranks = args.steps, [256, 1024, 4096, 16384]
    run = partitioners(peers)
    rows = [row for dist in dists for ranks, per_rank in grid
            for row in case_rows(rng, model, ranks, per_rank, dist, steps, run)]
    print(f"cost model: {model}; peers: {sorted(peers) or 'none'} {missing or ''}")
    print_table([r for r in rows if not r.get("refused")],
                ["dist", "ranks", "per_rank", "partitioner", "imbalance", "gbound", "ref", "gap_ref", "ggap",
                 "plan_ms_p50", "plan_ms_p90", "gil_ms"])
    refused = sorted({(r["partitioner"], r["ranks"] * r["per_rank"]) for r in rows if r.get("refused")})
    print(f"refused (over a size limit): {refused}")
    plans = planner_rows(rng, model, plan_ranks, 5 if args.quick else 10)
    print("\nBatchPlanner.plan per step (lpt, ml-20m, 32 samples per rank):")
    print_table(plans, ["ranks", "samples", "plan_ms_p50", "plan_ms_p90", "gil_ms"])
    real = real_cost_rows(rng, (*dists, "loguniform", "outlier"), 3 if args.quick else 10)
    print("\nBatchPlanner.plan per step with the tiny HSTU's own cost model (524,288 samples; target <= 40 ms):")
    print_table(real, ["dist", "ranks", "per_rank", "samples", "plan_ms_p50", "plan_ms_p90", "imbalance", "max_rank_samples"])
    counts = count_rows(dists, args.quick)
    print("\nsamples per rank (the most any holds, x the mean) and balance: LPT's count cap against 8x alone and "
          "equal counts:")
    print_table(counts, ["model", "free", "dist", "ranks", "per_rank", "max_count_x", "imbalance", "cap_8x_max_count_x",
                         "cap_8x_imbalance", "cap_2x_imbalance", "equal_count_imbalance"])
    windows = window_rows(args.data, args.quick)
    print("\nloader wait per step, window 16 at 1,024 simulated ranks (rank 0), 30 ms steps:")
    print_table(windows, ["mode", "ranks", "per_rank", "window", "steps", "wait_ms_p50", "wait_ms_p99", "wait_ms_max",
                          "late_steps", "late_ms_total", "window_plan_ms"])
    summary = targets(rows, plans)
    summary["real_cost_plan_ms_p50_worst"] = max(r["plan_ms_p50"] for r in real)
    summary["real_cost_plan_within_40ms_every_dist"] = all(r["plan_ms_p50"] <= 40.0 for r in real)
    summary["lpt_most_samples_on_a_rank_x_mean"] = max(c["max_count_x"] for c in counts)
    summary["lpt_count_cap_costs_balance_cases"] = sum(c["imbalance"] > c["cap_8x_imbalance"] * (1 + 1e-4) for c in counts)
    past = [c for c in counts if c["max_count_x"] > LPT_MAX_COUNT_SHARE]
    summary["lpt_cases_past_2x_the_mean_count"] = f"{len(past)} of {len(counts)}"
    summary["lpt_past_2x_where_2x_costs_no_balance"] = sum(
        c["cap_2x_imbalance"] <= c["imbalance"] * (1 + 1e-4) for c in past)
    print("\ntargets:")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    if args.json:
        write_json(args.json, "bench_balance",
                   {"quick": args.quick, "steps": steps, "hstu_dims": HSTU_DIMS, "cost_model": vars(model),
                    "peers": sorted(peers), "peers_missing": missing},
                   rows + [{"planner": p} for p in plans] + [{"real_cost_planner": r} for r in real]
                   + [{"count_cap": c} for c in counts] + [{"window": w} for w in windows]
                   + [{"targets": summary}])


if __name__ == "__main__":
    main()
