"""The ETTR simulator (``freescale.sim``) and ``freescale simulate``: validation gates against
published figures (run once per module, quick), a gate catching a wrong model, the engine's
bookkeeping, the projection's inputs and rows, and the command's order and one-line errors.
Seconds in all."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from freescale import cli
from freescale.sim import command, engine
from freescale.sim.closed_form import paper_accounting
from freescale.sim.engine import simulate
from freescale.sim.gates import Gate, crusoe_torchft, run_gates
from freescale.sim.params import Cluster, Policy, SimError
from freescale.sim.project import (
    FREESCALE,
    check_grouping,
    check_inputs,
    inputs,
    project,
    replicas_at,
    scenario,
    with_overrides,
)
from freescale.sim.trace import Failure, make_trace
from tests.conftest import REPO

INF = math.inf
RESULTS = REPO / "benchmarks" / "results"


@pytest.fixture(scope="module")
def gates() -> list[Gate]:
    """The quick gates, run once for every test here (the command's tests reuse them)."""
    return run_gates(quick=True)


def test_published_accountings_of_the_synchronous_baseline() -> None:
    """FT-HSDP's 44% is ``1 - lambda*s``; the renewal accountings give 64% and 57% (arithmetic:
    a unit test, not a gate)."""
    got = paper_accounting(18 * 60, 10 * 60)
    assert round(100 * got["queue"]) == 44
    assert round(100 * got["renewal"]) == 64
    assert round(100 * got["restart"]) == 57


def test_every_gate_passes_and_reproduces_the_published_figures(gates: list[Gate]) -> None:
    failed = [g.row() for g in gates if g.blocking and not g.passed]
    assert not failed, failed
    by = {g.name: g for g in gates}
    assert abs(by["sync baseline, simulated (queue)"].got - 44.4) <= 1
    assert abs(by["sync baseline, simulated (renewal)"].got - 64.3) <= 1
    assert abs(by["sync baseline, simulated (restart)"].got - 57.4) <= 1
    assert abs(by["FT-HSDP, simulated"].got - 80) <= 3
    assert abs(by["torchft on Crusoe: steps committed"].got - 82.3) <= 2
    reported = [g for g in gates if not g.blocking]  # the blog's per-step figures: printed, not gated
    assert {g.name for g in reported} == {"torchft on Crusoe: groups participating per step",
                                          "torchft on Crusoe: training efficiency"}
    assert all(g.row()["result"] in ("within", "MISSED") for g in reported)


def test_a_gate_catches_a_wrong_model() -> None:
    """This project's policy commits every step: on the Crusoe run it must fail the gate that
    torchft passes (the gate tells the policies apart, it is not a formality)."""
    committed = crusoe_torchft(300, kind="freescale")[0]
    assert committed.blocking and committed.got > 99 and not committed.passed


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


def test_whole_checkpoint_cycles_at_once_match_cycle_by_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quiet spans are accounted a whole number of checkpoint cycles at a time (a 1K-GPU job runs
    ~10^5 cycles): the same buckets, steps and throughput series as one cycle at a time."""
    cluster = _cluster(crash_per_gpu_hour=2e-4, hang_per_gpu_hour=1e-4, slow_per_gpu_hour=1e-4)
    horizon = 600 * 3600.0
    trace = make_trace(cluster, horizon, seed=5)
    policies = [POLICIES[0], *(replace(p, checkpoint_interval_s=1800.0, checkpoint_cost_s=30.0) for p in POLICIES[1:])]
    fast = [simulate(cluster, p, trace, horizon, bins=40) for p in policies]
    monkeypatch.setattr(engine, "_BULK_CYCLES", 10**18)
    for a, p in zip(fast, policies):
        b = simulate(cluster, p, trace, horizon, bins=40)
        assert a.ettr == pytest.approx(b.ettr, abs=1e-12) and a.steps_committed == pytest.approx(b.steps_committed)
        assert a.series_rate == pytest.approx(b.series_rate, abs=1e-12) and a.stalls_s == b.stalls_s
        assert a.breakdown == pytest.approx(b.breakdown, abs=1e-12)


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


def test_torchft_heal_is_charged_to_the_failure_that_caused_it() -> None:
    """One crash mid-step: the survivors lose the half step, the detection, the rebuild, and
    later the heal (8 GB at 1 GB/s) that blocks them when the group comes back."""
    cluster = Cluster(gpus=4, gpus_per_replica=1, crash_per_gpu_hour=1.0, step_s=1.0, state_gb=8.0)
    policy = Policy("t", "torchft", {"crash": 5.0, "hang": 5.0, "slow": INF}, restart_s=50.0, reconfigure_s=10.0)
    out = simulate(cluster, policy, [Failure(100.5, "crash", (0,))], 1000.0)
    assert out.stalls_s == [pytest.approx(0.5 + 5.0 + 10.0 + 8.0)]
    assert out.breakdown["heal (source blocks)"] * out.wall_s == pytest.approx(8.0)


def test_restart_accounting_keeps_other_groups_heals() -> None:
    """Under ``restart`` a failure restarts the recovery in progress, not another group's heal."""
    cluster = Cluster(gpus=4, gpus_per_replica=1, crash_per_gpu_hour=1.0, step_s=1.0, state_gb=8.0)
    policy = Policy("t", "torchft", {"crash": 5.0, "hang": 5.0, "slow": INF}, restart_s=50.0, reconfigure_s=10.0,
                    recovery="restart")
    # group 0 is back at 155.5 and heals (8 s, queued behind nothing); group 1 fails during that heal
    out = simulate(cluster, policy, [Failure(100.5, "crash", (0,)), Failure(158.0, "crash", (1,))], 2000.0)
    assert out.breakdown["heal (source blocks)"] * out.wall_s == pytest.approx(16.0)


def test_slow_replica_kept_at_reduced_share() -> None:
    """Slow episodes only: everyone waits under torchft; here the slow group's share is lost once detected."""
    cluster = _cluster(crash_per_gpu_hour=0.0, hang_per_gpu_hour=0.0, slow_per_gpu_hour=0.05, slow_duration_s=1800.0)
    horizon = 100 * 3600.0
    trace = make_trace(cluster, horizon, seed=2)
    tft, ours = (simulate(cluster, p, trace, horizon) for p in POLICIES[1:])
    assert tft.breakdown["slow replicas"] > 3 * ours.breakdown["slow replicas"]
    # Planning that wins back half of a slow replica's cost loses more than planning that wins it all, less than none.
    half, none = (simulate(cluster, replace(POLICIES[2], slow_recovered=r), trace, horizon) for r in (0.5, 0.0))
    assert ours.breakdown["slow replicas"] < half.breakdown["slow replicas"] < none.breakdown["slow replicas"]


def test_groups_that_shrink_keep_what_a_lost_gpu_would_take_down() -> None:
    """No spare pool (a lost GPU's slot back after 10 h): a group that waits for it loses all of its GPUs meanwhile;
    one that shrinks loses about one GPU's share (NTP's claim), and every GPU-second is still accounted."""
    cluster = _cluster(hang_per_gpu_hour=0.0, slow_per_gpu_hour=0.0, correlated_fraction=0.0, crash_per_gpu_hour=0.002,
                       repair_s=10 * 3600.0)
    horizon = 400 * 3600.0
    trace = make_trace(cluster, horizon, seed=3)
    waits = simulate(cluster, POLICIES[2], trace, horizon)
    shrinks = simulate(cluster, replace(POLICIES[2], shrink=True, shrink_s=5.0), trace, horizon)
    spares = simulate(replace(cluster, repair_s=0.0), POLICIES[2], trace, horizon)
    assert sum(shrinks.breakdown.values()) == pytest.approx(1.0)
    assert spares.ettr > shrinks.ettr > waits.ettr + 0.05
    failed = 0.002 * 10  # the fraction of GPUs down on average (rate x repair time)
    assert shrinks.breakdown["GPUs lost, groups shrunk"] == pytest.approx(failed, rel=0.3)
    with pytest.raises(SimError, match="shrink: only the freescale policy shrinks"):
        simulate(cluster, replace(POLICIES[1], shrink=True), trace, horizon)


@pytest.mark.parametrize(("field", "value"), [("gpus", 0), ("slow_speed", 1.5), ("correlated_fraction", -0.1),
                                              ("gpus_per_replica", 10_000), ("gpus_per_replica", 7),
                                              ("trace", "bursty")])
def test_bad_input_names_the_field(field: str, value: object) -> None:
    cluster = _cluster(**{field: value})
    with pytest.raises(SimError, match=field):
        simulate(cluster, POLICIES[0], [], 10.0)


# ----- the projection ------------------------------------------------------------------------------
def test_projection_takes_the_measured_slow_replica_figures_and_marks_rows_outside_the_validated_range() -> None:
    v = inputs(RESULTS)
    cluster, policies = scenario(98_304, v)
    assert cluster.replicas == 12 and cluster.gpus_per_replica == 8_192
    by = {p.name: p for p in policies}
    assert by[FREESCALE].detect_s["slow"] == v["slow_detect_steps"].value * v["step_s"].value
    assert v["slow_detect_steps"].kind == "measured" and v["slow_detect_steps"].value > 0
    assert by[FREESCALE].slow_recovered == v["slow_recovered"].value and 0 <= v["slow_recovered"].value <= 1
    assert v["slow_recovered"].kind == "modelled" and "not established" in v["slow_recovered"].source
    assert by["torchft-like"].detect_s["slow"] == INF
    assert by[FREESCALE].detect_s["hang"] == v["freescale_hang_detect_s"].value == 10.0  # ft/config.py's timeout_s
    assert v["catchup_gbps"].kind == v["catchup_slowdown"].kind == "measured, CPU toy"
    rows = project(v, (98_304,), failures=40, seed=0)
    sync = next(r for r in rows if r["policy"].startswith("sync"))
    assert sync["lambda_stall"] > 0.5 and sync["validated"] is False
    assert all(r["validated"] for r in rows if not r["policy"].startswith("sync"))


def test_replica_groups_are_equal() -> None:
    assert replicas_at(8) == 8 and replicas_at(16_384) == 16 and replicas_at(98_304) == 12
    assert 102_400 % replicas_at(102_400) == 0
    with pytest.raises(SimError, match="--replicas 40 must divide --gpus 100"):
        check_grouping(100, 40)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("failures_per_gpu_hour", 0.0, "--set failures_per_gpu_hour=0: must be > 0"),
    ("hang_fraction", 1.5, "--set hang_fraction=1.5: must be in [0, 1]"),
    ("catchup_gbps", 0.0, "--set catchup_gbps=0: must be > 0"),
    ("step_s", INF, "--set step_s=inf: must be > 0 and finite"),
])
def test_bad_override_names_the_set_key(key: str, value: float, message: str) -> None:
    with pytest.raises(SimError) as caught:
        check_inputs(with_overrides(inputs(RESULTS), {key: value}))
    assert str(caught.value).startswith(message)


# ----- the command ---------------------------------------------------------------------------------
@pytest.fixture
def sim_cli(gates: list[Gate], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """``freescale simulate`` with the module's gates (counted) and a cache in ``tmp_path``."""
    calls = {"run_gates": 0}

    def fake(quick: bool) -> list[Gate]:
        calls["run_gates"] += 1
        return gates

    monkeypatch.setattr(command, "run_gates", fake)
    monkeypatch.setenv("FREESCALE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(REPO)
    return calls


def test_simulate_prints_gates_sources_results_and_reuses_the_gates(sim_cli: dict[str, int], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "new" / "dir" / "sim.json"  # a missing directory is created
    argv = ["simulate", "--quick", "--gpus", "16384", "--failures", "60", "--set", "step_s=2", "--json", str(out_json)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("validation gates") < out.index("inputs") < out.index("16,384 GPUs")
    assert "ft_torchrec_cpu.json: params.kill_run.kill_s" in out and "command line" in out
    assert "MISSED (reported, not a gate)" in out and "stragglers_cpu.json" in out
    doc = json.loads(out_json.read_text())
    assert {r["policy"] for r in doc["rows"]} == {"sync + checkpoint restart", "torchft-like", FREESCALE}
    assert doc["comparison"][0]["verdict"] in ("tie", "ahead", "behind")
    assert cli.main(argv) == 0 and sim_cli["run_gates"] == 1  # the second call reuses this source's gates
    assert "reused from" in capsys.readouterr().out
    assert cli.main([*argv, "--fresh-gates"]) == 0 and sim_cli["run_gates"] == 2


def test_simulate_projects_nothing_when_a_gate_fails(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(command, "run_gates", lambda quick: [Gate("broken", "test", "queue", 44.0, 1.0, 60.0)])
    monkeypatch.chdir(REPO)
    assert cli.main(["simulate", "--quick", "--fresh-gates"]) == 1
    captured = capsys.readouterr()
    assert "validation gate failed: broken" in captured.err and "GPUs as" not in captured.out


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "nope=1"], "unknown input 'nope'"),
    (["--set", "step_s"], "--set step_s: expected KEY=NUMBER"),
    (["--results", "/nonexistent"], "run from the repository root"),
    (["--gpus", "0"], "--gpus must be 1 to 16,777,216, got 0"),
    (["--gpus", "1000000000000"], "--gpus must be 1 to 16,777,216"),  # (gigabytes before a line, once)
    (["--seed", "-1"], "--seed: expected a whole number >= 0, got '-1'"),  # (numpy's traceback after the gates, once)
    (["--plot", "{file}.txt"], ".txt: name a .png, .pdf or .svg file"),  # (matplotlib's, after the simulations)
    (["--plot", "{file}_no_suffix"], "_no_suffix: name a .png"),  # (it wrote <path>.png and said <path>)
    (["--plot", "{dir}"], ": a directory; name the image file"),
    (["--failures", "0"], "--failures must be >= 1"),
    (["--gpus", "100", "--replicas", "40"], "--replicas 40 must divide --gpus 100"),
    (["--set", "failures_per_gpu_hour=0"], "--set failures_per_gpu_hour=0"),
    (["--set", "hang_fraction=1.5"], "--set hang_fraction=1.5"),
    (["--set", "slow_recovered=2"], "--set slow_recovered=2: must be in [0, 1]"),
    (["--json", "{file}/x.json"], "cannot create its directory"),
])
def test_simulate_bad_input_is_one_line_before_any_gate(argv: list[str], message: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(command, "run_gates", lambda quick: pytest.fail("the gates ran before the input was checked"))
    monkeypatch.chdir(REPO)
    argv = [a.replace("{file}", str(tmp_path / "file")).replace("{dir}", str(tmp_path)) for a in argv]
    try:
        code = cli.main(["simulate", "--fresh-gates", *argv])
    except SystemExit as exc:  # a flag's own type (argparse)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("freescale: error:") and message in err and len(err.strip().splitlines()) == 1


def test_simulate_plot_without_matplotlib_says_so_before_simulating(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(command, "run_gates", lambda quick: pytest.fail("the gates ran before matplotlib was checked"))
    monkeypatch.chdir(REPO)
    assert cli.main(["simulate", "--fresh-gates", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[report]'" in err and len(err.strip().splitlines()) == 1


def test_the_union_update_costs_more_with_every_group_and_the_average_takes_over_at_scale() -> None:
    """Each group beyond two adds ``union_extra_per_group`` of the group's own embedding update (measured:
    bench_union_update's slope) at ``sparse_update_share`` of a step; the averaged tables cost their all-reduce
    (``table_gb / average_every`` over ``cross_group_gbps``), flat in the groups.  freescale takes the cheaper."""
    from freescale.sim.project import average_overhead, embedding_overhead, union_overhead

    v = inputs(RESULTS)
    x = {k: s.value for k, s in v.items()}
    assert v["union_extra_per_group"].kind == "measured" and 0.3 < x["union_extra_per_group"] < 2
    assert union_overhead(0.02, 0.1, 0.7, 2) == pytest.approx(0.02)
    assert union_overhead(0.02, 0.1, 0.7, 12) == pytest.approx(1 - 0.98 / 1.7)
    flat = {**x, "table_gb": 4.0, "average_every": 16.0, "cross_group_gbps": 50.0, "step_s": 1.0}
    assert average_overhead(0.0, flat, 2) == pytest.approx(1 - 1 / (1 + 4 / 16 / 50))
    assert average_overhead(0.0, flat, 64) < 2 * average_overhead(0.0, flat, 2)  # 2 (R - 1) / R: at most twice R = 2's
    by = [{p.name: p.overhead for p in scenario(64, v, replicas)[1]} for replicas in (2, 4, 16)]
    assert [b[FREESCALE] for b in by] == [pytest.approx(embedding_overhead(x, r)[0]) for r in (2, 4, 16)]
    assert embedding_overhead(x, 2)[1] == "union" and embedding_overhead(x, 16)[1] == "average"
    assert by[2][FREESCALE] < union_overhead(x["overhead"], x["sparse_update_share"], x["union_extra_per_group"], 16)
