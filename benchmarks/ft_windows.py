"""The windows ``bench_ft.py`` reads from the replicas' logs around a failure: the survivors' step before, during
and after a catch-up, and the job's throughput kept from the kill to the run's end (both systems alike)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ft_processes import step_ms


def steady_before(survivor: list[dict[str, Any]], joined: int) -> tuple[float, str]:
    """The survivors' step before the restarted replica joins: steps 25 .. joined-2 (two replicas,
    after the kill's redo).  When the restart took fewer steps than that (the 51M model: ~2 s
    steps), steps 5 .. 19 before the kill instead (three replicas: slower, so the ratio reads low)."""
    after = [e for e in survivor if 25 <= e["step"] < joined - 1]
    if len(after) >= 3:
        return step_ms(after, skip=0), f"steps 25..{joined - 2}"
    return step_ms([e for e in survivor if 5 <= e["step"] < 20], skip=0), "steps 5..19, before the kill (3 replicas)"


def during_ms(survivor: list[dict[str, Any]], joined: int, done: int, redone: int) -> float:
    """The survivors' step while the restarted replica catches up: the steps ``joined .. done + 1``, less the redo of
    the step the kill failed (its cost is the kill row's: a replica restarted within it joins that very step); two
    steps at least."""
    first = max(joined, redone + 1)
    return step_ms([e for e in survivor if first - 1 <= e["step"] <= max(done + 1, first + 1)], skip=0)


def steady_after(survivor: list[dict[str, Any]], done: int, count: int = 10) -> dict[str, float]:
    """``{"after_ms": ...}``: the survivors' step once the restarted replica contributes, steps ``done + 2 ..
    done + 1 + count`` (the same replicas as during the catch-up, at the machine's load of that moment: the fair
    baseline for the ratio; ``steady_before``'s window mixes in the machine's drift and, for the big model, a
    third replica).  Empty when fewer than 3 such steps ran."""
    after = [e for e in survivor if done + 2 <= e["step"] < done + 2 + count]
    return {"after_ms": step_ms(after, skip=0)} if len(after) >= 3 else {}


def throughput_kept(logs: list[list[dict[str, Any]]], reference: list[dict[str, Any]], killed: float,
                    contributing: Callable[[dict[str, Any]], bool],
                    step_of: Callable[[dict[str, Any]], int]) -> dict[str, float]:
    """The job's side of a failure, for both systems alike: the contributions (a replica's committed step that
    carries its gradient: one batch of samples) to the steps from the kill to the run's end (the same number of
    steps for every system), per second of those steps, over the same for the steps before the kill (after
    ``reference``'s sixth: all 3 replicas).  Counted by step (``step_of``: the step every replica numbers alike),
    timed by ``reference``'s commits of whole steps: the replicas commit one step ~0.1-0.3 s apart, so one
    replica's clock would cut a step's contributions at either end.  It weighs what each design trades: the
    survivors' stall at the kill and during a heal, the steps discarded, how soon the restarted replica
    contributes again; over this run's length (the kill at step 20: a longer run pulls every system towards 1).
    ``logs``: every replica's log, both incarnations of the killed one.  Not measured (``kept_why`` says why)
    when the reference has fewer than 6 commits or none before the kill."""
    before_kill = [e for e in reference if e["committed"] <= killed]
    if len(reference) < 6 or len(before_kill) < 7:
        return {"kept_why": f"{len(reference)} commits, {len(before_kill)} before the kill: too few to compare"}
    first, last_before, last = reference[5], max(before_kill, key=lambda e: e["committed"]), reference[-1]
    s0, s1, s2 = step_of(first), step_of(last_before), step_of(last)
    counted = [step_of(e) for log in logs for e in log if contributing(e)]
    before, after = sum(s0 < s <= s1 for s in counted), sum(s1 < s <= s2 for s in counted)
    span_before, span_after = last_before["committed"] - first["committed"], last["committed"] - last_before["committed"]
    if not (before and span_before > 0 and span_after > 0):
        return {"kept_why": "no contribution before the kill, or no time between the steps compared"}
    return {"kept": (after / span_after) / (before / span_before), "kept_before": before, "kept_after": after,
            "kept_window_s": span_after}
