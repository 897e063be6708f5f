"""A slow rank: how much of the lost throughput planning by speed wins back, how fast it is found, and false flags.

Measured (CPU ranks, ``freescale launch``, the same data and seed in every run, side by side in one run):
one rank's compute made ``f`` times slower from step ``--slow-from`` (the ``compute`` fault: its own CPU work
stretched in proportion, ``freescale/testing.py``), with ``balance.slow_policy = report`` (the slow rank sets
the pace) and ``= rebalance`` (``freescale/rank_speed.py``: planned at a smaller share), beside a healthy
run.  Throughput is samples per second of the steps from ``--measure-from`` on (commit records' seconds).

- ``report_vs_healthy``: how much of the healthy throughput is left when the slow rank sets the pace;
  ``rebalance_vs_report``: what planning by speed changes.  (The fraction of the loss recovered needs the
  throughput of an ideal proportional split, which depends on how much of a step the slowdown stretches:
  on a machine where the ranks share the cores it is not ``healthy * (n - 1 + 1/f) / n``, so it is not
  computed here; the modelled part gives it for the planner alone.)
- ``detect_steps``: steps from the slowdown to the ``fail_slow`` event.  Target <= 20.
- ``false_flags``: ``fail_slow`` events of a healthy run (``--false-flag-steps`` steps, with a busy process
  beside the ranks when ``--background``).  Target 0.
- ``kind``: ``compute`` (the rank's own work stretched, spinning its CPU), ``device`` (stretched by waiting,
  counted as busy: a throttled accelerator, the host's cores left to the others: on this machine, where the
  ranks share 2 cores, the cleaner of the two) or ``data`` (its data loading: the ``data`` fault
  stretches reading and assembling its batch, ``--data-factor`` times; the fixed part of a step's loading,
  its plan, is not stretched).

Replica groups (``groups``: ``--groups`` groups of one rank under fault tolerance, the last one's device
``--group-factor`` times slower from ``--slow-from``): the job's throughput (every group's samples per
second of the measured steps) when the slow group sets the pace (``report``), when every group plans it at
a smaller share (``rebalance``: its speed table carried in the FTAR header, ``freescale/speed_share.py``),
and when it is evicted (``evict``, no restart: the survivors train the whole global batch).

Modelled (the balance model: the planner and partitioner alone, no training, the true speeds known, no
fixed work per step: an upper bound on what planning can recover): at R ranks, a global batch of
heavy-tailed lengths costed with the HSTU cost model, one rank ``f`` times slower; the step's time is the
slowest rank's cost / speed.  ``recovered`` = (report - rebalanced) / (report - ideal) step time, ``ideal`` =
total cost / sum(speeds).  Target >= 0.8.

    python benchmarks/bench_stragglers.py [--quick] [--repeats 3] [--json benchmarks/results/stragglers_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import write_json

from freescale.tables import print_table

REPO = Path(__file__).resolve().parents[1]


def train(data: Path, out: Path, args: argparse.Namespace, policy: str, factor: float, steps: int,
          background: bool = False, kind: str = "compute", groups: int = 0) -> dict[str, Any]:
    """One ``freescale launch`` run (``groups``: that many replica groups of one rank, the last one slowed);
    its (first group's) log's measures."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FREESCALE_AUDIT": "1"}
    if factor > 1.0:
        slowed = f"{groups - 1}:0" if groups else f"0:{args.nproc - 1}"
        env["FREESCALE_FAULTS"] = f"{slowed}:{args.slow_from}:{kind}:{factor}"
    shape = [f"--replicas={groups}", "--ranks-per-replica=1", "--max-restarts=0"] if groups else \
        [f"--nproc-per-node={args.nproc}"]
    cmd = [sys.executable, "-m", "freescale.cli", "launch", *shape,
           "--config", str(REPO / "configs" / f"tiny_{args.model_kind}.toml"), f"--data.path={data}",
           f"--train.output_dir={out}", f"--train.steps={steps}", f"--data.batch_size={args.batch}",
           "--train.eval=false", "--train.progress=false", "--checkpoint.every=0", "--checkpoint.save_final=false",
           f"--balance.slow_policy={policy}", "--train.log_every=50", f"--data.prefetch={args.prefetch}"]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if background else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    evicted = policy == "evict" and "evicted as fail-slow" in proc.stderr  # (no restart: the job says a group failed)
    if proc.returncode != 0 and not evicted:
        raise SystemExit(f"bench_stragglers: a {policy} run failed:\n{proc.stderr[-3000:]}")
    log = [json.loads(line) for line in (out / ("replica0" if groups else "") / "train_log.jsonl").read_text().splitlines()]
    commits = [e for e in log if e["event"] == "commit" and e["step"] >= args.measure_from]
    flags = [e for e in log if e["event"] == "fail_slow"]  # (rank 0 writes every rank's)
    seconds = sum(e["seconds"] for e in commits)
    late = [e["rank_sizes"] for e in commits]
    samples = sum(sum(e["rank_sizes"]) if groups else e["samples"] for e in commits)  # groups: every group's
    return {"samples_per_s": samples / seconds if seconds else float("nan"),
            "step_ms": 1e3 * seconds / max(len(commits), 1), "flags": flags,
            "slow_rank_share": (sum(s[-1] for s in late) / max(sum(sum(s) for s in late), 1)) if late else float("nan")}


def measured(args: argparse.Namespace, data: Path, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    cases = [(kind, f) for kind in args.kinds for f in args.factors] + [("data", f) for f in args.data_factor]
    for repeat in range(args.repeats):
        healthy = train(data, tmp / f"healthy{repeat}", args, "report", 1.0, args.steps)
        for kind, factor in cases:
            runs = {policy: train(data, tmp / f"{policy}{kind}{factor}-{repeat}", args, policy, factor, args.steps,
                                  kind=kind) for policy in ("report", "rebalance")}
            report, rebalanced = runs["report"]["samples_per_s"], runs["rebalance"]["samples_per_s"]
            flag = [e for e in runs["rebalance"]["flags"] if e["rank"] == args.nproc - 1]
            rows.append({
                "part": "measured", "repeat": repeat, "ranks": args.nproc, "kind": kind, "factor": factor,
                "healthy_sps": healthy["samples_per_s"], "report_sps": report, "rebalance_sps": rebalanced,
                "report_vs_healthy": report / healthy["samples_per_s"], "rebalance_vs_report": rebalanced / report,
                "slow_share_report": runs["report"]["slow_rank_share"],
                "slow_share_rebalance": runs["rebalance"]["slow_rank_share"],
                "detect_steps": flag[0]["step"] - args.slow_from if flag else None,
                "false_flags": len(healthy["flags"]) + sum(1 for r in runs.values() for e in r["flags"]
                                                           if e["rank"] != args.nproc - 1),
            })
    return rows


def replica_groups(args: argparse.Namespace, data: Path, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for repeat in range(args.repeats):
        healthy = train(data, tmp / f"g-healthy{repeat}", args, "report", 1.0, args.steps, groups=args.groups)
        runs = {policy: train(data, tmp / f"g-{policy}{repeat}", args, policy, args.group_factor, args.steps,
                              groups=args.groups, kind=args.group_kind) for policy in ("report", "rebalance", "evict")}
        flag = [e for e in runs["rebalance"]["flags"] if e["group"] == args.groups - 1]
        rows.append({"part": "groups", "repeat": repeat, "groups": args.groups, "kind": args.group_kind,
                     "factor": args.group_factor,
                     "healthy_sps": healthy["samples_per_s"],
                     **{f"{policy}_sps": run["samples_per_s"] for policy, run in runs.items()},
                     **{f"{policy}_vs_report": run["samples_per_s"] / runs["report"]["samples_per_s"]
                        for policy, run in runs.items() if policy != "report"},
                     "detect_steps": flag[0]["step"] - args.slow_from if flag else None,
                     "false_flags": len(healthy["flags"])})
    return rows


def false_flags(args: argparse.Namespace, data: Path, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for background in (False, True):
        start = time.perf_counter()
        run = train(data, tmp / f"long{int(background)}", args, "report", 1.0, args.false_flag_steps, background)
        rows.append({"part": "false_flags", "steps": args.false_flag_steps, "background_load": background,
                     "false_flags": len(run["flags"]), "wall_s": time.perf_counter() - start})
    return rows


def modelled(args: argparse.Namespace) -> list[dict[str, Any]]:
    from freescale.dataloader.cost import CostModel
    from freescale.dataloader.partition import partition

    rng = np.random.default_rng(0)
    model = CostModel(1.0, 64.0, 512.0)  # attention L^2, per-token and per-sample terms of a mid-sized HSTU
    rows = []
    for ranks in args.model_ranks:
        lengths = np.clip(np.rint(19.1 + 43.2 * rng.lognormal(0, 1.608, 32 * ranks)), 1, 1024)
        costs = model(lengths.astype(np.int64))
        plain = partition("lpt", costs, None, ranks).sums(costs)
        for factor in args.factors:
            speeds = np.ones(ranks)
            speeds[-1] = 1.0 / factor
            start = time.perf_counter()
            planned = partition("lpt", costs, None, ranks, False, speeds).sums(costs)
            plan_ms = 1e3 * (time.perf_counter() - start)
            report, rebalanced, ideal = (plain / speeds).max(), (planned / speeds).max(), costs.sum() / speeds.sum()
            rows.append({"part": "modelled", "ranks": ranks, "factor": factor,
                         "step_report": report / ideal, "step_rebalance": rebalanced / ideal,
                         "recovered": (report - rebalanced) / (report - ideal), "plan_ms": plan_ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one factor, one repeat, short runs (< 60 s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model-kind", default="dlrm", choices=["dlrm", "hstu"])
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    parser.add_argument("--prefetch", type=int, default=0, help="data.prefetch (0: the loader's work is the rank's own)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--slow-from", type=int, default=10)
    parser.add_argument("--measure-from", type=int, default=40)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--kinds", nargs="+", default=["compute", "device"], choices=["compute", "device"],
                        help="compute: the slow rank spins (its cores are busy: on a shared machine the others slow "
                             "too); device: it waits, as on a throttled accelerator, and the others keep the cores")
    parser.add_argument("--group-kind", default="device", choices=["compute", "device"])
    parser.add_argument("--data-factor", type=float, nargs="*", default=[20.0],
                        help="the data fault's factors (the data's part of a step is small: it takes a large one)")
    parser.add_argument("--groups", type=int, default=3, help="replica groups of the groups part (0: none)")
    parser.add_argument("--group-factor", type=float, default=3.0,
                        help="a group of one rank spends part of its step in the cross-group exchange, which the "
                             "compute fault does not stretch: 3 makes its steps about 2x as long")
    parser.add_argument("--false-flag-steps", type=int, default=1000)
    parser.add_argument("--model-ranks", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--json", help="write rows, machine and parameters to this path")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.factors, args.steps, args.measure_from, args.kinds = 1, [2.0], 50, 30, ["device"]
        args.false_flag_steps, args.model_ranks, args.data_factor, args.groups = 0, [256], [], 0
    rows = modelled(args)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        from freescale.dataloader import SyntheticSpec, generate

        generate(data, SyntheticSpec(rows=max(40_000, args.batch * args.nproc * 50), eval_rows=1_024, seed=0))
        rows += measured(args, data, Path(tmp))
        if args.groups:
            rows += replica_groups(args, data, Path(tmp))
        if args.false_flag_steps:
            rows += false_flags(args, data, Path(tmp))
    for part, columns in (("modelled", ["ranks", "factor", "step_report", "step_rebalance", "recovered", "plan_ms"]),
                          ("measured", ["repeat", "ranks", "kind", "factor", "healthy_sps", "report_sps", "rebalance_sps",
                                        "report_vs_healthy", "rebalance_vs_report", "slow_share_report",
                                        "slow_share_rebalance", "detect_steps", "false_flags"]),
                          ("groups", ["repeat", "groups", "kind", "factor", "healthy_sps", "report_sps", "rebalance_sps",
                                      "evict_sps", "rebalance_vs_report", "evict_vs_report", "detect_steps",
                                      "false_flags"]),
                          ("false_flags", ["steps", "background_load", "false_flags", "wall_s"])):
        chosen = [r for r in rows if r["part"] == part]
        if chosen:
            print(f"\n{part}")
            print_table(chosen, columns)
    if args.json:
        params = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, "bench_stragglers", params, rows)


if __name__ == "__main__":
    main()
