"""Fail-slow verdicts (``freescale.rank_speed``): the decisions every rank computes from the gathered numbers.

The exchange itself (one all-gather) runs in the 2-rank test of ``tests/test_pipeline.py``; here the gathered
table is given, so each decision is checked on numbers chosen for it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from freescale import rank_speed
from freescale.config import ConfigError
from freescale.rank_speed import BalanceConfig, RankSpeed, SpeedTable


def given(monkeypatch: pytest.MonkeyPatch, table: Callable[[float], SpeedTable]) -> None:
    """Every ``ask``'s all-gather answers ``table(this rank's speed)``."""

    class Given:
        def __init__(self, mine: float, *_: Any) -> None:
            self.mine = mine

        def table(self) -> SpeedTable:
            return table(self.mine)

    monkeypatch.setattr(rank_speed, "_Gathering", Given)


def gathered(monkeypatch: pytest.MonkeyPatch, speeds: list[float], busy: list[float], wall: float) -> None:
    def table(mine: float) -> SpeedTable:
        n = len(speeds)  # every rank measured what this one did: none, or enough steps for an estimate
        measured = np.array(speeds) if np.isfinite(mine) else np.full(n, np.nan)
        return SpeedTable(measured, measured, np.array(busy), np.full(n, wall), [f"host{r}" for r in range(n)])

    given(monkeypatch, table)


def measured(speed: RankSpeed, step: int) -> RankSpeed:
    for s in range(step - 10, step):
        speed.add(s, 100.0, 1.0, 1.0)  # enough steps for an estimate (the table above is what counts)
    return speed


def check(speed: RankSpeed, step: int) -> Any:
    """The verdict on the table asked at ``step`` (the trainer judges it a step later: the same verdict)."""
    measured(speed, step).ask(step)
    answered = speed.answer()
    assert answered is not None and answered[0] == step and speed.answer() is None  # read once
    return speed.judge(step, answered[1])


def test_report_flags_a_slow_rank_once_and_its_recovery_once(monkeypatch: pytest.MonkeyPatch) -> None:
    speed = RankSpeed(BalanceConfig())
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
    speed = RankSpeed(BalanceConfig(slow_policy="rebalance"))
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
    speed = RankSpeed(BalanceConfig(slow_policy="rebalance"))
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
    ("slow_policy", "fastest", "slow_policy: must be one of"), ("slow_threshold", 1.0, "slow_threshold: must be in"),
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
    speed = RankSpeed(BalanceConfig())
    given(monkeypatch, lambda _: SpeedTable(np.array([100.0, 40.0]), np.array([100.0, 0.0]), np.ones(2), np.ones(2),
                                            ["a", "b"]))
    result = check(speed, 10)
    assert result.individual[0] == 1.0 and np.isnan(result.individual[1])


class _Planned:
    """The loader's side a ``SpeedShare`` uses: the capacities it plans with."""

    def __init__(self) -> None:
        self.planner = self
        self.capacities: dict[int, float] | None = None
        self.calls: list[dict[int, float] | None] = []

    def set_capacities(self, capacities: dict[int, float] | None) -> None:
        self.capacities = capacities
        self.calls.append(capacities)


def _group_tables(monkeypatch: pytest.MonkeyPatch, rows: dict[int, list[float]], done: int = 15,
                  group_size: int = 2) -> dict[int, Any]:
    """Each group's side header for the step two after a check at ``done`` (asked after step ``done - 1``'s
    commit, read after step ``done``'s, told with step ``done + 1``): groups of two ranks whose speeds are
    ``rows[group]`` (busy seconds inverse to speed)."""
    from freescale.speed_share import SpeedShare

    headers = {}
    for group, speeds in rows.items():
        given(monkeypatch, lambda _, s=speeds, g=group: SpeedTable(
            np.array(s), np.array(s), 100.0 / np.array(s), np.full(len(s), 1.0), [f"g{g}r{r}" for r in range(len(s))]))
        share = SpeedShare(measured(RankSpeed(BalanceConfig()), done), _Planned(), group,  # type: ignore[arg-type]
                           group_size)
        share.speed.ask(done)
        assert share.header().tolist() == [0] * share.size  # step ``done``: not read yet
        share.collect()
        headers[group] = share.header()
        assert int(headers[group][0]) == done + 2  # judged at step ``done + 1``'s commit
        assert share.header().tolist() == [0] * share.size  # told once
    return headers


def test_every_group_judges_the_whole_jobs_table_from_the_step_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica groups of two ranks: group 2 is slow as a whole (its own ranks are alike, so only the job's table
    shows it).  Every group decodes the same table from the headers and plans the same capacities; a group
    that did not gather for this step (catching up) is unknown, not slow; the state a catching-up group loads
    makes it judge the next check as the others do."""
    from freescale.speed_share import SpeedShare
    from freescale.step_types import Commit

    headers = _group_tables(monkeypatch, {0: [100.0, 98.0], 1: [101.0, 99.0], 2: [40.0, 41.0]})
    headers[3] = torch.zeros_like(headers[0])  # group 3 is catching up: it told nothing
    cfg = BalanceConfig(slow_policy="rebalance", check_every=10)
    commit = Commit(16, frozenset({0, 1, 2}), frozenset({0, 1, 2, 3}))
    verdicts, loaders = [], []
    for group in range(4):
        loader = _Planned()
        share = SpeedShare(RankSpeed(cfg), loader, group, 2)  # type: ignore[arg-type]
        share.speed._below = {4: 1, 5: 1}  # (below the threshold at the check before)
        share.on_commit(Commit(15, commit.trained, commit.ready), headers)  # not a check's step: nothing judged
        share.on_commit(commit, headers)
        [check] = share.take()
        verdicts.append((check.flagged, check.capacities, [round(float(v), 4) for v in np.nan_to_num(check.speeds)]))
        loaders.append(loader.calls)
        assert check.hosts[4:6] == ["g2r0", "g2r1"] and np.isnan(check.speeds[6:]).all()
    assert all(v == verdicts[0] for v in verdicts) and all(calls == loaders[0] for calls in loaders)
    assert verdicts[0][0] == [4, 5] and verdicts[0][1] == {4: pytest.approx(0.4, abs=0.01), 5: pytest.approx(0.41, abs=0.01)}
    # A group catching up loads a source's state after step 16 and judges step 26 as the source does.
    source, joiner = (SpeedShare(RankSpeed(cfg), _Planned(), g, 2) for g in (0, 3))  # type: ignore[arg-type]
    source.speed._below = {4: 1, 5: 1}
    source.on_commit(commit, headers)
    joiner.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert joiner.speed.slow.keys() == {4, 5} and joiner.loader.capacities == verdicts[0][1]  # type: ignore[attr-defined]
    source.take()
    later = _group_tables(monkeypatch, {0: [100.0, 98.0], 1: [101.0, 99.0], 2: [80.0, 70.0], 3: [99.0, 98.0]}, 25)
    judged = []
    for share in (source, joiner):
        share.on_commit(Commit(26, commit.ready, commit.ready), later)
        [check] = share.take()
        judged.append((check.flagged, check.recovered, check.replan, check.capacities, share.state_dict()))
    assert judged[0] == judged[1] and judged[0][2]  # the same correction of the slow ranks' capacities


def test_evict_stops_only_the_group_holding_the_fail_slow_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from freescale.speed_share import SpeedShare
    from freescale.step_types import Commit

    headers = _group_tables(monkeypatch, {0: [100.0, 98.0], 1: [101.0, 40.0]})
    cfg = BalanceConfig(slow_policy="evict", check_every=10)
    for group in (0, 1):
        share = SpeedShare(RankSpeed(cfg), _Planned(), group, 2)  # type: ignore[arg-type]
        share.speed._below = {3: 1}
        share.speed._below[2] = 1  # (group 1's other rank was below once too)
        share.on_commit(Commit(16, frozenset({0, 1}), frozenset({0, 1})), headers)
        [check] = share.take()
        assert check.flagged == [3] and not share.speed.slow and 2 not in share.speed._below  # judged anew when back
        if group == 1:
            assert share.evicted is not None and "replica group 1 evicted as fail-slow at step 16" in str(share.evicted)
        else:
            assert share.evicted is None
    # Group 0 is catching up: group 1 holds the only valid state, so it is kept (and said so), not evicted.
    share = SpeedShare(RankSpeed(cfg), _Planned(), 1, 2)  # type: ignore[arg-type]
    share.speed._below = {3: 1}
    share.on_commit(Commit(16, frozenset({1}), frozenset({1})), headers)
    [check] = share.take()
    assert share.evicted is None and check.kept_groups == [1] and 3 in share.speed.slow
    lines = check.announce(lambda *_, **__: None, "evict", 2)
    assert any("replica group 1 is fail-slow but no other group holds the run's state" in line for line in lines)


def test_a_large_group_tells_its_slowest_ranks_and_the_median_of_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header's size does not grow with the group: 40 ranks tell their 16 slowest rows and the others'
    median; the judged table has the slow ranks exact, the others at that median; the lighthouse is told at
    most 64 fail-slow ranks, the slowest."""
    from freescale import speed_share
    from freescale.speed_share import TOLD_RANKS, SpeedShare
    from freescale.step_types import Commit

    speeds = [100.0 + r for r in range(40)]
    speeds[7], speeds[31] = 30.0, 40.0
    headers = _group_tables(monkeypatch, {0: speeds, 1: [101.0] * 40}, group_size=40)
    share = SpeedShare(RankSpeed(BalanceConfig(check_every=10)), _Planned(), 0, 40)  # type: ignore[arg-type]
    assert share.size == headers[0].numel() == 1 + 4 + TOLD_RANKS * 13
    table = share._table(16, headers)
    assert table.speeds[7] == 30.0 and table.speeds[31] == 40.0 and table.hosts[7] == "g0r7"
    told = sorted(speeds)[:TOLD_RANKS]
    assert sorted(table.speeds[:40])[:TOLD_RANKS] == told
    assert np.isclose(table.speeds[39], np.median(sorted(speeds)[TOLD_RANKS:]), rtol=1e-6) and table.hosts[39] == ""
    share.speed._below = {7: 1, 31: 1}
    share.on_commit(Commit(16, frozenset({0, 1}), frozenset({0, 1})), headers)
    assert [e["rank"] for e in share.notes()["fail_slow"]] == [7, 31]
    monkeypatch.setattr(speed_share, "NOTED", 1)
    assert [e["rank"] for e in share.notes()["fail_slow"]] == [7]  # the slowest


def test_the_side_header_rides_ahead_of_the_exchange_header_through_the_weighted_reduction() -> None:
    from freescale.ft.step_result import join_headers, split_headers
    from freescale.ft.weighted_reduce import FlatReduction
    from freescale.grad_buckets import BucketLayout

    layout = BucketLayout.single([3])
    sides = [torch.tensor([5, 2**33 + 1]), torch.tensor([0, 7])]
    exchanges = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 2**39])]
    parts = [FlatReduction(layout, 1.0, i, 2, True, join_headers(sides[i], exchanges[i])) for i in range(2)]
    for part in parts:
        part.put(0, torch.ones(3))
    parts[0].flat.add_(parts[1].flat)  # what the all-reduce sums
    side, exchange = split_headers(parts[0].result([torch.zeros(3)]).headers, 2)
    assert [h.tolist() for h in side] == [h.tolist() for h in sides]
    assert [h.tolist() for h in exchange] == [h.tolist() for h in exchanges]
    assert join_headers(None, exchanges[0]) is exchanges[0] and split_headers([torch.arange(3)], 0)[0][0].numel() == 0


def test_the_c4_view_names_the_rank_the_others_wait_for() -> None:
    """Each group's k-th collective matched across the ranks: the rank blocked least arrived last; a group whose
    ranks traced different collectives is named, not matched wrongly."""
    from freescale.comm_report import waited_for
    from freescale.comm_trace import CommEvent

    def trace(blocked: list[float], group: str = "default", op: str = "all_reduce") -> list[CommEvent]:
        return [CommEvent(op, group, 8, "backward", "", step, 0.0, b) for step, b in enumerate(blocked)]

    view = waited_for({0: trace([0.30, 0.20, 0.00005]) + trace([0.1], "dense"),
                       1: trace([0.01, 0.02, 0.0]) + trace([0.1, 0.1], "dense"),
                       2: trace([0.29, 0.21, 0.0])})
    assert view.slowest() == 1 and view.last == {1: 2} and view.waited_s[1] == pytest.approx(0.29 + 0.19)
    assert view.collectives == 3 and view.unmatched == ["dense"]


def test_checks_are_asked_half_a_period_past_the_multiples_where_saves_fall() -> None:
    """A check's ask costs its step a little: never on a step at a multiple of ``check_every`` (where saves,
    validations and log records fall when their periods are multiples of it); read once, a step later."""
    assert [d for d in range(1, 23) if RankSpeed(BalanceConfig()).due(d)] == [2, 7, 12, 17, 22]
    assert all(RankSpeed(BalanceConfig(check_every=1)).due(d) for d in range(1, 5))
    assert not any(RankSpeed(BalanceConfig(check_every=c)).due(d) for c in (2, 5, 10) for d in range(0, 2000, 10))


def test_a_check_asked_before_a_catch_up_replaced_the_state_is_dropped() -> None:
    """The rows asked before a group loads a source's verdicts are this group's old ones: never judged after."""
    speed = measured(RankSpeed(BalanceConfig()), 5)
    speed.ask(5)
    speed.load_state_dict(RankSpeed(BalanceConfig()).state_dict())
    assert speed.answer() is None
