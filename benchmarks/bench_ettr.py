"""What fault tolerance buys at scale: ETTR of three policies at 1K-100K GPUs, by simulation.

``freescale.sim`` simulates one seeded failure trace per GPU count and runs three policies on
it: fully synchronous training with checkpoint restart, a torchft-like replica policy (the
in-flight step discarded on every replica, the heal's source blocking, heartbeat detection)
and this project (no step discarded, non-blocking catch-up, slow replicas at a reduced share).

1. Validation gates first (``freescale/sim/gates.py``): FT-HSDP's synchronous 44% (and which
   accounting gives it), FT-HSDP's own 80%, torchft's Crusoe run (82.3% of steps committed),
   and every policy within 1 point of its closed form.  A failed gate stops the script before
   any projection.
2. Inputs, each printed with its source: this repository's benchmark results
   (``ft_torchrec_cpu.json``: kill -> next commit, restart -> catch-up, catch-up rate, the
   survivors' slowdown during a catch-up, the heartbeat timeout; ``ft_cpu.json``: per-step
   overhead, torchft's kill -> next commit), the code (``ft/config.py``), and labelled
   assumptions for what a 2-core CPU machine cannot measure (failure rates, node replacement,
   NCCL init at scale, checkpoint cadence).
3. Projection at 1K, 16K and 100K GPUs (ETTR, stall per failure mean/P50/P90, steps discarded
   per failure, mean contributing replica groups, the largest losses); ETTR against GPU count
   for the plot (``ettr_vs_gpus.png``), and throughput over 24 h at 100K GPUs on one trace
   (``ettr_throughput_100k.png``), both beside the JSON.

    python benchmarks/bench_ettr.py [--quick] [--failures 2000] [--seed 0]
                                    [--json benchmarks/results/ettr.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from freescale.sim.command import RESULT_COLUMNS, GateFailed, gates_first, print_inputs, throughput_run  # noqa: E402
from freescale.sim.project import CURVE, SCALES, inputs, project  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer simulated failures (< 60 s)")
    parser.add_argument("--failures", type=int, default=0, help="crash/hang failures per GPU count (default 2000; 300 quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=str(RESULTS), help="where the measured FT benchmark JSONs are")
    parser.add_argument("--json", help="write gates, inputs, projection and curve here (PNGs beside it)")
    args = parser.parse_args()
    failures = args.failures or (300 if args.quick else 2_000)
    start = time.perf_counter()
    try:
        gates = gates_first(args.quick)
    except GateFailed as exc:
        print(f"bench_ettr: {exc}", file=sys.stderr)
        return 1
    v = inputs(Path(args.results))
    print_inputs(v)
    rows = project(v, SCALES, failures, args.seed)
    print(f"projection ({failures:,} crash/hang failures simulated per GPU count, seed {args.seed}):")
    print_table(rows, RESULT_COLUMNS)
    curve = project(v, CURVE, failures, args.seed)
    if args.json:
        from freescale.sim.plot import plot_projection, plot_throughput

        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        png = plot_projection(curve, out.with_name("ettr_vs_gpus.png"),
                              f"ETTR by simulation ({failures:,} failures per point): measured parameters of this "
                              f"repository + labelled assumptions ({out.name} lists each)")
        tp = plot_throughput(throughput_run(v, 102_400, 24.0, args.seed), out.with_name("ettr_throughput_100k.png"),
                             "throughput over 24 h at 100K GPUs, one failure trace, three policies")
        print(f"wrote {png} and {tp}")
        write_json(out, "bench_ettr", {
            "quick": args.quick, "failures_per_point": failures, "seed": args.seed, "scales": list(SCALES),
            "curve_gpus": list(CURVE), "accounting": "queue (failures arrive in wall-clock time; a failure "
            "during a recovery queues its own)", "gates": [g.row() for g in gates],
            "inputs": {k: {"value": s.value, "kind": s.kind, "source": s.source} for k, s in v.items()},
            "curve": curve, "seconds": round(time.perf_counter() - start, 1)}, rows)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
