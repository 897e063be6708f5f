"""The two ways fused embedding tables stay in step across replica groups, side by side: quality and cost.

``[ft] embedding_sync = "union"`` (``ft/sparse_sync.py``): every group applies every group's row gradients
at each committed step, the update of one job over all groups' samples; per step a rank all-gathers R
groups' ids and gradients and runs fbgemm over their union (work and bytes grow with R).
``"average"`` (``ft/sparse_average.py``): each group updates its tables with its own gradients, and
``1/N`` of every table (weights and row-wise Adagrad state) is averaged across the groups each step
(``--every``: the values of N); per step a rank all-reduces ``1/N`` of its tables (bytes flat in R).

Each configuration trains the tiny DLRM (``configs/tiny_dlrm.toml``) as ``--groups`` groups of one rank
under ``freescale launch --replicas`` on the same synthetic data (200,000 rows, ``--seeds`` seeds: the
data, the initialisation and the data order), beside the same global batch as one job of as many ranks
without fault tolerance (its tables sharded, the reference the union equals up to rounding).  Per row:
eval AUC and log loss after ``--steps`` steps (mean over seeds, [min..max]; under ``average`` with N > 1
each group evaluates its own tables: group 0's), the mean train loss of the last 10% of steps, the
median step time after the first 10 steps, the median time of the exchange (reduction, embedding
exchange and vote) and the embedding exchange's buffer per step (``exchange_bytes``: the union's every
participant's gathered step, this group's own included; the average's summed slice).

Then the bytes at scale, counted, not run: a rank holding ``--table-mb`` of one table's rows (dim
``--dim``, row-wise Adagrad: one more float per row) and looking up ``--bags`` bags of ``--per-bag``
ids a step (``bench_union_update.py``'s default shape): the union receives ``(R - 1) x (ids x 8 + bags x
dim x 4)`` bytes a step, the average ``2 (R - 1) / R x table / N`` (a ring all-reduce), for R up to 64.

    python benchmarks/bench_embedding_sync.py [--quick] [--groups 2] [--every 1,16,256] [--users 5000] [--json PATH]

``--users 2000000`` makes the user table 128 MB (the item table stays 2,000 rows): what the average moves
each step then dominates its exchange, which measures its cost against N on this machine's loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import write_json

from freescale.tables import print_table

REPO = Path(__file__).resolve().parents[1]


def dataset(root: Path, seed: int, users: int) -> Path:
    from freescale.dataloader import SyntheticSpec, generate

    path = root / f"data{seed}"
    if not (path / "dataset.json").exists():
        generate(str(path), SyntheticSpec(rows=200_000, eval_rows=16_384, num_users=users, seed=seed))
    return path


def train(data: Path, out: Path, groups: int, steps: int, seed: int, sync: str | None) -> dict[str, Any]:
    """One run: ``groups`` groups of one rank with ``sync`` (``union`` or ``average:N``), or (None) one job
    of ``groups`` ranks without fault tolerance."""
    common = ["--config", "configs/tiny_dlrm.toml", f"--data.path={data}", "--data.batch_size=128",
              f"--train.steps={steps}", f"--train.output_dir={out}", "--train.progress=false",
              "--checkpoint.every=0", "--checkpoint.save_final=false", f"--train.seed={seed}", "--train.log_every=1"]
    if sync is None:
        cmd = ["launch", f"--nproc-per-node={groups}", *common]
    else:
        kind, _, every = sync.partition(":")
        cmd = ["launch", "--replicas", str(groups), "--ranks-per-replica", "1", "--max-restarts", "0", *common,
               "--ft.embedding_sync", kind, *(["--ft.average_every", every] if every else [])]
    proc = subprocess.run([sys.executable, "-m", "freescale.cli", *cmd], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"bench_embedding_sync: {sync or 'job'} failed:\n{proc.stderr[-3000:]}")
    log_path = out / ("replica0" if sync else "") / "train_log.jsonl"
    log = [json.loads(line) for line in log_path.read_text().splitlines()]
    (evaluation,) = [e for e in log if e["event"] == "eval"]
    commits = [e for e in log if e["event"] == "commit"]
    tail = commits[-max(1, steps // 10):]
    losses = [e["loss"] for e in log if e["event"] == "step" and e.get("loss") is not None][-max(1, steps // 10):]
    return {"auc": evaluation["auc"], "logloss": evaluation["loss"],
            "train_loss": statistics.fmean(losses) if losses else float("nan"),
            "step_ms": 1e3 * statistics.median(e["seconds"] for e in commits[10:]),
            "exchange_ms": 1e3 * statistics.median(e.get("exchange_s", 0.0) for e in commits[10:]),
            "exchange_kb": statistics.median(e.get("exchange_bytes", 0) for e in tail) / 1e3}


def spread(values: list[float], digits: int = 4) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}..{max(values):.{digits}f}]"


def quality_rows(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    configs: list[tuple[str, str | None]] = [("job, no FT", None), ("union", "union")]
    configs += [(f"average, N = {n}", f"average:{n}") for n in args.every]
    rows = []
    for groups in args.groups:
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
        for seed in args.seeds:
            data = dataset(root, seed, args.users)
            for name, sync in configs:  # interleaved: each seed runs every configuration back to back
                out = root / f"g{groups}_s{seed}_{(sync or 'job').replace(':', '')}"
                runs[name].append(train(data, out, groups, args.steps, seed, sync))
        for name, sync in configs:
            got = runs[name]
            rows.append({"groups": groups, "sync": name, "auc": spread([r["auc"] for r in got]),
                         "logloss": spread([r["logloss"] for r in got]),
                         "train_loss": spread([r["train_loss"] for r in got]),
                         "step_ms": round(statistics.median(r["step_ms"] for r in got), 2),
                         "exchange_ms": round(statistics.median(r["exchange_ms"] for r in got), 2) if sync else "",
                         "exchange_kb": round(statistics.median(r["exchange_kb"] for r in got), 1) if sync else "",
                         "raw": got})
    return rows


def scale_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows_held = int(args.table_mb * 1e6 / (args.dim * 4))
    table = rows_held * (args.dim + 1) * 4  # weights and row-wise Adagrad's one float per row
    step = args.bags * args.per_bag * 8 + args.bags * args.dim * 4
    rows = []
    for groups in (2, 4, 8, 12, 16, 32, 64):
        row: dict[str, Any] = {"groups": groups, "union_MB": round((groups - 1) * step / 1e6, 2)}
        for n in args.every:
            row[f"average_N{n}_MB"] = round(2 * (groups - 1) / groups * table / n / 1e6, 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="2", help="replica group counts (one rank each), comma-separated")
    parser.add_argument("--every", default="1,16,256", help="average_every values N, comma-separated")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--users", type=int, default=5_000,
                        help="rows of the user table (dim 16): its size sets what the average moves each step")
    parser.add_argument("--table-mb", type=float, default=512.0, help="one table's rows a rank holds, MB (at scale)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--bags", type=int, default=4096)
    parser.add_argument("--per-bag", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="one seed, 120 steps, N = 1 and 16")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.every = 120, "0", "1,16"
    args.groups = [int(g) for g in args.groups.split(",")]
    args.every = [int(n) for n in args.every.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_embedding_sync_") as tmp:
        quality = quality_rows(args, Path(tmp))
    print(f"\nQuality and step cost: tiny DLRM ({args.users:,} users), groups of one rank, batch 128 per rank, "
          f"{args.steps} steps, seeds {args.seeds} (mean [min..max])")
    print_table(quality, ["groups", "sync", "auc", "logloss", "train_loss", "step_ms", "exchange_ms", "exchange_kb"])
    scale = scale_rows(args)
    print(f"\nBytes a rank receives per step, counted: {args.table_mb:.0f} MB of rows (dim {args.dim}) held, "
          f"{args.bags} bags x {args.per_bag} ids looked up")
    print_table(scale, list(scale[0]))
    if args.json:
        write_json(args.json, "bench_embedding_sync", {k: v for k, v in vars(args).items() if k != "json"},
                   [{"kind": "measured", **r} for r in quality] + [{"kind": "counted", **r} for r in scale])


if __name__ == "__main__":
    main()
