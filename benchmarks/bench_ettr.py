"""What fault tolerance buys at scale: ETTR of three policies at 1K-98K GPUs, by simulation.

``freescale.sim`` simulates one seeded failure trace per GPU count and runs three policies on
it: fully synchronous training with checkpoint restart, a torchft-like replica policy (the
in-flight step discarded on every replica, the heal's source blocking) and this project (no step
discarded, non-blocking catch-up, a detected slow replica kept at a reduced share of the global
batch: the detection delay and the share of its cost won back measured by ``bench_stragglers.py``).

1. Validation gates first (``freescale/sim/gates.py``): FT-HSDP's synchronous 44% (and which
   accounting gives it), FT-HSDP's own 80%, torchft's Crusoe run (82.3% of steps committed;
   its per-step participating groups and efficiency are reported beside it, not gated), and
   every policy within 1 point of its closed form.  A failed gate stops the script before any
   projection.
2. Inputs, each printed with its source: this repository's benchmark results
   (``ft_torchrec_cpu.json``: kill -> next commit, restart -> catch-up, the catch-up's fixed
   cost and rate, the survivors' slowdown during a catch-up, the last three CPU-toy figures;
   ``ft_cpu.json``: per-step overhead, torchft's kill -> next commit; ``stragglers_cpu.json``: steps to detect
   a slow replica, the share of its cost won back), code defaults (the hang
   bounds: ``ft/config.py`` ``FTConfig.timeout_s``, torchft's ``Manager`` timeout), and labelled
   assumptions for what a 2-core CPU machine cannot measure (failure rates, node replacement,
   NCCL init at scale, checkpoint cadence).
3. Projection at 1K, 16K and 98K GPUs (ETTR, lambda*stall with rows past 0.5 marked, stall per
   failure mean/P50/P90, steps discarded per failure, mean contributing replica groups, the
   largest losses), freescale vs torchft-like (ties within the overheads' noise); ETTR against
   GPU count (``ettr_vs_gpus.png``) and throughput over 24 h at 98K GPUs on one trace
   (``ettr_throughput_98k.png``), both beside the JSON (the plots need matplotlib:
   ``pip install -e '.[report]'``).

    python benchmarks/bench_ettr.py [--quick] [--failures 2000] [--seed 0]
                                    [--json benchmarks/results/ettr.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from freescale.config import ConfigError  # noqa: E402
from freescale.sim.command import (GateFailed, ft_comparison, gates_first, inputs_json, print_comparison,  # noqa: E402
                                   print_degraded, print_inputs, print_results, throughput_run, writable)
from freescale.sim.params import SimError  # noqa: E402
from freescale.sim.project import CURVE, SCALES, check_scenarios, inputs, project  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer simulated failures (< 60 s)")
    parser.add_argument("--failures", type=int, default=0, help="crash/hang failures per GPU count (default 2000; 300 quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=str(RESULTS), help="where the measured FT benchmark JSONs are")
    parser.add_argument("--json", help="write gates, inputs, projection and curve here (PNGs beside it; needs matplotlib)")
    args = parser.parse_args()
    try:
        return run(args)
    except (GateFailed, SimError, ConfigError) as exc:  # ConfigError: matplotlib missing (install hint)
        print(f"bench_ettr: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, GateFailed) else 2


def run(args: argparse.Namespace) -> int:
    failures = args.failures or (300 if args.quick else 2_000)
    start = time.perf_counter()
    v = inputs(Path(args.results))  # a missing result file fails here, in one line, before the gates
    check_scenarios(v, SCALES[0], None, SCALES + CURVE)
    out = None
    if args.json:
        from freescale.plotting import pyplot

        pyplot()
        out = writable(Path(args.json))
    gates = gates_first(args.quick)
    print_inputs(v)
    rows = project(v, SCALES, failures, args.seed)
    print(f"projection ({failures:,} crash/hang failures simulated per GPU count, seed {args.seed}):")
    print_results(rows)
    comparison = ft_comparison(rows, v)
    print_comparison(comparison)
    degraded = print_degraded(v, failures, args.seed)
    curve = project(v, CURVE, failures, args.seed)
    if out is not None:
        from freescale.sim.plot import plot_projection, plot_throughput

        png = plot_projection(curve, out.with_name("ettr_vs_gpus.png"),
                              f"ETTR by simulation ({failures:,} failures per point): measured parameters of this "
                              f"repository + labelled assumptions ({out.name} lists each)")
        tp = plot_throughput(throughput_run(v, SCALES[-1], 24.0, args.seed), out.with_name("ettr_throughput_98k.png"),
                             f"throughput over 24 h at {SCALES[-1]:,} GPUs, one failure trace, three policies")
        print(f"wrote {png} and {tp}")
        write_json(out, "bench_ettr", {
            "quick": args.quick, "failures_per_point": failures, "seed": args.seed, "scales": list(SCALES),
            "curve_gpus": list(CURVE), "accounting": "queue (failures arrive in wall-clock time; a failure "
            "during a recovery queues its own)", "gates": [g.row() for g in gates], "inputs": inputs_json(v),
            "comparison": comparison, "curve": curve, "degraded": degraded,
            "seconds": round(time.perf_counter() - start, 1)}, rows)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
