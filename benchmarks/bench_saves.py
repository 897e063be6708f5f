"""What each save costs the steps around it, in a real training: every save step reported, not averaged.

``freescale launch`` trains the tiny DLRM on 2 local ranks (gloo, CPU) with tables sized to ``--table-mb`` (the
item and user tables at ``embedding_dim`` 16 with their row-wise Adagrad state), saving every ``--every`` steps
(the trainer's default: an asynchronous save whose tables are copied over the steps after it, ``staging.py``),
and the same run with no saves, interleaved (``--repeats`` of each).  A step's time is the interval between two
consecutive ``commit`` records of rank 0's log: the step and everything the loop did after the one before
it (the save, a share of the tables' copy, committing a written save), which is what the training waits for.

For each save taken (its ``checkpoint_staged`` step ``d``: the state after steps 0 .. d - 1): step ``d`` (its
commit interval holds the save's work, done after step ``d - 1``'s commit), the steps while its tables are copied
(median, slowest), the step that finishes the copy and hands it to the writer, the steps while it is written
(median, slowest), and the slowest step until the next save, each over a normal step (the median step of the
run with no saves of the same repeat, run right after it: this machine drifts by 10% and more between runs a few
minutes apart, so each repeat is paired with its neighbour), and how many due saves were skipped meanwhile
(``checkpoint.skip_while_busy``).  Beside the save step: the save's own work on the training thread over a
normal step, the same step of the run without saves of that repeat, and the save step over its own run's
median step (no drift between runs in it, but that median is a step with a save's copy or write under way:
what the save step costs beyond those); over all the saves, the median of each (a single step's ratio is
mostly this machine's spread: the median over the saves against the same steps without a save is what a save
costs its step).  Beside them, the writer's start (from the copy handed over until its files began to be
written: the state's structure, its conversion, DCP's planning, each save's after the first reusing the first's
plans, ``freescale/save_plans.py``): rank 0's writer CPU over it, its duration, and the steps it overlapped, their
milliseconds beyond a normal step summed (a burst of Python holding the GIL beside the steps: one figure a save,
steadier than any single step's ratio).  The runs without saves' own spread (P90, P99, max of a step over its own run's median) is
printed beside: a single step of this machine reaches 1.5x at P90 with no save at all.  The steps that write the run's periodic log record (``LOG_EVERY``) are left out
of every figure and reported apart, with saves and without (they reduce the last 1,000 steps' metrics).
Target (issue 47): the save step and the step finishing its copy at most 1.2x a normal step, and the steps
copying and writing it at most 1.2x at their median, for every save, at 136 MB and at 1 GB of tables.

    python benchmarks/bench_saves.py [--quick] [--table-mb 136] [--json benchmarks/results/saves_cpu.json]
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
LOG_EVERY = 1000
"""The runs' ``train.log_every``: the step that writes the periodic log record also reduces the metrics of the last
1,000 steps over the ranks (~6x a step with no save at all, on this machine): it is left out of every window and
spread below and reported apart, with saves and without; a save taken at a log step is listed, its save step not
measured (its interval holds the log's work too) and the save left out of the target's count."""
DIM = 16
ROW_BYTES = DIM * 4 + 4  # a row of fp32 weights and its row-wise Adagrad state


def run(data: Path, out: Path, steps: int, every: int, *extra: str) -> list[dict[str, Any]]:
    """One training; rank 0's log records."""
    cmd = [sys.executable, "-m", "freescale.cli", "launch", "--nproc-per-node=2",
           "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={data}", f"--train.output_dir={out}",
           f"--train.steps={steps}", f"--checkpoint.every={every}", "--checkpoint.save_final=false",
           "--checkpoint.keep=2", f"--train.log_every={LOG_EVERY}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench_saves: the run failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def intervals(log: list[dict[str, Any]], log_steps: bool = False) -> dict[int, float]:
    """Step -> seconds since the commit before it (the first step has none); the periodic log steps only when
    ``log_steps`` (``LOG_EVERY``), else only the others."""
    commits = [e for e in log if e["event"] == "commit"]
    return {b["step"]: b["time"] - a["time"] for a, b in zip(commits, commits[1:])
            if (b["step"] % LOG_EVERY == 0) == log_steps}


def save_rows(log: list[dict[str, Any]], plain_log: list[dict[str, Any]], normal_s: float,
              repeat: int) -> list[dict[str, Any]]:
    """One row per save taken: its steps over a normal step (module docstring), and beside its save step the
    save's own work on the training thread (its ``checkpoint_staged`` seconds) and the same step of the run
    without saves of the same repeat (what a single step of this machine does with no save at all)."""
    gaps, plain_gaps = intervals(log), intervals(plain_log)
    own_run_s = statistics.median(s for step, s in gaps.items() if step >= 5)
    commits = [e for e in log if e["event"] == "commit"]
    staged = [e for e in log if e["event"] == "checkpoint_staged"]
    copied = {e["step"]: e for e in log if e["event"] == "checkpoint_tables_copied"}
    written = {e["step"]: e for e in log if e["event"] == "checkpoint"}
    skipped = [e["step"] for e in log if e["event"] == "checkpoint_skipped"]
    last_step = max((c["step"] for c in commits), default=0)
    rows = []
    for i, event in enumerate(staged):
        saved = event["step"]  # the save holds the state after `saved` steps: steps 0 .. saved - 1
        due = event.get("tables_due")
        following = staged[i + 1]["step"] if i + 1 < len(staged) else last_step + 1
        if due is None or saved <= 0 or saved not in written:
            continue
        on_log_step = saved % LOG_EVERY == 0  # its interval also holds the log record's reduction: not measured
        end = min(due, following)  # the run's end (or an urgent save) finishes the copy first
        committed = max((c["step"] for c in commits if c["time"] <= written[saved]["time"]), default=end)
        copying = [gaps[s] / normal_s for s in range(saved + 1, end) if s in gaps]
        writing = [gaps[s] / normal_s for s in range(end + 1, committed + 1) if s in gaps]
        taken = copied.get(saved, {})
        start_excess = _start_excess(commits, taken, written[saved], normal_s)
        rows.append({
            "repeat": repeat, "save_after_step": saved, "tables_due_step": due, "written_by_step": committed,
            "ended_by_the_run": due > last_step,  # the run's end finished its copy: not a whole save's steps
            "skipped_after": sum(saved < s < following for s in skipped),
            "on_log_step": on_log_step, "save_step_x": None if on_log_step else gaps[saved] / normal_s,
            "save_step_in_run_x": None if on_log_step else gaps[saved] / own_run_s,
            "save_work_x": event["seconds"] / normal_s,
            "same_step_no_save_x": plain_gaps[saved] / normal_s if saved in plain_gaps else None,
            "copying_median_x": statistics.median(copying) if copying else None,
            "copying_max_x": max(copying) if copying else None,
            "finishing_step_x": gaps[end] / normal_s if end in gaps else None,
            "writing_median_x": statistics.median(writing) if writing else None,
            "writing_max_x": max(writing) if writing else None,
            "any_step_until_next_save_max_x": max((gaps[s] for s in range(saved, following) if s in gaps),
                                                  default=float("nan")) / normal_s,
            "staged_ms": 1e3 * event["seconds"], "copy_ms": 1e3 * taken.get("copy_s", float("nan")),
            "keep_ms": 1e3 * taken.get("keep_s", float("nan")), "write_s": written[saved]["seconds"],
            "write_cpu_s": written[saved].get("write_cpu_s"), "paced_s": written[saved].get("paced_s"),
            "start_cpu_ms": 1e3 * written[saved].get("start_cpu_s", float("nan")),
            "start_ms": 1e3 * written[saved].get("start_s", float("nan")), "start_excess_ms": start_excess,
        })
    return rows


def _start_excess(commits: list[dict[str, Any]], copied: dict[str, Any], written: dict[str, Any],
                  normal_s: float) -> float | None:
    """The writer's start (from the copy handed over, ``checkpoint_tables_copied``, until its files began to be
    written, the ``checkpoint`` record's ``start_s``: the state's structure, its conversion, DCP's planning), in
    the steps it overlapped: their milliseconds beyond a normal step each, summed (log steps aside).  The first
    of them holds the hand-over too (what is left of the copy, if any, and the writer's thread woken:
    ``finishing_step_x``'s step; that work on the training thread is a few microseconds)."""
    if "time" not in copied or "start_s" not in written:
        return None
    begun, planned = copied["time"], copied["time"] + written["start_s"]
    overlapped = [b["time"] - a["time"] for a, b in zip(commits, commits[1:])
                  if b["time"] > begun and a["time"] < planned and b["step"] % LOG_EVERY]
    return 1e3 * sum(gap - normal_s for gap in overlapped) if overlapped else None


def summarize(saves: list[dict[str, Any]], normal_s: float, noise: dict[str, float], label: str) -> dict[str, Any]:
    """The saves' medians and the target's count, printed (``label``: which variant, where several ran)."""
    say = (lambda text: print(f"[{label}] {text}")) if label else print
    whole = [r for r in saves if not r["ended_by_the_run"] and not r["on_log_step"]]
    met = [r for r in whole if r["save_step_x"] <= 1.2 and (r["finishing_step_x"] or 0) <= 1.2
           and all((r[k] or 0) <= 1.2 for k in ("copying_median_x", "writing_median_x"))]
    worst = max((r["save_step_x"] for r in saves if r["save_step_x"] is not None), default=float("nan"))
    paired = [r for r in whole if r["same_step_no_save_x"] is not None]
    typical = {"median_save_step_x": statistics.median(r["save_step_x"] for r in whole) if whole else None,
               "median_same_step_no_save_x": statistics.median(r["same_step_no_save_x"] for r in paired)
               if paired else None,
               "median_save_work_x": statistics.median(r["save_work_x"] for r in whole) if whole else None,
               "median_save_step_in_run_x": statistics.median(r["save_step_in_run_x"] for r in whole) if whole else None}
    if whole and paired:  # (the saves whose copy the run's end cut left out, as in the target's count)
        say(f"over the {len(whole)} saves: the save step {typical['median_save_step_x']:.2f}x at the median, the "
            f"same steps of the runs without saves {typical['median_same_step_no_save_x']:.2f}x; the save's own work "
            f"on the training thread {typical['median_save_work_x']:.3f}x; the save step over its own run's median "
            f"step {typical['median_save_step_in_run_x']:.2f}x")
    started = [r for r in whole if r["start_excess_ms"] is not None]
    if started:  # the writer's start, over the saves (module docstring)
        for key in ("start_cpu_ms", "start_ms", "start_excess_ms"):
            typical[f"median_{key}"] = statistics.median(r[key] for r in started)
        say(f"the writer's start (until its files began to be written), over {len(started)} saves at the median: "
            f"{typical['median_start_cpu_ms']:.1f} ms of its CPU over {typical['median_start_ms']:.0f} ms; the steps "
            f"it overlapped {typical['median_start_excess_ms']:.1f} ms slower in all than normal steps")
    skipped = sum(r["skipped_after"] for r in saves)
    say(f"target: the save step and the step finishing its copy <= 1.2x a normal step, and the steps copying "
        f"and writing it <= 1.2x at their median: {len(met)} of {len(whole)} saves (the copies the runs' ends "
        f"finished left out) (worst save step {worst:.2f}x; {skipped} due saves skipped while one was busy)")
    return {"normal_step_ms": 1e3 * normal_s, "saves": len(whole), "worst_save_step_x": worst, **typical,
            "worst_step_x": max((r["any_step_until_next_save_max_x"] for r in saves), default=float("nan")),
            "skipped": skipped, "saves_within_1.2x": len(met),
            "saves_on_a_log_step": sum(r["on_log_step"] for r in saves), **noise}


def _spread(ratios: list[float]) -> dict[str, float]:
    """The runs without saves' own spread (each step over its own run's median), printed."""
    ratios = sorted(ratios)
    noise = {"p90_x": ratios[int(0.9 * (len(ratios) - 1))], "p99_x": ratios[int(0.99 * (len(ratios) - 1))],
             "max_x": ratios[-1]}
    print(f"runs without saves, a step over its own run's median: P90 {noise['p90_x']:.2f}x, P99 {noise['p99_x']:.2f}x, "
          f"max {noise['max_x']:.2f}x (the machine's own spread)")
    return noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat, 150 steps, 136 MB (< 60 s)")
    parser.add_argument("--table-mb", type=float, default=136.0, help="MB of tables (weights + row-wise state)")
    parser.add_argument("--every", type=int, default=10, help="steps between saves (default 10)")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default 400; 150 with --quick)")
    parser.add_argument("--skip-while-busy", choices=("true", "false"), default="true",
                        help="checkpoint.skip_while_busy (false: every due save is taken, waiting for the one before)")
    parser.add_argument("--write-share", type=float, default=None,
                        help="checkpoint.write_share (the writer's share of a core; default: the config's)")
    parser.add_argument("--repeats", type=int, default=0, help="runs of each kind, interleaved (default 3; 1 quick)")
    parser.add_argument("--dir", help="where the runs write (default: the temp folder; e.g. /dev/shm: no disk)")
    parser.add_argument("--plans", choices=("reused", "afresh", "both"), default="reused",
                        help="DCP's save plans reused from the first save (checkpoint.reuse_plans, the default), made "
                             "afresh at every save, or both in each repeat (rows tagged, each against the same run "
                             "without saves)")
    parser.add_argument("--json")
    args = parser.parse_args()
    steps = args.steps or (150 if args.quick else 400)
    repeats = args.repeats or (1 if args.quick else 3)
    rows_per_table = int(args.table_mb * 1e6 / ROW_BYTES / 2)
    from freescale.dataloader import SyntheticSpec, generate

    saves: list[dict[str, Any]] = []
    normal: list[float] = []  # the runs without saves' steps (seconds)
    spread: list[float] = []  # and each over its own run's median
    variants = ("reused", "afresh") if args.plans == "both" else (args.plans,)
    log_steps: dict[str, list[float]] = {v: [] for v in (*variants, "")}  # the periodic log steps by variant ("": none)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data = Path(tmp) / "data"
        generate(data, SyntheticSpec(rows=40_000, eval_rows=1_024, num_items=rows_per_table, num_users=rows_per_table,
                                     seed=0))
        for r in range(repeats):  # interleaved: a run with saves (each variant, in turns first), then one without
            share = [] if args.write_share is None else [f"--checkpoint.write_share={args.write_share}"]
            logs = {plans: run(data, Path(tmp) / f"saves{r}_{plans}", steps, args.every,
                               f"--checkpoint.skip_while_busy={args.skip_while_busy}",
                               f"--checkpoint.reuse_plans={str(plans == 'reused').lower()}", *share)
                    for plans in (variants if r % 2 == 0 else variants[::-1])}
            plain_log = run(data, Path(tmp) / f"plain{r}", steps, 0)
            own = [s for step, s in intervals(plain_log).items() if step >= 5]
            paired_s = statistics.median(own)  # this repeat's normal step
            normal += own
            spread += [s / paired_s for s in own]
            for plans, log in [*logs.items(), ("", plain_log)]:
                log_steps[plans].extend(s / paired_s for s in intervals(log, log_steps=True).values())
            for plans in variants:
                saves += [{**row, "plans": plans} for row in save_rows(logs[plans], plain_log, paired_s, r)]
        normal_s = statistics.median(normal)  # (pooled: only printed)
    print(f"2 ranks, tiny DLRM, {2 * rows_per_table:,} table rows ({args.table_mb:.0f} MB with their Adagrad state), "
          f"a save every {args.every} steps; normal step {1e3 * normal_s:.1f} ms (median of the runs without saves; each "
          "repeat's steps are over its own run without saves)")
    columns = ["plans"] * (len(variants) > 1) + [
               "repeat", "save_after_step", "tables_due_step", "written_by_step", "skipped_after", "save_step_x",
               "save_step_in_run_x", "save_work_x", "same_step_no_save_x", "copying_median_x", "copying_max_x",
               "finishing_step_x", "writing_median_x", "writing_max_x", "any_step_until_next_save_max_x", "staged_ms",
               "copy_ms", "keep_ms", "write_s", "write_cpu_s", "paced_s", "start_cpu_ms", "start_ms", "start_excess_ms"]
    print_table(saves, columns)
    noise = _spread(spread)
    if log_steps[""]:
        noise["log_step_x_without"] = statistics.median(log_steps[""])
        print(f"the steps writing the periodic log record (every {LOG_EVERY}; left out above): "
              f"{noise['log_step_x_without']:.2f}x in the runs without saves, "
              + ", ".join(f"{statistics.median(log_steps[v]) if log_steps[v] else float('nan'):.2f}x with saves"
                          + (f" ({v})" if len(variants) > 1 else "") for v in variants))
    summaries = [{"plans": plans, **summarize([r for r in saves if r["plans"] == plans], normal_s,
                                              {**noise, "log_step_x_with_saves": statistics.median(log_steps[plans])
                                               if log_steps[plans] else float("nan")},
                                              plans if len(variants) > 1 else "")}
                 for plans in variants]
    if args.json:
        write_json(args.json, "bench_saves", {"quick": args.quick, "table_mb": args.table_mb, "every": args.every,
                                              "steps": steps, "repeats": repeats, "write_share": args.write_share,
                                              "dir": args.dir, "rows_per_table": rows_per_table, "plans": args.plans,
                                              "embedding_dim": DIM, "ranks": 2},
                   saves + [{"summary": summary} for summary in summaries])


if __name__ == "__main__":
    main()
