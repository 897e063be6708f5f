"""A replica group that loses a rank for good: shrink (train on the ranks left) against restart and drop.

Measured (CPU ranks, ``freescale launch --replicas G``, the same data and seed in every run, side by side in
one run): ``--groups`` groups of ``--ranks`` ranks, rank 1 of the last group SIGKILLed at step ``--kill-at``
(``FREESCALE_FAULTS``), under

- ``shrink`` (``--on-rank-loss shrink``, no restarts): the group re-forms at once on the ranks it has left
  (the whole group's plan, the lost rank's table shards moved; ``freescale/shrunk_plan.py``), catches up from
  its peers and trains a share in proportion to its ranks;
- ``drop`` (no restarts): the group is gone; the others train the whole global batch.  This is also
  ``restart`` while no spare GPU has arrived: the group waits with nothing to train on;
- ``restart`` (``--max-restarts 1``, the lost rank's slot back at once): the best a spare pool allows, an
  upper bound (a dead GPU with no spare cannot do it).

Every rank's compute is stretched ``--device-factor`` times by waiting (the ``device`` fault of
``freescale/testing.py``: a step's time in proportion to the rank's samples, the host's cores left free), so
the job's throughput follows the ranks that train, as on GPUs, rather than the 2 cores the ranks share (a
lost rank would otherwise hand its core to the others).  Per run: the job's samples per second over the
steps after the kill (``sps``; ``vs_healthy``: against a run without a kill, over the same steps) and over
the steps after the degraded group's first contributing commit (``sps_after``: the job at its new shape; from
the kill for ``drop``), the time from the kill to that commit (``to_first_commit_s``), the bytes its rank 0
fetched to catch up, and the rank slots training the last step (``slots``).

    python benchmarks/bench_degraded.py [--quick] [--repeats 3] [--json benchmarks/results/degraded_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import write_json

from freescale.tables import print_table

REPO = Path(__file__).resolve().parents[1]
POLICIES = {"shrink": ["--on-rank-loss=shrink", "--max-restarts=0"], "drop": ["--max-restarts=0"],
            "restart": ["--max-restarts=1"]}


def run(data: Path, out: Path, args: argparse.Namespace, policy: str | None) -> dict[str, Any]:
    """One ``freescale launch`` (``policy`` None: no kill); its measures from the groups' logs."""
    from freescale.report.logs import read_run

    faults = f"*:*:0:device:{args.device_factor}"
    if policy is not None:
        faults = f"{args.groups - 1}:1:{args.kill_at}:reduce,{faults}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FREESCALE_FAULTS": faults}
    cmd = [sys.executable, "-m", "freescale.cli", "launch", f"--replicas={args.groups}",
           f"--ranks-per-replica={args.ranks}", *POLICIES.get(policy or "drop", []),
           "--config", str(REPO / "configs" / f"tiny_{args.model_kind}.toml"), f"--data.path={data}",
           f"--train.output_dir={out}", f"--train.steps={args.steps}", f"--data.batch_size={args.batch}",
           "--train.eval=false", "--train.progress=false", "--checkpoint.every=0", "--checkpoint.save_final=false",
           "--train.log_every=50"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 and not (policy == "drop" and f"replica group {args.groups - 1} exited" in proc.stderr):
        raise SystemExit(f"bench_degraded: a {policy} run failed:\n{proc.stderr[-3000:]}")
    logs = read_run(out)
    first = logs.groups[0].commits  # group 0 never fails: every step, with its time
    batch = args.batch * args.groups * args.ranks
    row: dict[str, Any] = {"sps": _rate([c for c in first if c["step"] > args.kill_at], batch)}
    hit = logs.groups[-1]
    kill = logs.kills[0].time if logs.kills else None
    catch = hit.catch_ups[-1] if hit.catch_ups else None
    back = [c for c in hit.commits if kill is not None and c["time"] > kill and c.get("contributing")]
    if kill is not None and catch is not None and back:
        row["to_first_commit_s"] = back[0]["time"] - kill
        row["fetched_bytes"] = catch.get("bytes")
    # Once the degraded group trains again (or, dropped, from the kill on): the job's rate at its new shape.
    since = back[0]["step"] if back else args.kill_at + 1
    row["sps_after"] = _rate([c for c in first if c["step"] > since], batch)
    last = first[-1]
    sizes = dict(enumerate([args.ranks] * args.groups))
    sizes.update({g.group: s[-1][0] for g in logs.groups if (s := g.sizes())})
    row["slots"] = sum(sizes[int(rid[len("replica"):])] for rid in last.get("participants", []))
    return row


def _rate(commits: list[dict[str, Any]], batch: int) -> float:
    """Samples per second between the first and the last of ``commits`` (each step trains ``batch``)."""
    if len(commits) < 2:
        return float("nan")
    return batch * (len(commits) - 1) / (commits[-1]["time"] - commits[0]["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 groups, one repeat, short runs (< 60 s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model-kind", default="dlrm", choices=["dlrm", "hstu"])
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--device-factor", type=float, default=8.0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--json", help="write rows, machine and parameters to this path")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.groups, args.steps, args.kill_at, args.policies = 1, 2, 60, 5, ["shrink"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        from freescale.dataloader import SyntheticSpec, generate

        generate(data, SyntheticSpec(rows=max(40_000, args.batch * args.groups * args.ranks * 60), eval_rows=1_024,
                                     seed=0))
        for repeat in range(args.repeats):
            healthy = run(data, Path(tmp) / f"healthy{repeat}", args, None)
            rows.append({"repeat": repeat, "policy": "healthy", **healthy, "vs_healthy": 1.0, "after_vs_healthy": 1.0})
            for policy in args.policies:
                got = run(data, Path(tmp) / f"{policy}{repeat}", args, policy)
                rows.append({"repeat": repeat, "policy": policy, **got, "vs_healthy": got["sps"] / healthy["sps"],
                             "after_vs_healthy": got["sps_after"] / healthy["sps"]})
    print(f"\n{args.groups} groups x {args.ranks} ranks, rank 1 of group {args.groups - 1} killed at step {args.kill_at}")
    print_table(rows, ["repeat", "policy", "sps", "vs_healthy", "sps_after", "after_vs_healthy", "slots",
                       "to_first_commit_s", "fetched_bytes"])
    if args.json:
        params = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, "bench_degraded", params, rows)


if __name__ == "__main__":
    main()
