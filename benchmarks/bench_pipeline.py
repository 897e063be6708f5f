"""Step time, exposed communication and bubble: plain loop vs torchrec's pipeline vs ours.

Trains the tiny sequence model (HSTU: item sequence + pooled user side
feature) and DLRM on 2 local ranks (gloo on CPU; NCCL when run on GPUs) with
``pipeline.kind`` = plain, torchrec (``TrainPipelineSparseDist``) and
prioritized; same data, seed and steps.  Every run has the same
instrumentation: ``train.trace_comm = true`` (``freescale.comm_trace``: every
collective the run issues through ``torch.distributed``, DDP's gradient
buckets included, with the time the issuing thread was blocked on it).

Runs are repeated and interleaved: repeat 1 of every (model, kind), then
repeat 2, ..., the order of the kinds rotated from one repeat to the next, so
machine drift and load from other processes hit every variant alike.  Every
run's values are kept (``--json``).  One pair of rank processes (the same
environment as ``freescale launch``: ``OMP_NUM_THREADS`` = cores / ranks) runs
all the trainings back to back, each through ``Trainer(cfg).fit()`` with its
own process group and output directory, after one discarded warm-up training
per model; this saves the ~7 s of interpreter and torchrec start-up a launch
per run would cost.

Measures, per run, over the steps after ``--warmup`` (the first steps pay for
lazy set-up and fill the pipeline):

- step_ms: mean wall time of a step (the log's ``commit`` events, rank 0);
- exposed_ms: **exposed communication, measured as the time the training
  thread was blocked in collectives per step**, from the comm trace, averaged
  over steps and both ranks: the whole call of a synchronous collective, the
  time in ``wait()`` of an asynchronous one.  Split by what the collective is
  for (``freescale.comm_trace.category``): ``input_dist`` (ids/lengths
  all-to-all), ``emb_fwd`` (embeddings all-to-all in forward), ``emb_bwd``
  (their gradients back), ``dense`` (dense gradient all-reduce: DDP's buckets
  for plain/torchrec, ``BucketedGrads`` for prioritized).  The metric and
  statistics reductions of the log windows (``other``) run after the timed
  step and are reported apart, not in exposed_ms;
- bubble: the log's ``step`` windows after the warm-up (``1 - busy /
  step_time``, busy = the training thread's CPU time, averaged over ranks);
- identical: whether the run's final state digest equals the plain loop's
  (tracing must not change what is computed).

Across runs: the median and the range (min-max).  The comparison lines use
the per-repeat paired differences (runs of the same repeat ran next to each
other): a difference whose range across repeats includes zero is reported as
"nothing measurable"; one with the same sign in every repeat is claimed only
when a sign test makes chance unlikely (p <= 0.05 needs 6 repeats, the
default; ``--quick`` runs 3 and can claim nothing).

What this does and does not measure.  Blocked time is what the training
thread loses to communication: transfer time not hidden behind compute plus
time waiting for the slower peer to arrive (skew).  It is not the duration of
the transfers, and it is not "step time with communication minus step time
with no-op collectives" (docs/design.md "Measures"): replacing collectives
by no-ops also zeroes the embeddings (other compute), frees the CPU the gloo
threads use, and leaves some collectives (reduce-scatter, all-gather, DDP's
C++ all-reduce) running; that difference of two noisy step times came out
negative or swapped rank between identical runs.  Blocked time is read
directly, per step, with the same wrapper on every run.

On this CPU machine (2 cores shared by 2 ranks, gloo's threads, the loader
and whatever else runs) a collective that is "hidden" still takes CPU from
the compute it overlaps, and a tiny model's all-to-alls take tens to hundreds
of microseconds; the bubble includes time a rank was descheduled.  Expect
the prioritized pipeline (priority order of the output dists, dense
gradients on their own group in bounded chunks) to buy nothing measurable
here unless the printed verdict says otherwise; it is built for GPUs, where
communication runs on its own engines and is long against compute.

    python benchmarks/bench_pipeline.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
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
KINDS = ("plain", "torchrec", "prioritized")
MODELS = ("hstu", "dlrm")
PIPELINE_CATEGORIES = ("input_dist", "emb_fwd", "emb_bwd", "dense_reduce")
RANKS = 2


# ---------------------------------------------------------------------------------------------
# The rank processes: run every training of the schedule back to back.
def worker(schedule_path: str) -> None:
    from freescale.config import load_config
    from freescale.trainer import Trainer, TrainerConfig

    for item in json.loads(Path(schedule_path).read_text()):
        os.environ["MASTER_PORT"] = str(item["port"])
        cfg = load_config(TrainerConfig, item["config"], item["overrides"])
        start = time.perf_counter()
        Trainer(cfg).fit()
        if os.environ["RANK"] == "0":
            Path(item["out"], "bench_wall_s.txt").write_text(f"{time.perf_counter() - start}\n")
        gc.collect()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_schedule(items: list[dict[str, Any]], tmp: Path, timeout_s: float) -> None:
    """Two rank processes run ``items`` in order; raises with their output when one fails."""
    schedule = tmp / "schedule.json"
    schedule.write_text(json.dumps(items))
    cores = os.cpu_count() or 1
    procs, logs = [], []
    for rank in range(RANKS):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(RANKS),
               "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, cores // RANKS)))}
        log = (tmp / f"worker{rank}.log").open("w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(schedule)], env=env, cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs:
            log.close()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- rank {r} ---\n{(tmp / f'worker{r}.log').read_text()[-3000:]}" for r in range(RANKS))
        raise SystemExit(f"bench_pipeline: a rank failed or timed out (exit codes "
                         f"{[p.returncode for p in procs]}):\n{tails}")


# ---------------------------------------------------------------------------------------------
# One run's values.
def read_run(out: Path, warmup: int, log_every: int) -> dict[str, Any]:
    from freescale.comm_report import blocked_per_step, read_jsonl

    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    commits = [e for e in log if e["event"] == "commit" and e["step"] >= warmup]
    steps = [e["step"] for e in commits]
    (summary,) = [e for e in log if e["event"] == "summary"]
    windows = [e for e in log if e["event"] == "step" and e["step"] - log_every >= warmup and "bubble" in e]
    seconds = np.array([e["seconds"] for e in commits])
    busy = np.array([e["busy_s"] for e in commits])
    per_rank: list[dict[str, float]] = []
    events_per_step = []
    measured = set(steps)
    exposed_steps: list[float] = []
    for rank in range(RANKS):
        events = read_jsonl(out / f"comm_trace_rank{rank}.jsonl")
        blocked = blocked_per_step(events, steps=steps)
        per_rank.append({c: 1e3 * float(np.mean([blocked[s].get(c, 0.0) for s in steps]))
                         for c in (*PIPELINE_CATEGORIES, "other")})
        exposed_steps.extend(1e3 * sum(blocked[s].get(c, 0.0) for c in PIPELINE_CATEGORIES) for s in steps)
        events_per_step.append(sum(1 for e in events if e.step in measured) / len(steps))
    for r in per_rank:
        r["exposed"] = sum(r[c] for c in PIPELINE_CATEGORIES)
    mean = {k: float(np.mean([r[k] for r in per_rank])) for k in per_rank[0]}
    return {
        "steps_measured": len(steps),
        "step_ms": 1e3 * float(seconds.mean()),
        "step_ms_median": 1e3 * float(np.median(seconds)),
        "exposed_ms": mean["exposed"],
        "exposed_ms_per_rank": [r["exposed"] for r in per_rank],
        "exposed_ms_median_step": float(np.median(exposed_steps)),
        **{f"{c}_ms": mean[c] for c in PIPELINE_CATEGORIES},
        "other_ms": mean["other"],
        "exposed_frac": mean["exposed"] / (1e3 * float(seconds.mean())),
        "bubble": float(np.mean([w["bubble"] for w in windows])) if windows else float("nan"),
        "bubble_rank0_commits": float(np.mean(1.0 - busy / np.maximum(seconds, 1e-9))),
        "collectives_per_step": float(np.mean(events_per_step)),
        "digest": summary["state_digest"],
        "wall_s": float((out / "bench_wall_s.txt").read_text()),
    }


# ---------------------------------------------------------------------------------------------
# Across runs.
def aggregate(runs: list[dict[str, Any]], models: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        mine = [r for r in runs if r["model"] == model]
        plain_digest = next(r["digest"] for r in mine if r["pipeline"] == "plain")
        for kind in KINDS:
            of = sorted((r for r in mine if r["pipeline"] == kind), key=lambda r: r["repeat"])
            row: dict[str, Any] = {"model": model, "pipeline": kind, "runs": len(of)}
            for key in ("step_ms", "exposed_ms", "exposed_ms_median_step", *(f"{c}_ms" for c in PIPELINE_CATEGORIES),
                        "other_ms", "exposed_frac", "bubble", "bubble_rank0_commits", "collectives_per_step"):
                values = [r[key] for r in of]
                row[key] = float(np.median(values))
                row[f"{key}_min"], row[f"{key}_max"] = float(min(values)), float(max(values))
            row["identical_to_plain"] = all(r["digest"] == plain_digest for r in of)
            row["per_run"] = [{k: v for k, v in r.items() if k not in ("model", "pipeline")} for r in of]
            rows.append(row)
    return rows


def compare(runs: list[dict[str, Any]], models: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per-repeat paired differences (kind minus baseline) of step and exposed time, and a verdict on each."""
    out = []
    for model in models:
        by = {(r["pipeline"], r["repeat"]): r for r in runs if r["model"] == model}
        repeats = sorted({r for _, r in by})
        for kind, base in (("prioritized", "torchrec"), ("prioritized", "plain"), ("torchrec", "plain")):
            for key in ("step_ms", "exposed_ms"):
                d = [by[(kind, r)][key] - by[(base, r)][key] for r in repeats]
                lo, hi = min(d), max(d)
                if lo <= 0 <= hi:
                    verdict = "nothing measurable (the range across repeats includes 0)"
                else:
                    p = 2 * 0.5 ** len(d)  # two-sided sign test: every repeat with the same sign
                    verdict = (f"{'lower' if hi < 0 else 'higher'} in all {len(d)} repeats (sign test p = {p:.2f}"
                               f"{'' if p <= 0.05 else ': too few repeats to claim it'})")
                out.append({"model": model, "kind": kind, "base": base, "measure": key, "differences": d,
                            "median": float(np.median(d)), "min": lo, "max": hi, "verdict": verdict})
    return out


def _line(c: dict[str, Any]) -> str:
    return (f"{c['model']}: {c['kind']} - {c['base']}: {c['measure']} {c['median']:+.2f} ms "
            f"[{c['min']:+.2f}, {c['max']:+.2f}]: {c['verdict']}")


def report(rows: list[dict[str, Any]], runs: list[dict[str, Any]], models: tuple[str, ...]) -> list[dict[str, Any]]:
    """Print the tables and the comparisons; return the comparisons."""
    print("per step, median [min-max] across runs; exposed = training thread blocked in collectives "
          "(input_dist + emb_fwd + emb_bwd + dense), both ranks' mean:")
    table, breakdown = [], []
    for row in rows:
        def cell(key: str, row: dict[str, Any] = row) -> str:
            return f"{row[key]:.2f} [{row[key + '_min']:.2f}-{row[key + '_max']:.2f}]"

        table.append({"model": row["model"], "pipeline": row["pipeline"], "runs": row["runs"],
                      "step_ms": cell("step_ms"), "exposed_ms": cell("exposed_ms"),
                      "exposed_frac": cell("exposed_frac"), "bubble": cell("bubble"),
                      "identical": row["identical_to_plain"]})
        breakdown.append({"model": row["model"], "pipeline": row["pipeline"],
                          **{c: cell(f"{c}_ms") for c in (*PIPELINE_CATEGORIES, "other")}})
    print_table(table, ["model", "pipeline", "runs", "step_ms", "exposed_ms", "exposed_frac", "bubble", "identical"])
    print("exposed_ms by what the collective is for (ms per step, median [min-max]):")
    print_table(breakdown, ["model", "pipeline", *PIPELINE_CATEGORIES, "other"])
    print("input_dist: ids/lengths all-to-all; emb_fwd / emb_bwd: embeddings all-to-all in forward / gradients in "
          "backward; dense_reduce: dense gradient all-reduce (DDP buckets, or BucketedGrads for prioritized); other: "
          "log-window metric/statistics reductions, outside the timed step and not in exposed_ms.")
    print("paired differences per repeat (runs of one repeat ran side by side), median [min, max]:")
    comparisons = compare(runs, models)
    for c in comparisons:
        print("  " + _line(c))
    print("On this CPU (gloo, ranks sharing the cores with gloo's threads, the loader and other processes), blocked "
          "time includes waiting for the slower rank, and overlap does not free the CPU.  A difference is claimed "
          "only where every repeat agrees on its sign and that is unlikely by chance (sign test p <= 0.05: "
          "6 repeats or more).")
    for model in models:
        c = next(c for c in comparisons if c["model"] == model and c["kind"] == "prioritized"
                 and c["base"] == "torchrec" and c["measure"] == "step_ms")
        bought = ("nothing measurable" if c["min"] <= 0 <= c["max"]
                  else f"{c['median']:+.2f} ms per step, {c['verdict']}")
        print(f"What the prioritized pipeline buys over torchrec's pipeline on {model} here (step time): {bought}.")
    return comparisons


# ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="3 repeats (not 6), 40 DLRM / 15 HSTU measured steps after a 10 / 5 step warm-up: "
                             "a smoke test, < 60 s")
    parser.add_argument("--steps", type=int, default=120, help="measured steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=20, help="steps at the start of each run not measured")
    parser.add_argument("--repeats", type=int, default=6,
                        help="interleaved repeats (6: the fewest for which a sign test can reach p <= 0.05)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole schedule")
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return

    from freescale.dataloader import SyntheticSpec, generate

    models = tuple(m for m in args.models.split(",") if m)
    if not models or set(models) - set(MODELS):
        raise SystemExit(f"--models: a comma-separated subset of {','.join(MODELS)}")
    repeats = 3 if args.quick else args.repeats
    # (measured steps, warm-up steps); log windows of `warmup` steps so whole windows follow the warm-up.
    plan = {m: ((40, 10) if m == "dlrm" else (15, 5)) if args.quick else (args.steps, args.warmup) for m in models}
    for m, (steps, warmup) in plan.items():
        if warmup < 1 or steps % warmup:
            raise SystemExit(f"--steps ({steps}) must be a multiple of --warmup ({warmup}) for whole log windows")
    load_before = os.getloadavg()
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "data"
        generate(data, SyntheticSpec(rows=50_000, eval_rows=0, max_len=64, lengths="ml-1m", seed=0))

        def item(model: str, kind: str, name: str, steps: int, log_every: int) -> dict[str, Any]:
            return {"config": str(REPO / "configs" / f"tiny_{model}.toml"), "out": str(tmp / name),
                    "port": _free_port(), "overrides": [
                        f"--data.path={data}", f"--train.output_dir={tmp / name}", f"--train.steps={steps}",
                        f"--train.log_every={log_every}", "--train.eval=false", "--train.progress=false",
                        "--train.trace_comm=true", "--checkpoint.every=0", "--checkpoint.save_final=false",
                        f"--data.batch_size={args.batch}", f"--pipeline.kind={kind}", "--dist.timeout_s=300"]}

        items, order = [], []
        for model in models:  # discarded: lazy set-up of the processes (imports, kernels, allocator)
            items.append(item(model, "plain", f"warmup-{model}", plan[model][1], plan[model][1]))
        for r in range(repeats):
            for model in models:
                steps, warmup = plan[model]
                for kind in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:
                    items.append(item(model, kind, f"{model}-{kind}-{r}", warmup + steps, warmup))
                    order.append((model, kind, r))
        run_schedule(items, tmp, args.timeout)
        for position, (model, kind, r) in enumerate(order):
            warmup = plan[model][1]
            runs.append({"model": model, "pipeline": kind, "repeat": r, "position": position,
                         **read_run(tmp / f"{model}-{kind}-{r}", warmup, warmup)})
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()

    rows = aggregate(runs, models)
    quick = ", --quick: 3 repeats (not 6) and few steps, a smoke test: no difference can be claimed" if args.quick \
        else ""
    print(f"bench_pipeline: {len(runs)} runs ({repeats} interleaved repeats x {len(models)} models x {len(KINDS)} "
          f"pipelines{quick}) in {elapsed:.0f} s; load average {load_before[0]:.1f} before, {load_after[0]:.1f} "
          f"after, {os.cpu_count()} cores")
    comparisons = report(rows, runs, models)
    if args.json:
        write_json(args.json, "bench_pipeline", {
            "quick": args.quick, "repeats": repeats, "interleaved": "repeat-major, kind order rotated per repeat",
            "steps_measured": {m: plan[m][0] for m in models}, "warmup_steps": {m: plan[m][1] for m in models},
            "batch_per_rank": args.batch, "ranks": RANKS, "lengths": "ml-1m", "max_len": 64, "rows": 50_000,
            "configs": [f"configs/tiny_{m}.toml" for m in models], "trace_comm": True,
            "load_average_before": load_before, "load_average_after": load_after, "elapsed_s": elapsed,
            "measure": "exposed_ms = mean per step and rank of the time the training thread was blocked in "
                       "collectives (freescale.comm_trace blocked_s; categories input_dist, emb_fwd, emb_bwd, "
                       "dense_reduce), steps after warm-up",
            "comparisons": comparisons,
        }, rows)


if __name__ == "__main__":
    main()
