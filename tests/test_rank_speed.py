"""Fail-slow verdicts (``freescale.rank_speed``): the decisions every rank computes from the gathered numbers.

The exchange itself (one all-gather) runs in the 2-rank test of ``tests/test_pipeline.py``; here the gathered
table is given, so each decision is checked on numbers chosen for it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from freescale import rank_speed
from freescale.config import ConfigError
from freescale.rank_speed import BalanceConfig, RankSpeed


def gathered(monkeypatch: pytest.MonkeyPatch, speeds: list[float], busy: list[float], wall: float) -> None:
    def table(mine: float, *_: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
        n = len(speeds)  # every rank measured what this one did: none, or enough steps for an estimate
        given = np.array(speeds) if np.isfinite(mine) else np.full(n, np.nan)
        return given, given, np.array(busy), np.full(n, wall), [f"host{r}" for r in range(n)]

    monkeypatch.setattr(rank_speed, "_gather", table)


def measured(speed: RankSpeed, step: int) -> RankSpeed:
    for s in range(step - 10, step):
        speed.add(s, 100.0, 1.0, 1.0)  # enough steps for an estimate (the table above is what counts)
    return speed


def check(speed: RankSpeed, step: int) -> Any:
    return measured(speed, step).check(step)


def test_report_flags_a_slow_rank_once_and_its_recovery_once(monkeypatch: pytest.MonkeyPatch) -> None:
    speed = RankSpeed(BalanceConfig(), rebalance=False)
    gathered(monkeypatch, [100.0, 98.0, 102.0], [1.0, 1.0, 1.0], 1.0)
    assert not check(speed, 5).flagged  # healthy: nothing said
    gathered(monkeypatch, [100.0, 98.0, 40.0], [1.0, 1.0, 2.5], 2.5)
    assert not check(speed, 8).flagged  # one window below the threshold is not enough (noise)
    first = check(speed, 10)
    assert first.flagged == [2] and not first.replan and abs(first.shares[2] - 0.404) < 0.01  # type: ignore[index]
    assert first.relative.tolist() == pytest.approx([1.0, 0.98, 0.4])
    again = check(speed, 15)
    assert not again.flagged and not again.recovered  # said once
    gathered(monkeypatch, [100.0, 98.0, 80.0], [1.0, 1.0, 1.2], 1.2)
    assert not check(speed, 20).recovered  # above the threshold, not yet half-way back to the median
    gathered(monkeypatch, [100.0, 98.0, 95.0], [1.0, 1.0, 1.05], 1.05)
    back = check(speed, 25)
    assert back.recovered == [2] and not speed.slow


def test_rebalance_tries_a_smaller_share_and_keeps_it_only_if_steps_got_no_slower(
        monkeypatch: pytest.MonkeyPatch) -> None:
    speed = RankSpeed(BalanceConfig(slow_policy="rebalance"), rebalance=True)
    gathered(monkeypatch, [100.0, 100.0, 50.0], [1.0, 1.0, 2.0], 2.0)
    check(speed, 5)
    flagged = check(speed, 10)
    assert flagged.flagged == [2] and flagged.replan and flagged.capacities == {2: 0.5}
    # The trial's steps were faster: kept, and corrected by the busy times (the slow rank still the longest).
    gathered(monkeypatch, [100.0, 100.0, 40.0], [1.2, 1.2, 1.5], 1.5)
    assert speed.plan_lag == 0 and not check(speed, 11).replan  # (the steps of the new plan: from 11 on)
    kept = check(speed, 21)
    assert kept.replan and kept.capacities == {2: pytest.approx(0.5 * 1.2 / 1.5)}
    # That correction made the steps slower: undone, and the capacity stays (no flag, no replan after it).
    gathered(monkeypatch, [100.0, 100.0, 38.0], [1.25, 1.25, 1.4], 1.8)
    undone = check(speed, 32)
    assert undone.replan and undone.capacities == {2: 0.5} and not undone.flagged and not undone.recovered
    gathered(monkeypatch, [100.0, 100.0, 38.0], [1.25, 1.25, 1.4], 1.6)
    assert not check(speed, 43).replan  # settled
    # The rank sped up: its busy time falls under the others', its capacity grows back, and it recovers.
    gathered(monkeypatch, [100.0, 100.0, 100.0], [1.3, 1.3, 0.6], 1.3)
    recovered = check(speed, 54)
    assert recovered.recovered == [2] and recovered.replan and recovered.capacities is None


def test_an_undone_first_trial_leaves_the_rank_flagged_once_at_full_share(monkeypatch: pytest.MonkeyPatch) -> None:
    speed = RankSpeed(BalanceConfig(slow_policy="rebalance"), rebalance=True)
    gathered(monkeypatch, [100.0, 50.0], [1.0, 2.0], 2.0)
    check(speed, 5)
    assert check(speed, 10).capacities == {1: 0.5}
    gathered(monkeypatch, [100.0, 45.0], [0.9, 1.2], 2.4)  # slower than letting it set the pace
    undone = check(speed, 21)
    assert undone.replan and undone.capacities is None and not undone.recovered
    for step in (32, 37, 42):
        gathered(monkeypatch, [100.0, 50.0], [1.0, 2.0], 2.0)
        quiet = check(speed, step)
        assert not (quiet.flagged or quiet.recovered or quiet.replan)  # no flag, recovery or replan spam


@pytest.mark.parametrize(("field", "value", "message"), [
    ("slow_policy", "evict", "slow_policy: must be one of"), ("slow_threshold", 1.0, "slow_threshold: must be in"),
    ("speed_window", 2, "speed_window: must be >= 3"), ("check_every", 0, "check_every: must be >= 1")])
def test_bad_balance_settings_name_the_key(field: str, value: object, message: str) -> None:
    cfg = BalanceConfig()
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_step_records_carry_every_ranks_scores_in_a_small_group_and_the_slowest_in_a_large_one() -> None:
    from freescale.rank_speed import SpeedCheck

    small = SpeedCheck(5, np.array([100.0, 50.0]), np.array([1.0, 0.5]), np.array([1.0, np.nan]), ["a", "b"])
    assert small.scores()["speed_relative"] == [1.0, 0.5]
    speeds = np.linspace(100.0, 5.0, 40)
    large = SpeedCheck(5, speeds, speeds / 100.0, np.ones(40), ["h"] * 40)
    rows = large.scores()["speed_slowest"]
    assert len(rows) == 16 and [r[0] for r in rows] == list(range(39, 23, -1))  # the slowest first


def test_a_rank_never_measured_healthy_has_no_individual_score(monkeypatch: pytest.MonkeyPatch) -> None:
    speed = RankSpeed(BalanceConfig(), rebalance=False)
    monkeypatch.setattr(rank_speed, "_gather", lambda *_: (np.array([100.0, 40.0]), np.array([100.0, 0.0]),
                                                            np.ones(2), np.ones(2), ["a", "b"]))
    result = check(speed, 10)
    assert result.individual[0] == 1.0 and np.isnan(result.individual[1])
