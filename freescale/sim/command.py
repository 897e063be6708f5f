"""``freescale simulate`` and ``benchmarks/bench_ettr.py``: gates first, then the sources, then results.

Order matters:

1. every input and every scenario the command will run is validated first (seconds; errors name
   the ``--set`` key or the flag), and so is matplotlib when a plot is asked for;
2. the validation gates run before anything is projected, and a failed gate stops the command
   (``GateFailed``) with the gates table printed, so no projection is ever shown from a
   simulator that does not reproduce the published figures.  ``freescale simulate`` keeps the
   gates' result per simulator source (a hash of ``freescale/sim/*.py``) in a cache directory
   and reuses it (``--fresh-gates`` runs them again); the bench always runs them;
3. the inputs with their sources, then the results, then notes on how far they can be read:
   rows past ``lambda*stall`` 0.5 (outside what the gates validate) and the FT policies'
   comparison (a gap within the measured overheads' noise is a tie).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from freescale.sim.gates import Gate, run_gates
from freescale.sim.params import SimError
from freescale.sim.project import (
    CURVE,
    FREESCALE,
    SCALES,
    VALIDATED_X,
    Sourced,
    check_scenarios,
    compare,
    degraded_scenario,
    inputs,
    policy_rows,
    project,
    scenario,
    with_overrides,
)
from freescale.tables import print_table


class GateFailed(SimError):
    """A validation gate failed: nothing is projected."""


def table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """The simulator's tables: text columns, left-aligned."""
    print_table(rows, columns, align="left")


# ----- gates -----------------------------------------------------------------------------------
def sim_source_digest() -> str:
    """A hash of the simulator's source: a cached gate result is valid for this source only."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def gate_cache(quick: bool) -> Path:
    root = Path(os.environ.get("FREESCALE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                              Path.home() / ".cache") / "freescale")
    return root / f"sim-gates-{sim_source_digest()}-{'quick' if quick else 'full'}.json"


def _cached(path: Path) -> list[Gate] | None:
    try:
        return [Gate(**g) for g in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return None


def _store(path: Path, gates: list[Gate]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(g) for g in gates], indent=1) + "\n")
    except OSError:
        pass  # a cache only: a read-only home costs the next call its gates


def gates_first(quick: bool, use_cache: bool = False) -> list[Gate]:
    """Run (or, with ``use_cache``, reuse) the gates, print them; ``GateFailed`` if one fails."""
    path = gate_cache(quick) if use_cache else None
    gates = _cached(path) if path is not None else None
    origin = f"reused from {path} (this simulator source; --fresh-gates runs them again)" if gates else "run now"
    if gates is None:
        gates = run_gates(quick)
        if path is not None and all(g.passed for g in gates if g.blocking):
            _store(path, gates)
    print(f"validation gates ({'quick' if quick else 'full'}, {origin}): published figures the simulator must "
          "reproduce before it projects; 'reported' rows are comparisons that stop nothing:")
    table([g.row() for g in gates], ["gate", "kind", "accounting", "target", "got", "result", "source"])
    failed = [g.name for g in gates if g.blocking and not g.passed]
    blocking = sum(g.blocking for g in gates)
    if failed:
        raise GateFailed(f"validation gate failed: {failed[0]} ({len(failed)} of {blocking}): nothing projected")
    missed = [g for g in gates if not g.blocking and not g.passed]
    print(f"all {blocking} gates passed; the synchronous figure (44%) is the 'queue' accounting "
          "(1 - lambda*(stall + lost work)); the renewal accountings would give 64% and 57%.")
    for g in missed:
        print(f"MISSED (reported, not a gate): {g.name}: got {g.got:.2f}, published {g.target:g} +- {g.tolerance:g} "
              "(see freescale/sim/gates.py: the assumed Crusoe restart is not fitted to these figures)")
    print()
    return gates


# ----- inputs and results ----------------------------------------------------------------------
def print_inputs(v: dict[str, Sourced]) -> None:
    print("inputs (value, kind, source):")
    table([{"input": k, "value": f"{s.value:.6g}", "kind": s.kind, "source": s.source} for k, s in v.items()],
          ["input", "value", "kind", "source"])
    print()


RESULT_COLUMNS = ["gpus", "replicas", "job_mtbf_min", "policy", "ettr", "lambda_stall", "stall_mean_s", "stall_p50_s",
                  "stall_p90_s", "discarded_per_failure", "mean_contributing", "embedding_sync", "top_losses"]


def print_results(rows: list[dict[str, Any]]) -> None:
    """The rows, ``lambda_stall`` marked ``*`` past the validated range."""
    table([{**r, "lambda_stall": f"{r['lambda_stall']:.3f}{'' if r['validated'] else ' *'}"} for r in rows],
          RESULT_COLUMNS)
    if not all(r["validated"] for r in rows):
        print(f"* lambda*stall > {VALIDATED_X}: outside the range the gates validate (the closed forms hold to "
              f"{VALIDATED_X}); read those rows as indicative only")


def ft_comparison(rows: list[dict[str, Any]], v: dict[str, Sourced]) -> list[dict[str, Any]]:
    """Per GPU count: freescale minus torchft-like, in ETTR points, and whether the gap is a tie: no larger than
    the gap of the two measured steady-state overheads, single CPU runs within each other's noise (torchft's was
    measured negative and clipped to 0)."""
    tie = max(0.5, 100 * abs(v["overhead"].value - v["torchft_overhead"].value))
    found = []
    for gpus in sorted({r["gpus"] for r in rows}):
        at = {r["policy"]: r["ettr"] for r in rows if r["gpus"] == gpus}
        if not {"torchft-like", FREESCALE} <= set(at):
            continue
        gap = 100 * (at[FREESCALE] - at["torchft-like"])
        found.append({"gpus": gpus, "torchft_like": at["torchft-like"], "tie_within_pts": round(tie, 2),
                      "freescale": at[FREESCALE], "minus_torchft_pts": round(gap, 2),
                      "verdict": "tie" if abs(gap) <= tie else ("ahead" if gap > 0 else "behind")})
    return found


def print_comparison(comparison: list[dict[str, Any]]) -> None:
    if not comparison:
        return
    tie = comparison[0]["tie_within_pts"]
    print(f"\nfreescale vs torchft-like (ETTR points; within +-{tie:g} is a tie: the measured steady-state overheads, "
          "one CPU run each, differ by that much):")
    table([{"gpus": c["gpus"], "torchft-like": c["torchft_like"], "freescale": c["freescale"],
            "freescale - torchft-like": f"{c['minus_torchft_pts']:+.2f} ({c['verdict']})"}
           for c in comparison], ["gpus", "torchft-like", "freescale", "freescale - torchft-like"])
    print("freescale keeps a detected slow replica at a reduced share (after slow_detect_steps x step_s, measured; "
          "winning back slow_recovered of its cost: the planner's modelled figure, an upper bound, the end-to-end one "
          "not established; --set slow_recovered=0 or slow_detect_steps=inf: everyone waits, as under torchft). It keeps the embedding tables in step the cheaper of its two ways at each scale: "
          "the union update (its step growing with the groups: sparse_update_share x union_extra_per_group per group "
          "beyond two) or the tables averaged across groups (table_gb / average_every all-reduced each step over "
          "cross_group_gbps: flat in the groups; model averaging, not the one job's step: bench_embedding_sync.py "
          "measures what it costs in quality). torchft-like carries no embedding cost: torchft has no "
          "sharded-embedding sync (its figure is a dense model's).")


def writable(path: Path) -> Path:
    """``path`` with its parent directories created (one-line ``SimError`` if that fails)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SimError(f"{path}: cannot create its directory ({exc.strerror})") from None
    return path


def check_plot_path(path: Path) -> None:
    """Before the simulations: ``--plot`` names a file of a format matplotlib writes (its suffix: without one it
    would write ``<path>.png`` and say ``<path>``), its directory made; else one-line ``SimError``."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.is_dir():
        raise SimError(f"--plot {path}: a directory; name the image file (e.g. {path / 'ettr.png'})")
    if path.suffix.lstrip(".").lower() not in formats:
        raise SimError(f"--plot {path}: name a .png, .pdf or .svg file (a format matplotlib writes)")
    writable(path)


def write_text(path: Path, text: str) -> None:
    try:
        writable(path).write_text(text)
    except OSError as exc:
        raise SimError(f"{path}: cannot write ({exc.strerror})") from None


def run_simulate(results: Path, gpus: int, replicas: int | None, failures: int, seed: int,
                 overrides: dict[str, float], projection: bool, plot: Path | None, quick: bool,
                 fresh_gates: bool = False) -> dict[str, Any]:
    """The whole command; returns what ``--json`` writes."""
    v = with_overrides(inputs(results), overrides)
    check_scenarios(v, gpus, replicas, (SCALES if projection else ()) + (CURVE if plot else ()))
    if plot is not None:
        from freescale.plotting import pyplot

        pyplot()  # matplotlib missing: one line now, not after the simulations
        check_plot_path(plot)
    gates = gates_first(quick, use_cache=not fresh_gates)
    print_inputs(v)
    cluster, policies = scenario(gpus, v, replicas)
    outs = compare(cluster, policies, failures, seed)
    rows = policy_rows(gpus, cluster, policies, outs, v)
    print(f"{gpus:,} GPUs as {cluster.replicas} replica groups of {cluster.gpus_per_replica:,}, {failures:,} "
          f"crash/hang failures simulated (seed {seed}):")
    print_results(rows)
    doc: dict[str, Any] = {"gates": [g.row() for g in gates], "inputs": inputs_json(v), "rows": rows,
                           "comparison": ft_comparison(rows, v)}
    print_comparison(doc["comparison"])
    if projection:
        print(f"\nprojection at {', '.join(f'{n:,}' for n in SCALES)} GPUs:")
        doc["projection"] = project(v, SCALES, failures, seed)
        print_results(doc["projection"])
        doc["projection_comparison"] = ft_comparison(doc["projection"], v)
        print_comparison(doc["projection_comparison"])
        doc["degraded"] = print_degraded(v, failures, seed)
    if plot is not None:
        from freescale.sim.plot import plot_projection

        curve = project(v, CURVE, failures, seed)
        doc["curve"] = curve
        plot_projection(curve, plot, "ETTR by simulation: measured parameters of this repository + labelled "
                                     "assumptions (benchmarks/results/ettr.json lists each)")
        print(f"\nwrote {plot}")
    return doc


DEGRADED_SCALES = (16_384, 98_304)


def print_degraded(v: dict[str, Sourced], failures: int, seed: int) -> list[dict[str, Any]]:
    """No spare pool (``project.degraded_scenario``): groups that wait for a lost GPU's repair against groups that
    shrink, beside NTP's published figure for the same failed fraction."""
    fraction = v["failed_fraction"].value
    print(f"\nno spare pool: a lost GPU's slot back after {fraction / v['failures_per_gpu_hour'].value:,.1f} h, so "
          f"{100 * fraction:g}% of GPUs are down on average, at {', '.join(f'{n:,}' for n in DEGRADED_SCALES)} GPUs:")
    rows = project(v, DEGRADED_SCALES, failures, seed, degraded_scenario)
    print_results(rows)
    print(f"NTP (arXiv 2504.06095, its abstract): with {100 * fraction:g}% of GPUs failed, a job of high tensor-parallel "
          "degree loses nearly 10% of its throughput; a replica under NTP contributes in proportion to its working "
          f"GPUs (about {100 * fraction:g}% lost; its power-boosted racks: near zero).  Published, not simulated here.")
    return rows


def inputs_json(v: dict[str, Sourced]) -> dict[str, Any]:
    return {k: {"value": s.value, "kind": s.kind, "source": s.source} for k, s in v.items()}


def throughput_run(v: dict[str, Sourced], gpus: int, hours: float, seed: int) -> list[Any]:
    """The four policies over ``hours`` of one trace (for the throughput-over-time plot)."""
    cluster, policies = scenario(gpus, v)
    return compare(cluster, policies, 0, seed, horizon_s=hours * 3600, bins=int(hours * 12))
