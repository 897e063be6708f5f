"""The ETTR simulator (``freescale.sim``): validation gates against published figures, its
closed forms, and its bookkeeping.  Seconds in all (quick gates)."""

from __future__ import annotations

import math

import pytest

from freescale.sim.closed_form import paper_accounting
from freescale.sim.engine import simulate
from freescale.sim.gates import crusoe_torchft, ft_hsdp, run_gates, sync_baseline
from freescale.sim.params import Cluster, Policy, SimError
from freescale.sim.trace import make_trace

INF = math.inf


@pytest.fixture(scope="module")
def gates() -> dict[str, object]:
    return {g.name: g for g in run_gates(quick=True)}


def test_published_accountings_of_the_synchronous_baseline() -> None:
    """FT-HSDP's 44% is ``1 - lambda*s``; the renewal accountings give 64% and 57%."""
    got = paper_accounting(18 * 60, 10 * 60)
    assert round(100 * got["queue"]) == 44
    assert round(100 * got["renewal"]) == 64
    assert round(100 * got["restart"]) == 57


def test_every_gate_passes(gates: dict[str, object]) -> None:
    failed = [g.row() for g in gates.values() if not g.passed]
    assert not failed, failed


def test_named_gates_reproduce_the_published_figures() -> None:
    base = {g.accounting: g.got for g in sync_baseline(8_000)}
    assert abs(base["queue"] - 44.4) <= 1 and abs(base["renewal"] - 64.3) <= 1 and abs(base["restart"] - 57.4) <= 1
    assert abs(ft_hsdp(2_000).got - 80) <= 3
    assert abs(crusoe_torchft(2_000).got - 82.3) <= 2


def _cluster(**kw: object) -> Cluster:
    base = dict(gpus=96, gpus_per_replica=8, crash_per_gpu_hour=0.02, hang_per_gpu_hour=0.01,
                slow_per_gpu_hour=0.01, correlated_fraction=0.1, step_s=5.0, state_gb=4.0)
    return Cluster(**{**base, **kw})  # type: ignore[arg-type]


POLICIES = [
    Policy("sync", "sync", {"crash": 30.0, "hang": 600.0, "slow": INF}, restart_s=400.0,
           checkpoint_interval_s=1800.0, checkpoint_cost_s=30.0),
    Policy("torchft", "torchft", {"crash": 5.0, "hang": 60.0, "slow": INF}, restart_s=300.0, reconfigure_s=10.0),
    Policy("freescale", "freescale", {"crash": 0.2, "hang": 3.0, "slow": 60.0}, restart_s=300.0, reconfigure_s=10.0,
           catchup_slowdown=1.2, replay_s=1.0, overhead=0.014),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_breakdown_accounts_for_every_gpu_second_and_runs_are_seeded(policy: Policy) -> None:
    cluster = _cluster()
    horizon = 200 * 3600.0
    trace = make_trace(cluster, horizon, seed=5)
    out = simulate(cluster, policy, trace, horizon, bins=50)
    assert sum(out.breakdown.values()) == pytest.approx(1.0, abs=1e-6)
    assert out.ettr == pytest.approx(out.breakdown["useful"])
    assert 0 < out.ettr < 1 and out.failures > 0 and len(out.series_rate) == 50
    assert out.wall_s == pytest.approx(horizon)
    again = simulate(cluster, policy, make_trace(cluster, horizon, seed=5), horizon, bins=50)
    assert again.ettr == out.ettr and again.stalls_s == out.stalls_s


def test_policies_differ_where_they_should() -> None:
    """On one trace: torchft discards a step per failure, this project none; sync rolls back."""
    cluster = _cluster(slow_per_gpu_hour=0.0)
    horizon = 300 * 3600.0
    trace = make_trace(cluster, horizon, seed=9)
    outs = {p.name: simulate(cluster, p, trace, horizon) for p in POLICIES}
    assert outs["freescale"].steps_discarded == 0
    assert outs["torchft"].steps_discarded > 0.8 * outs["torchft"].failures
    assert "redone work (since checkpoint)" in outs["sync"].breakdown
    assert outs["freescale"].ettr > outs["torchft"].ettr > outs["sync"].ettr
    assert outs["freescale"].stall_stats()["p50"] < outs["torchft"].stall_stats()["p50"]


def test_slow_replica_kept_at_reduced_share() -> None:
    """Slow episodes only: everyone waits under torchft; here the slow group's share is lost once detected."""
    cluster = _cluster(crash_per_gpu_hour=0.0, hang_per_gpu_hour=0.0, slow_per_gpu_hour=0.05, slow_duration_s=1800.0)
    horizon = 100 * 3600.0
    trace = make_trace(cluster, horizon, seed=2)
    tft, ours = (simulate(cluster, p, trace, horizon) for p in POLICIES[1:])
    assert tft.breakdown["slow replicas"] > 3 * ours.breakdown["slow replicas"]


@pytest.mark.parametrize(("field", "value"), [("gpus", 0), ("slow_speed", 1.5), ("correlated_fraction", -0.1),
                                              ("gpus_per_replica", 10_000), ("trace", "bursty")])
def test_bad_input_names_the_field(field: str, value: object) -> None:
    cluster = _cluster(**{field: value})
    with pytest.raises(SimError, match=field):
        simulate(cluster, POLICIES[0], [], 10.0)
