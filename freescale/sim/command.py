"""``freescale simulate`` and ``benchmarks/bench_ettr.py``: gates first, then the sources, then results.

Order matters: the validation gates run before anything is projected, and a failed gate stops
the command (``GateFailed``) with the gates table printed, so no projection is ever shown from a
simulator that does not reproduce the published figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freescale.sim.gates import Gate, run_gates
from freescale.sim.params import SimError
from freescale.sim.project import (CURVE, SCALES, Sourced, compare, inputs, project, scenario, summary_row,
                                   with_overrides)


class GateFailed(SimError):
    """A validation gate failed: nothing is projected."""


def table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def gates_first(quick: bool) -> list[Gate]:
    gates = run_gates(quick)
    print("validation gates (published figures; the simulator must pass them before it projects):")
    table([g.row() for g in gates], ["gate", "accounting", "target", "got", "passed", "source"])
    failed = [g.name for g in gates if not g.passed]
    if failed:
        raise GateFailed(f"validation gate failed: {failed[0]} ({len(failed)} of {len(gates)}): nothing projected")
    print(f"all {len(gates)} gates passed; the synchronous figure (44%) is the 'queue' accounting "
          "(1 - lambda*(stall + lost work)); the renewal accountings would give 64% and 57%.\n")
    return gates


def print_inputs(v: dict[str, Sourced]) -> None:
    print("inputs (value, kind, source):")
    table([{"input": k, "value": f"{s.value:.6g}", "kind": s.kind, "source": s.source} for k, s in v.items()],
          ["input", "value", "kind", "source"])
    print()


RESULT_COLUMNS = ["gpus", "replicas", "job_mtbf_min", "policy", "ettr", "stall_mean_s", "stall_p50_s", "stall_p90_s",
                  "discarded_per_failure", "mean_contributing", "top_losses"]


def run_simulate(results: Path, gpus: int, replicas: int | None, failures: int, seed: int,
                 overrides: dict[str, float], projection: bool, plot: Path | None, quick: bool) -> dict[str, Any]:
    """The whole command; returns what ``--json`` writes."""
    v = with_overrides(inputs(results), overrides)  # bad input fails before the gates run
    gates = gates_first(quick)
    print_inputs(v)
    cluster, policies = scenario(gpus, v, replicas)
    outs = compare(cluster, policies, failures, seed)
    rows = [summary_row(gpus, cluster, p, o) for p, o in zip(policies, outs)]
    print(f"{gpus:,} GPUs as {cluster.replicas} replica groups of {cluster.gpus_per_replica:,}, {failures:,} "
          f"crash/hang failures simulated (seed {seed}):")
    table(rows, RESULT_COLUMNS)
    doc: dict[str, Any] = {"gates": [g.row() for g in gates], "inputs": _inputs_json(v), "rows": rows}
    if projection:
        print("\nprojection at 1K, 16K, 100K GPUs:")
        doc["projection"] = project(v, SCALES, failures, seed)
        table(doc["projection"], RESULT_COLUMNS)
    if plot is not None:
        from freescale.sim.plot import plot_projection

        curve = project(v, CURVE, failures, seed)
        doc["curve"] = curve
        plot_projection(curve, plot, "ETTR by simulation: measured parameters of this repository + labelled "
                                     "assumptions (benchmarks/results/ettr.json lists each)")
        print(f"\nwrote {plot}")
    return doc


def _inputs_json(v: dict[str, Sourced]) -> dict[str, Any]:
    return {k: {"value": s.value, "kind": s.kind, "source": s.source} for k, s in v.items()}


def throughput_run(v: dict[str, Sourced], gpus: int, hours: float, seed: int) -> list[Any]:
    """The three policies over ``hours`` of one trace (for the throughput-over-time plot)."""
    cluster, policies = scenario(gpus, v)
    return compare(cluster, policies, 0, seed, horizon_s=hours * 3600, bins=int(hours * 12))
