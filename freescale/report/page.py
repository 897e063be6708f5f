"""One self-contained HTML page for a run: summary, what the reader skipped or thinned (truncated
lines, earlier runs in the directory, stale kill files, thinned commits), what happened (kills,
restarts, catch-ups, redo attempts, checkpoints) in wall-clock order, and the figures as
embedded PNGs."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from freescale.report.figures import catchup_phases, fig_quality, fig_steps, fig_timeline, groups_of, kill_step
from freescale.report.logs import ReportError, RunLogs, fail_slow_line, read_run

STYLE = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1250px;color:#222}
table{border-collapse:collapse;margin:8px 0 18px}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}
th{background:#f2f3f4}h1{font-size:22px}h2{font-size:17px;margin-top:28px}img{max-width:100%;border:1px solid #eee}
.kill{color:#c0392b;font-weight:600}.note{color:#555;font-size:13px}"""


def _png(fig: Any) -> str:
    from freescale.plotting import pyplot

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _table(rows: list[list[Any]], head: list[str]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{cells}</table>"


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def summary_rows(run: RunLogs) -> list[list[Any]]:
    rows = []
    for g in run.groups:
        starts, summary = g.of("start"), (g.of("summary") or [{}])[-1]
        commits = g.commits
        model = (starts[0].get("config") or {}).get("model") if starts else None
        kind = model.get("kind", "?") if isinstance(model, dict) else "?"
        rows.append([f"group {g.group}", html.escape(str(kind)),
                     starts[0].get("world_size", "?") if starts else "?", len(starts), f"{g.total_commits:,}",
                     f"{commits[0]['step']}..{commits[-1]['step']}" if commits else "-", g.recovering_commits,
                     _num(summary.get("samples_per_s"), ",.0f"), _num(summary.get("train_loss"), ".4f"),
                     _num(summary.get("train_auc"), ".4f"), html.escape(_eval_quality(summary))])
    return rows


def _eval_quality(summary: dict[str, Any]) -> str:
    """The evaluation's headline: AUC of a ranker, HR@10 of a retrieval run."""
    found = summary.get("eval_metrics")
    metrics: dict[str, Any] = found if isinstance(found, dict) else {}
    validation = summary.get("validation")
    best = validation.get("best_step", -1) if isinstance(validation, dict) and validation.get("evaluated_best") else -1
    for key, shown in (("auc", "AUC"), ("hr@10", "HR@10")):
        value = metrics.get(key, summary.get("eval_auc") if key == "auc" else None)
        if isinstance(value, (int, float)):
            return f"{shown} {value:.4f}" + (f" (best validated step {best:,})" if isinstance(best, int) and best >= 0
                                              else "")
    return "-"


def event_rows(run: RunLogs) -> list[tuple[float, list[Any]]]:
    """(wall time, row) for every notable event, all groups."""
    t0, found = run.t0, []
    for kill in run.kills:
        step = kill_step(run, kill)
        after = sorted(c["time"] for g in run.groups if g.group != kill.group for c in g.commits
                       if c["time"] >= kill.time and kill.group not in groups_of(c))
        stall = f"; the others' next commit without it {after[0] - kill.time:.2f} s later" if after else ""
        found.append((kill.time, [f"{kill.time - t0:.2f}", kill.group, "<span class=kill>SIGKILL</span>",
                                  f"rank {kill.rank} killed (FREESCALE_FAULTS) during step {step}{stall}"]))
    for g in run.groups:
        for e in g.of("start"):
            if e.get("incarnation", 0) > 0:
                found.append((e["time"], [f"{e['time'] - t0:.2f}", g.group, "restart",
                                          f"incarnation {e['incarnation']} started (pid {e.get('pid')}) on "
                                          f"{e.get('world_size', 1)} rank(s)"]))
        for caught in g.catch_ups:
            phases = "; ".join(f"{p} {b - a:.2f} s" for p, a, b in catchup_phases(run, g, caught))
            rate = caught.get("bytes_per_s", 0) / 1e9
            found.append((caught.get("started", 0.0), [
                f"{caught.get('started', 0.0) - t0:.2f}", g.group, "catch-up",
                f"joined at step {caught.get('joined_step')}, snapshot of step {caught.get('snapshot_step')} from "
                f"{html.escape(str(caught.get('source')))}: {caught.get('bytes', 0):,} bytes at {rate:.2f} GB/s, "
                f"replayed {caught.get('replayed')} step(s); {phases}"]))
        for c in g.commits:
            if c.get("attempts", 1) > 1:
                found.append((c["time"], [f"{c['time'] - t0:.2f}", g.group, "redo",
                                          f"step {c['step']} committed after {c['attempts']} attempts, participants "
                                          f"{html.escape(', '.join(map(str, c.get('participants', []))))}"]))
        for e in g.of("checkpoint", "calibrate"):
            found.append((e["time"], [f"{e['time'] - t0:.2f}", g.group, e["event"], f"step {e.get('step')}"]))
    for e in run.fail_slow():
        found.append((e["time"], [f"{e['time'] - t0:.2f}", e.get("group", 0), e["event"].replace("_", "-"),
                                  html.escape(fail_slow_line(e))]))
    return sorted(found, key=lambda item: item[0])


def wait_rows(root: Path) -> list[list[Any]]:
    """The C4 view of the run's comm traces (``freescale.comm_report.waited_for``), one row per rank, the rank
    waited for longest first; none without traces of two ranks or more (torch is imported only then)."""
    if len(list(root.glob("comm_trace_rank*.jsonl"))) < 2:
        return []
    from freescale.comm_report import read_traces, waited_for

    view = waited_for(read_traces(root))
    ranks = sorted(view.waited_s, key=lambda r: -view.waited_s[r])
    rows: list[list[Any]] = [[r, f"{view.last[r]:,} of {view.collectives:,}", f"{view.waited_s[r]:.3f}"] for r in ranks]
    if view.unmatched:
        rows.append(["-", f"groups not matched across ranks: {html.escape(', '.join(view.unmatched))}", ""])
    return rows


FIGURE_NOTES = {
    "Per step": "Step time and loader wait: one point per committed step. Planned imbalance and measured bubble: "
                "one point per log window (every train.log_every steps), not per step.",
    "Quality, capacity and calibration": "Loss and AUC: per log window. Samples per step: per committed step.",
}


def render(run: RunLogs) -> str:
    figures = [("Per step", fig_steps(run)), ("Quality, capacity and calibration", fig_quality(run))]
    if run.fault_tolerant:
        figures.append(("Fault tolerance timeline", fig_timeline(run)))
    kills, catches = len(run.kills), sum(len(g.catch_ups) for g in run.groups)
    headline = (f"{len(run.groups)} group(s); {kills} kill(s); {catches} catch-up(s); "
                f"{sum(len(g.commits) for g in run.groups)} committed step records")
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>freescale run report: {html.escape(str(run.root))}"
             f"</title><style>{STYLE}</style></head><body>",
             f"<h1>freescale run report</h1><p>{html.escape(str(run.root))}<br>{headline}</p>",
             "<h2>Groups</h2>" + _table(summary_rows(run), ["group", "model", "ranks", "incarnations", "commits", "steps",
                                                            "recovering steps", "samples/s", "train loss", "train AUC",
                                                            "eval"])]
    if run.notes:
        parts.append("<h2>Reading the logs</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in run.notes)
                     + "</ul>")
    waits = wait_rows(run.root)
    if waits:
        parts.append("<h2>Who the others waited for</h2><p class=note>From the ranks' collective traces "
                     "(train.trace_comm): each collective matched across the ranks, the rank blocked least in it "
                     "arrived last, and the others waited for it the difference (the C4 view).</p>"
                     + _table(waits, ["rank", "collectives it arrived last at", "others waited for it (s)"]))
    events = event_rows(run)
    parts.append("<h2>What happened</h2>" + (_table([row for _, row in events], ["t (s)", "group", "event", "detail"])
                                            if events else "<p class=note>no kill, restart, catch-up or redo</p>"))
    for title, fig in figures:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if title in FIGURE_NOTES:
            parts.append(f"<p class=note>{FIGURE_NOTES[title]}</p>")
        parts.append(f"<img alt='{html.escape(title)}' src='data:image/png;base64,{_png(fig)}'>")
    parts.append("<p class=note>From the run's logs (freescale/run_log.py) and rank&lt;r&gt;.killed files; "
                 "written by <code>freescale report</code>.</p></body></html>")
    return "\n".join(parts)


def write_report(root: Path, out: Path | None = None) -> Path:
    """Read ``root``'s logs and write the page (default ``root/report.html``); ``root`` may name the log itself."""
    if root.name == "train_log.jsonl" and root.is_file():
        root = root.parent
        if root.name.startswith("replica") and root.name[len("replica"):].isdigit():  # one group's: the whole run's
            root = root.parent
    run = read_run(root)
    page = out or root / "report.html"
    try:
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(render(run))
    except OSError as exc:
        raise ReportError(f"{page}: cannot write ({exc.strerror})") from None
    return page
