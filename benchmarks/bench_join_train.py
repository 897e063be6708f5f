"""``freescale train``'s two joins side by side: a killed group restarted, ``[ft] join = "record"`` against ``"wait"``.

Real processes through the real CLI (``freescale launch --replicas 3 --nproc-per-node 1 --max-restarts 1``), CPU
and gloo, the tiny model of ``configs/tiny_<model>.toml`` on a synthetic dataset, the pipeline ``--pipeline`` (the
plain one by default: it plans each step at the commit before it; torchrec's hold two batches planned ahead).
Group 2's rank SIGKILLs itself as step K's exchange begins; torch's elastic agent restarts it and it catches up
from a peer:

- ``record`` (the default): it sits the step in progress out with weight 0, records it while its snapshot arrives,
  replays it, and is planned into a step once a commit says it holds valid state;
- ``wait``: the vote of the step before names it as joining, so that commit plans it into the step it joins (with
  torchrec's pipelines, the second one after it: the steps between were planned before); it waits for the snapshot
  of the step before, reads its share of the step planned with it and trains it.

Per run: first request for state -> first contributing commit (the issue's measure; the restarted group's own
clock), the steps between the one it joined and the first it contributed to, its weight in the joined step, kill ->
first contributing commit (agent restart, imports, sharding included), the survivors' extra time over the steps
from the one it joined to its first contributing one, beyond their step before the kill (replica 0; with the plain
pipeline one step for a waiting join, three for a recording one, two more each behind torchrec's pipelines: a ratio
of step times would compare unlike windows), and the transfer.  Joins interleaved, ``--repeats`` rounds;
medians with [min..max] and each run's figure in the JSON.  torchft has no torchrec integration: nothing of its runs
here (``bench_ft.py`` compares the joins with torchft on a model of its own).

    python benchmarks/bench_join_train.py [--quick] [--repeats 3] [--model dlrm|hstu] [--pipeline plain|torchrec|prioritized]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from bench_ft_torchrec import analyse_kill
from common import write_json
from ft_torchrec_runs import committed, launch

from freescale.tables import print_table

JOINS = ("record", "wait")
MEASURES = (("request_to_contributing_s", "first request -> first contributing commit", "s"),
            ("steps_to_contributing", "steps from the one joined to the first contributed to", ""),
            ("joined_weight", "its samples in the step it joined", ""),
            ("contributing_s", "kill -> first contributing commit", "s"),
            ("survivors_extra_ms", "survivors' extra time over the catch-up's steps (vs their step before the kill)",
             "ms"),
            ("last_byte_s", "first request -> snapshot's last byte", "s"))


def one_run(tmp: Path, data: Path, args: argparse.Namespace, join: str, round_: int) -> dict[str, Any]:
    fault = f"2:0:{args.kill_step}:reduce:0"
    out = tmp / f"{join}-{round_}"
    wall = launch(out, data, args.model, args.batch, args.steps, nproc=1, replicas=3, max_restarts=1, fault=fault,
                  pipeline=args.pipeline, extra=("--ft.join", join))
    res = analyse_kill(out, args.steps, args.kill_step, fault, wall)
    caught = res.get("catch_up")
    if not caught or "first_contributing_step" not in res:
        return {"join": join, "why": "the restarted group never contributed again (raise --steps)"}
    restarted = {e["step"]: e for e in committed(out / "replica2" / "train_log.jsonl")}
    first = restarted[res["first_contributing_step"]]
    joined = restarted.get(res["joined_step"], {})
    return {"join": join, "logged_join": caught.get("join", "record"),
            "request_to_contributing_s": first["time"] - caught["started"],
            "steps_to_contributing": res["first_contributing_step"] - res["joined_step"],
            "joined_weight": joined.get("weight", 0.0), "contributing_s": res["contributing_s"],
            # over the steps from the one it joined to its first contributing one (with the plain pipeline one for a
            # waiting join, three for a recording one): what those steps took beyond the survivors' step before the
            # kill, in all
            "survivors_extra_ms": (res["during_ms"] - res["before_ms"])
            * (res["first_contributing_step"] - res["window_first_step"] + 1),
            "last_byte_s": caught["arrived"] - caught["started"], "bytes": caught.get("bytes"),
            "kill_s": res["kill_s"], "discarded": res["discarded"]}


def rows_of(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for key, measure, unit in MEASURES:
        row: dict[str, Any] = {"measure": measure}
        for join in JOINS:
            values = [r[key] for r in runs[join] if key in r]
            if not values:
                row[join] = "never contributed again"
                continue
            median, lo, hi = float(np.median(values)), min(values), max(values)
            row[join] = f"{median:.3g}{' ' + unit if unit else ''} [{lo:.3g}..{hi:.3g}]"
            row[f"{join}_each"] = values
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, fewer steps")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (each join once per round)")
    parser.add_argument("--model", choices=["dlrm", "hstu"], default="dlrm")
    parser.add_argument("--batch", type=int, default=128, help="rows per rank per step")
    parser.add_argument("--num-items", type=int, default=20_000, help="synthetic item vocabulary (the snapshot's size)")
    parser.add_argument("--steps", type=int, help="steps of each run (default 800, quick 400): the restarted group "
                                                  "must be back before the end")
    parser.add_argument("--kill-step", type=int, default=30)
    parser.add_argument("--pipeline", choices=["plain", "torchrec", "prioritized"], default="plain")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.steps = args.steps or (400 if args.quick else 800)
    repeats = 1 if args.quick else args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="bench_join_train"))
    runs: dict[str, list[dict[str, Any]]] = {join: [] for join in JOINS}
    try:
        from freescale.dataloader import SyntheticSpec, generate

        data = tmp / "data"
        generate(data, SyntheticSpec(rows=40_000, eval_rows=0, num_items=args.num_items, row_group_size=4_096, seed=0))
        for round_ in range(repeats):
            for join in (JOINS if round_ % 2 == 0 else JOINS[::-1]):
                runs[join].append(one_run(tmp, data, args, join, round_))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = rows_of(runs)
    print_table(rows, ["measure", *JOINS])
    print("each run's join as its catch-up record says: " + "; ".join(
        f"{join}: {', '.join(r.get('logged_join', r.get('why', '?')) for r in runs[join])}" for join in JOINS))
    if args.json:
        write_json(args.json, "bench_join_train", {
            "quick": args.quick, "repeats": repeats, "model": args.model, "config": f"configs/tiny_{args.model}.toml",
            "batch_per_rank": args.batch, "num_items": args.num_items, "steps": args.steps, "kill_step": args.kill_step,
            "launch": f"launch --replicas 3 --nproc-per-node 1 --max-restarts 1, pipeline.kind = {args.pipeline}",
            "pipeline": args.pipeline,
            "runs": runs}, rows)


if __name__ == "__main__":
    main()
