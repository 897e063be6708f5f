"""Fault tolerance on a torchrec model: per-step overhead, stall per failure, catch-up.

Everything runs as real processes through the real CLI (``python -m freescale.cli launch``),
on CPU with gloo, one compute thread per rank (``OMP_NUM_THREADS=1``, as the tests run it),
the tiny DLRM by default (``--model hstu``: the tiny HSTU; ``configs/tiny_<model>.toml``),
``--batch`` rows per rank (default 128), on a synthetic dataset generated into a temporary
directory with ``freescale.dataloader.generate`` unless ``--data PATH`` is given.  torchft
has nothing to run side by side here (it has no torchrec integration): the comparison is
with freescale's own trainer without fault tolerance, the same loop and the same pipeline.

1. Per-step overhead, per pipeline kind (``--pipeline plain,torchrec,prioritized``: each is
   measured with and without fault tolerance).  ``plain`` (the column, not the pipeline):
   ``launch --nproc-per-node 2``, no fault tolerance: one job of 2 ranks, the tables sharded
   over both (input/output all-to-alls), dense gradients averaged by DDP (``prioritized``: by
   its own bucketed reducer).  ``ft``: ``launch --replicas 2 --nproc-per-node 1``: 2 replica
   groups of 1 rank (each holds whole tables) through the lighthouse: quorum request
   overlapping the forward, sample-weighted FTAR of the dense gradients during backward,
   all-gather of every table's ids and gradients for the union update, commit vote.  Same
   per-rank batch, so the same global batch and process count.  Both sides are timed the same
   way, from the one log format: median gap between consecutive ``commit`` events' ``time`` of
   replica (group) 0's log after a warm-up of 10 steps (the whole loop), and for FT the medians
   of its breakdown (``quorum_wait_s``, ``reduce_s`` = FTAR + embedding exchange, ``vote_s``).
   Runs are interleaved (every kind's plain and FT run, adjacent, their order alternating,
   then again) ``--repeats`` times; the overhead is the median of the paired differences
   (this VM's speed drifts by tens of percent within minutes: a pair shares the drift), and
   every run's value is in the JSON.  ``update built during vote``: the union's lookup,
   built while the commit vote is in flight (``freescale.ft.ftar``); ``vote exposed``: the
   vote's wait left after it.  Target: <= 1 ms or 5% per kind.  ``--replicated`` adds the like-for-like
   pair (not with the prioritized pipeline): ``replicated``, the job of 2 ranks with every table whole on
   both (``--optim.sharding data_parallel``: torchrec's lookup DDP averages the tables' dense gradients,
   row-wise Adagrad after it), and ``ft_replicated``, the 2 groups with the same tables (their dense
   gradients in FT's buckets, reduced in the group and across groups during backward; no union); the
   target is read on that pair.  ``ft`` (the union update) against ``replicated`` is shown as the union's
   cost over replicated tables.  ``--ranks G``: groups of G ranks against one job of R x G ranks (FT then
   reduces in the group and across groups).  ``--groups 2,3``: the same at R
   groups of one rank against one job of R ranks (keyed ``<kind> xR`` beyond 2); the union update's
   share grows with R (every group applies every group's lookups: ``update built during vote`` and
   the exchange).  Beyond 2 processes both sides time-share this machine's 2 cores alike.
2. Kill -> survivors' next committed step.  3 groups of 1 rank, ``--max-restarts 1``, group 2's
   rank SIGKILLs itself at the start of step K's exchange (``FREESCALE_FAULTS=2:0:K:reduce:0``,
   K=30); torch's elastic agent restarts it (new incarnation) and it catches up from a peer's
   snapshot.  Stall = time of replica0's first committed step >= K (committed after the kill)
   minus the kill time (``replica2/rank0.killed``); replica0's step K-1 can be logged after
   the kill (group 2 had already moved on), so "the first committed step after the kill" alone
   would measure nothing.  Steps discarded = steps in 0..steps-1 missing from replica0's log.
   Targets: <= 0.3 s and 0.  With 3 groups the crash is found through the survivors' failure
   reports (and the lighthouse's short suspect grace), not the heartbeat timeout (the launcher's
   3 s, printed).
3. Catch-up (same run).  Survivor step time (replica0; mean gap = window duration / steps, as
   the cost sits in one or two steps: staging the snapshot) during the catch-up window (from
   the restarted group's ``joined_step`` to its first contributing step) / before the failure
   (steps 10..K-1, 3 groups contributing).  Target: <= 1.05.  Restart -> contributing: the
   restarted group's first contributing step's time minus the kill time; that includes the
   agent noticing the death, the new process's imports, process groups and sharding, and the
   wait for the next quorum (split: kill -> catch-up started, started -> finished).  Snapshot
   transfer rate: the ``bytes_per_s`` the restarted rank measured (snapshot bytes over the
   request's start to its last byte, so the source staging the snapshot at its next step is
   in it), target >= 1 GB/s; the snapshot's size is not logged: it is estimated from the
   model's parameter count (fp32 parameters, AdamW's two moments per dense parameter, one
   row-wise Adagrad accumulator per embedding row).  With the tiny models the snapshot is
   well under 1 MB and the rate is latency, not bandwidth: ``--num-items`` grows the item table.
   Also shown: the survivors' step time while the killed group restarts (2 groups, with its
   start-up competing for the same cores).

The kill run is sized with enough steps that the restarted group (several seconds to start on
2 cores) rejoins and contributes for a while; no artificial per-step sleep is used.

    python benchmarks/bench_ft_torchrec.py [--quick] [--model dlrm|hstu] [--batch 128] [--data PATH]
                                           [--json benchmarks/results/ft_torchrec_cpu.json]
"""

from __future__ import annotations

import argparse
import inspect
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import write_json
from ft_torchrec_runs import (
    LOG_EVERY,
    PIPELINES,
    REPO,
    WARMUP,
    committed,
    launch,
    mean_gap,
    median,
)

from freescale.tables import print_table


# ---------------------------------------------------------------------------- 1. overhead
def step_ms(out: Path) -> dict[str, float]:
    """Median committed-step gap of group 0 after the warm-up, and (FT) the exchange's breakdown."""
    path = out / "replica0" / "train_log.jsonl"
    steps = [e for e in committed(path if path.exists() else out / "train_log.jsonl") if e["step"] >= WARMUP]
    times = [e["time"] for e in steps]
    res = {"step_ms": 1e3 * median(list(np.diff(times)))}
    if steps and "quorum_wait_s" in steps[0]:
        res.update({f"{k}_ms": 1e3 * median([e[f"{k}_s"] for e in steps]) for k in ("quorum_wait", "reduce", "prepare", "vote")})
        res["sync_ms"] = 1e3 * median([e["exchange_s"] for e in steps])
    return res


def case_key(kind: str, groups: int, ranks: int = 1) -> str:
    """A pipeline kind's results at ``groups`` replica groups of ``ranks`` (and ``groups x ranks`` ranks without
    FT): the kind's name at 2 x 1, as every earlier run of this benchmark keyed it."""
    return kind + ("" if groups == 2 else f" x{groups}") + ("" if ranks == 1 else f" ({ranks} ranks a group)")


REPLICATED = ("--optim.sharding", "data_parallel")
"""The like-for-like side without FT: every table whole on every rank (torchrec's data_parallel: its lookup
DDP averages the tables' dense gradients, row-wise Adagrad after backward), as FT's groups hold them."""


def overhead(tmp: Path, data: Path, args: argparse.Namespace, steps: int, repeats: int) -> dict[str, Any]:
    """Per pipeline kind: runs without FT (tables sharded; with ``--replicated`` also tables replicated,
    except for the prioritized pipeline, whose reducer covers the dense part only) and FT runs, interleaved
    across kinds and repeats; within a repeat a kind's runs are adjacent (their order reverses with the
    repeat, so a drift of the machine's speed does not favour one side), and each repeat gives one paired
    difference per side without FT."""
    def sides_of(kind: str) -> tuple[str, ...]:
        if args.replicated and kind != "prioritized":
            return ("plain", "replicated", "ft", "ft_replicated")
        return ("plain", "ft")

    cases = [(kind, groups) for kind in args.pipelines for groups in args.groups]
    ranks = args.ranks
    runs: dict[str, dict[str, list[dict[str, float]]]] = {case_key(k, g, ranks): {s: [] for s in sides_of(k)}
                                                          for k, g in cases}
    for r in range(repeats):
        for kind, groups in cases:
            key = case_key(kind, groups, ranks)
            for side in sides_of(kind)[:: 1 if r % 2 == 0 else -1]:
                out = tmp / f"{side}-{kind}-{groups}-{r}"
                if side.startswith("ft"):
                    launch(out, data, args.model, args.batch, steps, nproc=ranks, replicas=groups, pipeline=kind,
                           extra=REPLICATED if side == "ft_replicated" else ())
                else:
                    launch(out, data, args.model, args.batch, steps, nproc=groups * ranks, pipeline=kind,
                           extra=REPLICATED if side == "replicated" else ())
                runs[key][side].append(step_ms(out))
            print(f"bench_ft_torchrec: repeat {r} {key}: " + ", ".join(
                f"{side} {runs[key][side][-1]['step_ms']:.2f} ms" for side in sides_of(kind)), file=sys.stderr)
    res: dict[str, Any] = {}
    for kind, groups in cases:
        by_side = runs[case_key(kind, groups, ranks)]
        one: dict[str, Any] = {"groups": groups, "ranks": ranks}
        for side, runs_of in by_side.items():
            if side.startswith("ft"):
                one.update({f"{side}_{k}": median([f[k] for f in runs_of]) for k in runs_of[0]})
            else:
                one[f"{side}_step_ms"] = median([p["step_ms"] for p in runs_of])
            one[f"{side}_step_ms_runs"] = [f["step_ms"] for f in runs_of]
        for ft_side, base_side, prefix in PAIRS:
            if ft_side in by_side and base_side in by_side:
                base, ft = one[f"{base_side}_step_ms_runs"], one[f"{ft_side}_step_ms_runs"]
                diffs = [f - p for p, f in zip(base, ft)]
                one.update({f"{prefix}paired_diff_ms_runs": diffs, f"{prefix}overhead_ms": median(diffs),
                            f"{prefix}overhead_frac": median([d / p for d, p in zip(diffs, base)])})
        res[case_key(kind, groups, ranks)] = one
    return res


PAIRS = (("ft", "plain", ""), ("ft", "replicated", "replicated_"), ("ft_replicated", "replicated", "like_"))
"""(FT side, side without FT, key prefix) of each paired overhead: FT with the union update against tables
sharded (today's layouts), the same against tables replicated (the union's cost over replicated tables), and
``like_``: FT with the tables replicated against the job with them replicated, like for like (both reduce the
tables' dense gradients: DDP, or FT's buckets in and across groups)."""


# ---------------------------------------------------------------------------- 2./3. kill and catch-up
def kill_run(tmp: Path, data: Path, args: argparse.Namespace, steps: int, forkserver: bool = True) -> dict[str, Any]:
    k = args.kill_step
    fault = f"2:0:{k}:reduce:0"
    out = tmp / ("kill" if forkserver else "kill-plain-start")
    wall = launch(out, data, args.model, args.batch, steps, nproc=1, replicas=3, max_restarts=1, fault=fault,
                  pipeline=args.kill_pipeline, forkserver=forkserver)
    return analyse_kill(out, steps, k, fault, wall)


def analyse_kill(out: Path, steps: int, k: int, fault: str, wall: float) -> dict[str, Any]:
    """Measures 2 and 3 from a kill run's logs under ``out``."""
    killed_file = out / "replica2" / "rank0.killed"
    if not killed_file.exists():
        raise SystemExit(f"bench_ft_torchrec: the fault ({fault}) never fired")
    kill = float(killed_file.read_text())
    survivor = committed(out / "replica0" / "train_log.jsonl")
    times = {e["step"]: e["time"] for e in survivor}
    nxt = next((e for e in survivor if e["step"] >= k and e["time"] > kill), None)
    if nxt is None:
        raise SystemExit(f"bench_ft_torchrec: replica0 committed no step >= {k} after the kill")
    res: dict[str, Any] = {
        "fault": fault, "steps": steps, "wall_s": wall, "kill_s": nxt["time"] - kill, "next_step": nxt["step"],
        "next_step_attempts": nxt["attempts"], "next_step_participants": nxt["participants"],
        "discarded": len(set(range(steps)) - set(times)),
        "before_ms": 1e3 * mean_gap(times, WARMUP, k - 1),
        "before_median_ms": 1e3 * median([times[s] - times[s - 1] for s in range(WARMUP, k) if s - 1 in times
                                          and s in times]),
    }
    # Step K as each survivor committed it: a survivor that stays blocked in the dead quorum's collective
    # (no error from its peers) holds everyone until ``ft.timeout_s``; the other one shows how fast it could be.
    res["step_k"] = {f"replica{g}": {"after_kill_s": e["time"] - kill, "attempts": e["attempts"],
                                     "participants": e["participants"], "quorum_wait_ms": 1e3 * e["quorum_wait_s"],
                                     "reduce_ms": 1e3 * e["reduce_s"], "vote_ms": 1e3 * e["vote_s"],
                                     "seconds": e["exchange_s"]}
                     for g in (0, 1) for e in committed(out / f"replica{g}" / "train_log.jsonl")
                     if e["step"] == nxt["step"]}
    restarted = [e for e in committed(out / "replica2" / "train_log.jsonl") if e["time"] > kill]
    caught = next((e["catch_up"] for e in restarted if "catch_up" in e), None)
    first = next((e for e in restarted if e["contributing"]), None)
    res["catch_up"] = caught
    if caught is None or first is None:
        return res  # it never got back in before the survivors finished: the rows say so
    joined, back = int(caught["joined_step"]), int(first["step"])
    # Had the group rejoined inside the stalled step itself, that step's time is the stall (row 2), not catch-up.
    lo = max(joined, nxt["step"] + 1)
    res.update(
        joined_step=joined, first_contributing_step=back, contributing_steps=sum(e["contributing"] for e in restarted),
        rejoined_inside_stall=joined <= nxt["step"], window_first_step=lo,
        during_ms=1e3 * mean_gap(times, lo, back),
        during_median_ms=1e3 * median([times[s] - times[s - 1] for s in range(lo, back + 1)
                                       if s - 1 in times and s in times]),
        restarting_ms=1e3 * mean_gap(times, nxt["step"] + 1, joined - 1),
        contributing_s=first["time"] - kill, kill_to_catch_up_start_s=caught["started"] - kill,
        catch_up_s=caught["finished"] - caught["started"], rate=caught.get("bytes_per_s"),
        stage_s=max((e.get("stage_s", 0.0) for e in survivor), default=0.0),
        # Where the catch-up window's time goes, step by step (replica0), one step either side.
        window=[{"step": e["step"], "gap_ms": 1e3 * (e["time"] - times[e["step"] - 1]),
                 "participants": len(e["participants"]), "quorum_id": e["quorum_id"], "attempts": e["attempts"],
                 "quorum_wait_ms": 1e3 * e["quorum_wait_s"], "reduce_ms": 1e3 * e["reduce_s"],
                 "vote_ms": 1e3 * e["vote_s"], "stage_ms": 1e3 * e.get("stage_s", 0.0)}
                for e in survivor if joined - 1 <= e["step"] <= back + 1 and e["step"] - 1 in times],
    )
    return res


def snapshot_bytes(model: str, data: Path) -> int | None:
    """Estimated snapshot of one rank of a 1-rank group: the model built on the meta device, counted."""
    try:
        import torch
        from torchrec import EmbeddingBagCollection, EmbeddingCollection

        from freescale.config import load_config
        from freescale.dataloader.schema import DatasetManifest
        from freescale.models import build_model
        from freescale.trainer import TrainerConfig

        cfg = load_config(TrainerConfig, REPO / "configs" / f"tiny_{model}.toml", ["--data.path", str(data)])
        net = build_model(cfg.model, DatasetManifest.read(data), max_seq_len=cfg.data.max_seq_len,
                          embedding_device=torch.device("meta"))
        tables = {id(p): p for m in net.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
                  for p in m.parameters()}
        dense = sum(p.numel() for p in net.parameters() if id(p) not in tables)
        emb = sum(p.numel() for p in tables.values())
        rows = sum(p.shape[0] for p in tables.values())
        buffers = sum(b.numel() * b.element_size() for b in net.buffers())
        return 4 * (emb + rows + 3 * dense) + buffers
    except Exception as e:
        print(f"bench_ft_torchrec: snapshot size estimate failed: {e}", file=sys.stderr)
        return None


def heartbeat_timeout_s() -> float:
    from freescale.launch import launch_replicas

    return float(inspect.signature(launch_replicas).parameters["heartbeat_timeout_s"].default)


def lighthouse_defaults() -> dict[str, float]:
    from freescale.ft.lighthouse import LighthouseConfig

    cfg = LighthouseConfig()
    return {"join_timeout_s": cfg.join_timeout_s, "suspect_grace_s": cfg.suspect_grace_s}


# ---------------------------------------------------------------------------- table
def _overhead_row(measure: str, o: dict[str, Any], prefix: str) -> dict[str, Any]:
    ms, frac = o[f"{prefix}overhead_ms"], o[f"{prefix}overhead_frac"]
    return {"measure": measure, "value": f"{ms:+.2f} ms ({frac:+.1%}); pairs "
                                         f"{'/'.join(f'{v:+.1f}' for v in o[f'{prefix}paired_diff_ms_runs'])} ms",
            "target": "<= 1 ms or 5%", "raw": ms, "met": bool(ms <= 1.0 or frac <= 0.05)}


def _breakdown_row(kind: str, o: dict[str, Any], side: str, what: str) -> dict[str, Any]:
    return {"measure": f"[{kind}] {what}: quorum wait / FTAR + emb exchange / update built during vote / vote exposed",
            "value": f"{o[f'{side}_quorum_wait_ms']:.2f} / {o[f'{side}_reduce_ms']:.2f} / "
                     f"{o[f'{side}_prepare_ms']:.2f} / {o[f'{side}_vote_ms']:.2f} ms",
            "target": "-", "raw": o[f"{side}_reduce_ms"]}


def overhead_rows(ov: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind, o in ov.items():
        groups, ranks = int(o.get("groups", 2)), int(o.get("ranks", 1))
        jobs, shape = groups * ranks, f"{groups} groups x {ranks} rank{'s' if ranks > 1 else ''}"
        rows += [
            {"measure": f"[{kind}] step without FT, {jobs} ranks (tables sharded)",
             "value": f"{o['plain_step_ms']:.2f} ms", "target": "-", "raw": o["plain_step_ms"]},
            {"measure": f"[{kind}] FT step, {shape} (fused tables, union update)",
             "value": f"{o['ft_step_ms']:.2f} ms", "target": "-", "raw": o["ft_step_ms"]},
            _overhead_row(f"[{kind}] per-step overhead FT vs without (tables sharded without FT: not like for like)",
                          o, ""),
        ]
        if "like_overhead_ms" in o:
            rows += [
                {"measure": f"[{kind}] step without FT, {jobs} ranks, tables replicated (data_parallel + DDP)",
                 "value": f"{o['replicated_step_ms']:.2f} ms", "target": "-", "raw": o["replicated_step_ms"]},
                {"measure": f"[{kind}] FT step, {shape}, tables replicated (data_parallel: "
                            "their gradients in FT's buckets)",
                 "value": f"{o['ft_replicated_step_ms']:.2f} ms", "target": "-", "raw": o["ft_replicated_step_ms"]},
                _overhead_row(f"[{kind}] per-step overhead FT vs without, like for like (tables replicated on both)",
                              o, "like_"),
                _overhead_row(f"[{kind}] FT with the union update (fused tables) vs without FT, tables replicated "
                              "(the union's cost)", o, "replicated_"),
                _breakdown_row(kind, o, "ft_replicated", "FT, tables replicated"),
            ]
        rows.append(_breakdown_row(kind, o, "ft", "FT (union)"))
    return rows


def rows_for(ov: dict[str, Any], kr: dict[str, Any], size: int | None, hb: float) -> list[dict[str, Any]]:
    k = kr["fault"].split(":")[2]
    rows: list[dict[str, Any]] = [
        *overhead_rows(ov),
        {"measure": f"kill (step {k}, mid-exchange) -> survivors' next committed step",
         "value": f"{kr['kill_s']:.3f} s (step {kr['next_step']}, {kr['next_step_attempts']} attempts)",
         "target": "<= 0.3 s", "raw": kr["kill_s"], "met": bool(kr["kill_s"] <= 0.3)},
        {"measure": "steps discarded per failure", "value": str(kr["discarded"]), "target": "0",
         "raw": kr["discarded"], "met": kr["discarded"] == 0},
    ]
    if "contributing_s" not in kr:
        never = f"never contributed again in {kr['steps']} steps (raise --kill-steps)"
        rows += [{"measure": m, "value": never, "target": t, "raw": None}
                 for m, t in (("survivor step during catch-up / before", "<= 1.05"),
                              ("restart -> contributing", "-"), ("catch-up transfer rate", ">= 1 GB/s"))]
    else:
        ratio = kr["during_ms"] / kr["before_ms"]
        rows += [
            {"measure": "survivor step during catch-up / before",
             "value": f"{ratio:.2f} ({kr['during_ms']:.1f} vs {kr['before_ms']:.1f} ms, steps "
                      f"{kr['window_first_step']}..{kr['first_contributing_step']} vs {WARMUP}..{int(k) - 1})",
             "target": "<= 1.05", "raw": ratio, "met": bool(ratio <= 1.05)},
            {"measure": "survivor step while the group restarts (2 groups)",
             "value": "n/a (it rejoined inside the stalled step)" if kr["rejoined_inside_stall"]
             else f"{kr['restarting_ms']:.1f} ms", "target": "-", "raw": kr["restarting_ms"]},
            {"measure": "restart -> contributing (agent restart, imports, sharding incl.)",
             "value": f"{kr['contributing_s']:.2f} s (to catch-up start {kr['kill_to_catch_up_start_s']:.2f} s, "
                      f"catch-up {kr['catch_up_s']:.3f} s)", "target": "-", "raw": kr["contributing_s"]},
            {"measure": "catch-up snapshot transfer rate",
             "value": f"{kr['rate'] / 1e9:.3f} GB/s" if kr.get("rate") else "not logged", "target": ">= 1 GB/s",
             "raw": kr.get("rate"), "met": bool(kr.get("rate") and kr["rate"] >= 1e9)},
        ]
    rows += [
        {"measure": "snapshot size (estimate from parameter count)",
         "value": f"{size / 1e6:.2f} MB" if size else "n/a", "target": "-", "raw": size},
        {"measure": "lighthouse heartbeat timeout (launch_replicas)",
         "value": f"{hb:g} s (3 groups: crash found by failure reports)", "target": "-", "raw": hb},
    ]
    return rows


def parse_args() -> tuple[argparse.Namespace, int, int, int]:
    """The command line, checked: (args, overhead repeats, overhead steps, kill-run steps)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat")
    parser.add_argument("--pipeline", default=",".join(PIPELINES),
                        help="pipeline kinds to measure with and without FT, comma-separated (default all three)")
    parser.add_argument("--kill-pipeline", default="plain", choices=PIPELINES,
                        help="pipeline kind of the kill/catch-up run (default plain)")
    parser.add_argument("--model", choices=["dlrm", "hstu"], default="dlrm")
    parser.add_argument("--batch", type=int, default=128, help="rows per rank per step (default 128)")
    parser.add_argument("--data", help="an existing dataset (default: synthetic, generated into a temp dir)")
    parser.add_argument("--rows", type=int, default=40_000, help="synthetic training rows (default 40000)")
    parser.add_argument("--num-items", type=int, default=2_000,
                        help="synthetic item vocabulary (default 2000; larger: a bigger item table and snapshot)")
    parser.add_argument("--repeats", type=int, help="interleaved plain/FT overhead pairs (default 6, quick 1)")
    parser.add_argument("--steps", type=int, help="steps of each overhead run (default 300, quick 60)")
    parser.add_argument("--kill-step", type=int, default=30, help="step K at which group 2 is killed (default 30)")
    parser.add_argument("--kill-steps", type=int,
                        help="steps of the kill run; enough for the restarted group to rejoin and contribute "
                             "(default 1500, quick 600)")
    parser.add_argument("--plain-start", action="store_true",
                        help="run the kill once more with FREESCALE_FORKSERVER=off (every rank imports for itself)")
    parser.add_argument("--replicated", action="store_true",
                        help="also the like-for-like side without FT: tables replicated on every rank "
                             "(--optim.sharding data_parallel; DLRM: torchrec cannot replicate HSTU's sequence table)")
    parser.add_argument("--overhead-only", action="store_true", help="only the per-step overhead (no kill run)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ranks per replica group in the overhead runs (default 1; the job without FT has "
                             "groups x ranks ranks)")
    parser.add_argument("--groups", default="2",
                        help="replica group counts R of the overhead runs, comma-separated (default 2): FT with R "
                             "groups of 1 rank against one job of R ranks; R > 2 on 2 cores time-shares them")
    parser.add_argument("--json", help="write rows, machine and parameters to this path")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (logs) and print where")
    args = parser.parse_args()
    args.pipelines = [k for k in args.pipeline.split(",") if k]
    try:
        args.groups = sorted({int(g) for g in args.groups.split(",") if g})
    except ValueError:
        parser.error(f"--groups: {args.groups!r} is not a comma-separated list of group counts")
    if not args.groups or min(args.groups) < 2:
        parser.error("--groups: each count must be >= 2 (fault tolerance needs a peer)")
    if any(k not in PIPELINES for k in args.pipelines):
        parser.error(f"--pipeline: each of {args.pipeline!r} must be one of {', '.join(PIPELINES)}")
    if args.replicated and args.model != "dlrm":
        parser.error("--replicated: torchrec cannot replicate HSTU's sequence table (data_parallel); use --model dlrm")
    repeats = args.repeats or (1 if args.quick else 6)
    steps = args.steps or (60 if args.quick else 300)
    kill_steps = args.kill_steps or (300 if args.quick else 1500)
    if args.kill_step <= WARMUP + 1 or kill_steps <= args.kill_step + 1 or steps <= 2 * LOG_EVERY + WARMUP:
        parser.error(f"need --kill-step > {WARMUP + 1}, --kill-steps > --kill-step + 1 and "
                     f"--steps > {2 * LOG_EVERY + WARMUP}")
    return args, repeats, steps, kill_steps


def print_kill_run(kr: dict[str, Any], seconds: float) -> None:
    """The kill run's details below the table: the survivors' step K per group, the catch-up window."""
    print(f"bench_ft_torchrec: {seconds:.0f} s in all; kill run {kr['wall_s']:.0f} s "
          f"({kr['steps']} steps), {kr.get('contributing_steps', 0)} of them with the restarted group contributing")
    for name, e in kr["step_k"].items():
        print(f"step {kr['next_step']} on {name}: committed {e['after_kill_s']:.3f} s after the kill, "
              f"{e['attempts']} attempts, reduce {e['reduce_ms']:.0f} ms, participants {','.join(e['participants'])}")
    if kr.get("window"):
        print("catch-up window on replica0 (step: gap ms, participants, reduce ms): " + ", ".join(
            f"{w['step']}: {w['gap_ms']:.0f}, {w['participants']}, {w['reduce_ms']:.0f}" for w in kr["window"]))


def main() -> None:
    args, repeats, steps, kill_steps = parse_args()
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_ft_torchrec"))
    try:
        if args.data:
            data = Path(args.data).resolve()
        else:
            from freescale.dataloader import SyntheticSpec, generate

            data = tmp / "data"
            generate(data, SyntheticSpec(rows=args.rows, eval_rows=0, num_items=args.num_items,
                                         row_group_size=4_096, seed=0))
        ov = overhead(tmp, data, args, steps, repeats)
        kr = None if args.overhead_only else kill_run(tmp, data, args, kill_steps)
        plain_starts = [kill_run(tmp, data, args, kill_steps, forkserver=False)] if args.plain_start and kr else []
        size = snapshot_bytes(args.model, data)
    finally:
        if args.keep:
            print(f"bench_ft_torchrec: runs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    hb = heartbeat_timeout_s()
    if kr is None:  # --overhead-only
        rows = overhead_rows(ov)
        print_table(rows, ["measure", "value", "target"])
        if args.json:
            write_json(args.json, "bench_ft_torchrec", {**run_params(args, repeats, steps), "overhead": ov}, rows)
        return
    rows = rows_for(ov, kr, size, hb)
    for kp in plain_starts:  # the same kill with every rank started as its own interpreter
        rows.insert(next(i for i, r in enumerate(rows) if r["measure"].startswith("restart -> contributing")) + 1, {
            "measure": "restart -> contributing, ranks not forked (FREESCALE_FORKSERVER=off)",
            "value": f"{kp['contributing_s']:.2f} s (to catch-up start {kp['kill_to_catch_up_start_s']:.2f} s)"
            if kp.get("contributing_s") is not None else "never contributed", "target": "-",
            "raw": kp.get("contributing_s")})
    print_table(rows, ["measure", "value", "target"])
    print_kill_run(kr, time.perf_counter() - start)
    if args.json:
        write_json(args.json, "bench_ft_torchrec", {
            **run_params(args, repeats, steps), "kill_pipeline": args.kill_pipeline,
            "kill": "launch --replicas 3 --nproc-per-node 1 --max-restarts 1", "fault": kr["fault"], "slow": None,
            "kill_steps": kill_steps,
            "heartbeat_timeout_s": hb, **lighthouse_defaults(), "snapshot_bytes_estimate": size,
            "overhead": ov, "kill_run": kr, "kill_run_plain_start": plain_starts[0] if plain_starts else None}, rows)


def run_params(args: argparse.Namespace, repeats: int, steps: int) -> dict[str, Any]:
    """The JSON's parameters of the overhead runs."""
    return {
        "quick": args.quick, "model": args.model, "config": f"configs/tiny_{args.model}.toml",
        "batch_per_rank": args.batch, "data": args.data or f"synthetic: {args.rows} rows, {args.num_items} items",
        "backend": "gloo (CPU)", "omp_num_threads": 1, "repeats": repeats, "overhead_steps": steps,
        "ft_warmup_steps": WARMUP, "plain_log_every": LOG_EVERY, "pipelines": args.pipelines, "groups": args.groups,
        "ranks_per_group": args.ranks,
        "plain": "launch --nproc-per-node R (1 job, tables sharded over R ranks; DDP, or prioritized's reducer)",
        "replicated": f"the same with {' '.join(REPLICATED)} (tables whole on every rank)" if args.replicated else None,
        "ft": "launch --replicas R --nproc-per-node 1",
        "ft_replicated": f"the same with {' '.join(REPLICATED)}" if args.replicated else None,
    }


if __name__ == "__main__":
    main()
