"""One summary for a fault-tolerant job, printed by ``freescale launch --replicas`` when it ends.

Each replica group's rank 0 logs every incarnation's events to the same
``replica<g>/train_log.jsonl`` (``freescale.run_log``); this reads them all (with
``freescale.report.logs``, which tolerates what killed writers leave) and says what the *job*
did, across every incarnation of every group: steps committed, samples trained (each group's
contributing share of each step, once), restarts, catch-ups, the stall (time the job made no
committed step beyond its usual step time) and the eval metrics, with one row per group
beneath, then one line per fail-slow verdict (``freescale.rank_speed``).  Groups print no table of
their own under the launcher, so the terminal shows one job.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SUMMARY_ENV = "FREESCALE_JOB_SUMMARY"
"""Set by ``freescale launch --replicas``: the launcher prints the job summary, the groups none."""


@dataclass
class GroupRow:
    group: int
    incarnations: int
    steps_trained: int
    """Steps this group contributed samples to (any incarnation)."""
    catch_ups: int
    samples: int
    eval_auc: float | None = None
    sizes: list[tuple[int, int]] = field(default_factory=list)
    """(ranks, first step committed at that size): the group's size over time (``GroupLog.sizes``)."""


@dataclass
class JobSummary:
    steps: int
    samples: int
    seconds: float
    restarts: int
    catch_ups: int
    stall_s: float
    """Sum over the gaps between consecutive committed steps of what exceeds 5x the median step time."""
    groups: list[GroupRow] = field(default_factory=list)
    fail_slow: list[str] = field(default_factory=list)
    """The job's fail-slow verdicts and recoveries, one line each (``freescale.rank_speed``)."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def summarize(root: Path) -> JobSummary:
    from freescale.report.logs import fail_slow_line, read_run

    run = read_run(root)
    by_step: dict[int, float] = {}
    rows, samples = [], 0
    for g in run.groups:
        mine: dict[int, dict[str, Any]] = {}
        for commit in g.commits:
            mine[commit["step"]] = commit  # a step logged twice (replayed by a new incarnation): once
            by_step[commit["step"]] = min(by_step.get(commit["step"], float("inf")), commit["time"])
        trained = [c for c in mine.values() if c.get("contributing", True)]
        group_samples = int(sum(c.get("samples", 0) for c in trained))
        samples += group_samples
        evals = g.of("eval")
        rows.append(GroupRow(g.group, len(g.of("start")), len(trained), len(g.catch_ups), group_samples,
                             evals[-1].get("auc") if evals else None, g.sizes()))
    times = np.array([by_step[s] for s in sorted(by_step)])
    gaps = np.diff(times) if times.size > 1 else np.zeros(0)
    usual = float(np.median(gaps)) if gaps.size else 0.0
    stall = float(np.sum(np.clip(gaps - 5 * usual, 0, None))) if gaps.size else 0.0
    return JobSummary(steps=len(by_step), samples=samples, seconds=float(times[-1] - times[0]) if times.size > 1 else 0.0,
                      restarts=sum(r.incarnations - 1 for r in rows if r.incarnations), catch_ups=sum(r.catch_ups for r in rows),
                      stall_s=stall, groups=rows,
                      fail_slow=[f"group {e.get('group', 0)}, {fail_slow_line(e)}" for e in run.fail_slow()])


def print_job_summary(summary: JobSummary, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for name in ("", "ranks", "steps", "samples", "samples/s", "restarts", "catch-ups", "stall s", "eval AUC"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_row("job", "", f"{summary.steps:,}", f"{summary.samples:,}", f"{summary.samples_per_s:,.0f}",
                  str(summary.restarts), str(summary.catch_ups), f"{summary.stall_s:.2f}", "")
    for row in summary.groups:
        table.add_row(f"group {row.group}", sizes_text(row.sizes), f"{row.steps_trained:,}", f"{row.samples:,}", "",
                      str(max(0, row.incarnations - 1)), str(row.catch_ups), "",
                      f"{row.eval_auc:.4f}" if row.eval_auc is not None else "")
    table.caption = ("group rows: the ranks each group ran on (from a step, where it changed), the steps and samples it "
                     "trained; stall: time without a committed step")
    console = Console(width=None if sys.stdout.isatty() else 130)
    console.print(table)
    for line in summary.fail_slow:
        console.print(f"fail-slow: {line}", highlight=False)


def sizes_text(sizes: list[tuple[int, int]]) -> str:
    """``2`` for a group that never changed size; ``2, 1 from 11, 2 from 40`` for one that lost a rank and got it
    back."""
    return ", ".join(str(ranks) if i == 0 else f"{ranks} from {step}" for i, (ranks, step) in enumerate(sizes))
