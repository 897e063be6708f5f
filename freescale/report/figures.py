"""The report's figures (matplotlib, Agg): per step, quality and capacity, and the fault-tolerance timeline.

Each function takes ``RunLogs`` and returns a figure; ``freescale.report.page`` embeds them.
Steps are the x axis of the per-step figures (every group's commits on one axis); wall time
since the run's first event is the x axis of the timeline.  Step time, loader wait and samples
per step are per committed step (thinned for long runs: ``logs.THIN_ABOVE``); imbalance,
bubble, loss and AUC are per log window (``step`` events, every ``train.log_every`` steps).
"""

from __future__ import annotations

from typing import Any

from freescale.plotting import pyplot
from freescale.report.logs import GroupLog, Kill, RunLogs

GROUP_COLORS = ["#2471a3", "#e67e22", "#27ae60", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d4ac0d"]


def color(group: int) -> str:
    return GROUP_COLORS[group % len(GROUP_COLORS)]


def kill_step(run: RunLogs, kill: Kill) -> int | None:
    """The step the other groups were committing when the kill landed: the first they committed without the
    killed group after it (a record of the step before may be written just after the kill: the other groups
    log their commit while the killed one already runs the next step), else the first commit after it."""
    after = [(kill.group in groups_of(c), c["step"]) for g in run.groups if g.group != kill.group
             for c in g.commits if c["time"] >= kill.time]
    return min(after)[1] if after else None


def groups_of(commit: dict[str, Any]) -> set[int]:
    """The replica groups that committed ``commit`` (its participants' indices)."""
    ids = (str(p)[len("replica"):] for p in commit.get("participants", []))
    return {int(i) for i in ids if i.isdigit()}


def _finish(fig: Any, axes: Any, run: RunLogs, titles: list[str], legend_at: str) -> Any:
    """The per-step figures' common dressing: kill marks (labelled once), titles, grid, legends."""
    for i, (ax, title) in enumerate(zip(axes, titles)):
        _mark_kills(ax, run, label=i == 0)
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc=legend_at)
    fig.tight_layout()
    return fig


def _mark_kills(ax: Any, run: RunLogs, label: bool) -> None:
    for kill in run.kills:
        step = kill_step(run, kill)
        if step is not None:
            ax.axvline(step, color="#c0392b", ls="--", lw=1)
            if label:
                ax.annotate(f"SIGKILL g{kill.group}/r{kill.rank}", (step, 1), xycoords=("data", "axes fraction"),
                            xytext=(3, -10), textcoords="offset points", color="#c0392b", fontsize=8)


def gapped(steps: list[int], values: list[float], stride: int = 1) -> tuple[list[float], list[float]]:
    """Break the line where steps are missing (a group that was down): NaN after the last step it
    had.  ``stride``: the commits were thinned to every ``stride``-th, so only a longer gap is one."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (x, y) in enumerate(zip(steps, values)):
        if i and x > steps[i - 1] + stride:
            xs.append(steps[i - 1] + 1)
            ys.append(float("nan"))
        xs.append(x)
        ys.append(y)
    return xs, ys


def _windows(group: GroupLog, key: str) -> tuple[list[int], list[float]]:
    rows = [e for e in group.of("step") if isinstance(e.get(key), (int, float))]
    return [e["step"] for e in rows], [float(e[key]) for e in rows]


def fig_steps(run: RunLogs) -> Any:
    """Step time per step; planned imbalance and measured bubble per logged window; loader wait."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(12, 8.5), sharex=True)
    for g in run.groups:
        commits = g.commits
        steps = [c["step"] for c in commits]
        axes[0].plot(*gapped(steps, [1000 * c.get("seconds", 0.0) for c in commits], g.stride), ".-", ms=3, lw=0.8,
                     color=color(g.group), label=f"group {g.group}")
        x, imb = _windows(g, "imbalance")
        axes[1].plot(x, imb, "o-", color=color(g.group), label=f"imbalance (planned), group {g.group}")
        x, bubble = _windows(g, "bubble")
        axes[1].plot(x, bubble, "s--", color=color(g.group), alpha=0.7, label=f"bubble (measured), group {g.group}")
        axes[2].plot(steps, [1000 * c.get("batch_wait_s", 0.0) for c in commits], ".", ms=3, color=color(g.group),
                     label=f"loader wait per step, group {g.group}")
    axes[0].set_ylabel("step time (ms)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("ratio")
    axes[2].set_ylabel("loader wait (ms)")
    axes[2].set_xlabel("step")
    titles = ["step time (commit to commit, per group)", "planned imbalance (max/mean cost) and measured bubble "
              "per log window", "loader wait (time the step waited for its batch)"]
    return _finish(fig, axes, run, titles, legend_at="upper right")


def fig_quality(run: RunLogs) -> Any:
    """Loss and AUC (a retrieval run: eval HR@10) per log window; samples each group trained per step
    (capacity) and calibrations."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(12, 7.5), sharex=True)
    retrieval = any("hr@10" in e for g in run.groups for e in g.of("eval"))
    quality, shown = ("hr@10", "HR@10") if retrieval else ("auc", "AUC")
    for g in run.groups:
        for ax, key in ((axes[0], "loss"), (axes[1], quality)):
            x, y = _windows(g, key)
            ax.plot(x, y, "o-", color=color(g.group), label=f"train {key}, group {g.group}")
        checks = [e for e in g.of("validate") if isinstance(e.get(quality), (int, float))]
        if checks:
            axes[1].plot([e["step"] for e in checks], [e[quality] for e in checks], "s--", color=color(g.group),
                         label=f"validation {shown}, group {g.group}")
        decisions = g.of("validation_decision")
        if decisions and decisions[-1].get("best_step", -1) >= 0:
            axes[1].axvline(decisions[-1]["best_step"], color=color(g.group), ls=":", lw=1)
            axes[1].annotate("best", (decisions[-1]["best_step"], 0.05), xycoords=("data", "axes fraction"), fontsize=7)
        evals = [e for e in g.of("eval") if isinstance(e.get(quality), (int, float))]
        last = g.commits[-1]["step"] if g.commits else 0
        for e in evals:
            at = e.get("best_step", last)  # the test evaluation of the best validated step, or of the last
            axes[1].plot([at], [e[quality]], "*", ms=12, color=color(g.group), label=f"eval {shown}, group {g.group}")
        commits = g.commits
        axes[2].step(*gapped([c["step"] for c in commits], [c.get("weight", c.get("samples", 0)) for c in commits],
                             g.stride), where="post", color=color(g.group), label=f"samples trained by group {g.group}")
        for e in g.of("calibrate"):
            axes[2].axvline(e["step"], color="#7f8c8d", ls=":", lw=1)
            axes[2].annotate("calibrated", (e["step"], 0.9), xycoords=("data", "axes fraction"), fontsize=7)
    axes[0].set_ylabel("loss")
    axes[1].set_ylabel(shown)
    axes[2].set_ylabel("samples / step")
    axes[2].set_xlabel("step")
    titles = ["training loss per log window", f"training {shown} per log window (squares: validation; stars: the "
              "test evaluation, at the best validated step when one was kept)" if not retrieval
              else "validation HR@10 (squares) and test HR@10 (star; training reports the sampled loss only)",
              "capacity: samples each group trained per step (a lost group's rows move to the others); calibrations"]
    return _finish(fig, axes, run, titles, legend_at="best")


def catchup_phases(run: RunLogs, g: GroupLog, caught: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(phase, start, end) in wall time: waiting for the group's ranks, download, load + replay."""
    started, ready, finished = (caught.get(k) for k in ("started", "group_ready", "finished"))
    if not (isinstance(started, (int, float)) and isinstance(ready, (int, float)) and isinstance(finished, (int, float))):
        return []
    first = [c["time"] for c in g.commits if c["time"] >= finished and c.get("contributing")]
    phases = [("ranks ready", started, ready), ("download", ready, finished)]
    if first:
        phases.append(("load + replay, first contributing step", finished, first[0]))
    return phases


PHASE_COLORS = {"ranks ready": "#f5b041", "download": "#5dade2", "load + replay, first contributing step": "#58d68d"}


def _lane(ax: Any, run: RunLogs, g: GroupLog, y: float) -> None:
    t0 = run.t0
    commits = g.commits
    ok = [c for c in commits if c.get("contributing", True)]
    idle = [c for c in commits if not c.get("contributing", True)]
    ax.plot([c["time"] - t0 for c in ok], [y] * len(ok), "|", ms=10, color=color(g.group))
    ax.plot([c["time"] - t0 for c in idle], [y] * len(idle), "|", ms=10, color="#b2babb")
    redo = [c for c in commits if c.get("attempts", 1) > 1]
    ax.plot([c["time"] - t0 for c in redo], [y + 0.25] * len(redo), "v", color="#d35400", ms=8,
            label="redo (attempts > 1)" if redo else None)
    for start in g.of("start"):
        if start.get("incarnation", 0) > 0:
            ax.plot([start["time"] - t0], [y], "^", color="#7d3c98", ms=9, label="restarted (new incarnation)")
    for caught in g.catch_ups:
        for phase, a, b in catchup_phases(run, g, caught):
            ax.barh(y - 0.3, b - a, left=a - t0, height=0.2, color=PHASE_COLORS[phase], label=f"catch-up: {phase}")


def fig_timeline(run: RunLogs) -> Any:
    """Per group: committed steps (grey: recovering, weight 0), kills, restarts, redo attempts,
    catch-up phases; quorum membership; committed step number over wall time."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(12, 8.5), sharex=True, gridspec_kw={"height_ratios": [2, 1, 1.3]})
    t0 = run.t0
    for i, g in enumerate(run.groups):
        _lane(axes[0], run, g, i)
        commits = g.commits
        axes[1].step([c["time"] - t0 for c in commits], [len(c.get("participants", [g.group])) for c in commits],
                     where="post", color=color(g.group), label=f"quorum size seen by group {g.group}")
        axes[2].plot([c["time"] - t0 for c in commits], [c["step"] for c in commits], ".", ms=3,
                     color=color(g.group), label=f"committed steps, group {g.group}")
    for kill in run.kills:
        lane = [i for i, g in enumerate(run.groups) if g.group == kill.group]
        for ax in axes:
            ax.axvline(kill.time - t0, color="#c0392b", ls="--", lw=1)
        axes[0].plot([kill.time - t0], lane or [0], "X", color="#c0392b", ms=12,
                     label=f"SIGKILL group {kill.group} rank {kill.rank}")
    axes[0].set_yticks(range(len(run.groups)), [f"group {g.group}" for g in run.groups])
    axes[0].set_ylim(-0.7, len(run.groups) - 0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0].legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    axes[1].set_ylabel("participants")
    axes[2].set_ylabel("step")
    axes[2].set_xlabel("seconds since the run's first event")
    titles = ["committed steps per group (ticks; grey: recovering, not contributing), kills, restarts, redo attempts,"
              " catch-up", "quorum membership", "committed step over wall time"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    for ax in axes[1:]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig
