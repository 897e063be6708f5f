"""Validation gates: the simulator must reproduce published figures before it projects anything.

1. FT-HSDP's synchronous baseline (arXiv 2602.00277, as quoted in secondary sources): job MTBF
   18 min and a 10 min stall per failure give ETTR 44%.  Only the ``queue`` accounting
   (``1 - lambda*s``) gives 44%; the renewal accountings give 64% (``1/(1+lambda*s)``) and 57%
   (``exp(-lambda*s)``).  The simulation, run under each accounting, must land on each.  (That
   44% is ``1 - lambda*s`` is arithmetic, not a gate: ``tests/test_simulate.py`` checks it.)
2. FT-HSDP itself: a 3 min global stall per failure, the failed replica out 10 min in total,
   12 replicas, the same MTBF: 80% (+-3), ``queue`` accounting.
3. torchft on Crusoe (pytorch.org blog, "Fault Tolerant Llama: training with 2000 synthetic
   failures...", its run with a failure every 60 s): 30 replica groups, 10.9 s steps.  The blog
   counts per step: 82.3% of steps committed, 29.6 replica groups participating per step, and
   81.2% training efficiency (= 82.3% x 29.6 / 30).  Injected failures: a periodic trace.  Not
   published, so assumed (printed): crash detection by torchft's default 5 s heartbeat timeout,
   1 s quorum rebuild, a 60 s restart, a 3 s heal.  The committed share is a gate (+-2).  The
   two per-step figures are *reported comparisons*, not gates, and with these assumptions both
   miss: the model keeps a killed group out longer than the blog's run did (29.0 groups per
   step, not 29.6; efficiency 78.1%, not 81.2%).  A 15-25 s restart would bring all three
   within tolerance, but the blog does not publish its restart time, so the 60 s assumption is
   kept and the miss reported rather than a free input fitted to the figures it is checked on.
4. Every policy within 1 point of its closed form (``closed_form``) wherever
   ``lambda*stall <= 0.5`` and replicas out rarely overlap, over crash-only and mixed
   (crash, hang, slow, correlated, checkpoints, overhead) cases.

``Gate.blocking``: a failed gate stops ``freescale simulate`` and the bench before any
projection; a reported comparison that misses is printed as ``MISSED`` and stops nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from freescale.sim.closed_form import at_trace_rates, closed_form, paper_accounting
from freescale.sim.engine import simulate
from freescale.sim.params import Cluster, Policy
from freescale.sim.trace import make_trace

INF = float("inf")
PAPER_MTBF_S = 18 * 60.0


@dataclass(frozen=True)
class Gate:
    name: str
    source: str
    accounting: str
    target: float
    tolerance: float
    got: float
    blocking: bool = True
    """False: a reported comparison (printed, stops nothing)."""

    @property
    def passed(self) -> bool:
        return abs(self.got - self.target) <= self.tolerance

    @property
    def result(self) -> str:
        if self.blocking:
            return "pass" if self.passed else "FAIL"
        return "within" if self.passed else "MISSED"

    def row(self) -> dict[str, object]:
        return {"gate": self.name, "kind": "gate" if self.blocking else "reported", "source": self.source,
                "accounting": self.accounting, "target": f"{self.target:.1f} +- {self.tolerance:g}",
                "got": round(self.got, 2), "passed": self.passed, "result": self.result}



def _paper_cluster(replicas: int) -> Cluster:
    """Job MTBF 18 min over ``replicas`` groups of one 'GPU' each (only the job rate matters)."""
    return Cluster(gpus=replicas, gpus_per_replica=1, crash_per_gpu_hour=3600 / PAPER_MTBF_S / replicas,
                   step_s=1.0, state_gb=0.0)


def _sim(cluster: Cluster, policy: Policy, failures: int, seed: int) -> float:
    horizon = failures / sum(cluster.rate_per_s(k) for k in ("crash", "hang"))
    return simulate(cluster, policy, make_trace(cluster, horizon, seed), horizon, bins=10).ettr


def sync_baseline(failures: int) -> list[Gate]:
    cluster = _paper_cluster(12)
    closed = paper_accounting(PAPER_MTBF_S, 600.0)
    src = "FT-HSDP: MTBF 18 min, 10 min stall (44% = the queue accounting)"
    gates = []
    for recovery, target in (("queue", closed["queue"]), ("renewal", closed["renewal"]), ("restart", closed["restart"])):
        sync = Policy("sync", "sync", {"crash": 0.0, "hang": 0.0, "slow": INF}, restart_s=600.0, recovery=recovery)
        gates.append(Gate(f"sync baseline, simulated ({recovery})", src, recovery, 100 * target, 1.0,
                          100 * _sim(cluster, sync, failures, seed=1)))
    return gates


def ft_hsdp(failures: int) -> Gate:
    policy = Policy("ft-hsdp", "freescale", {"crash": 180.0, "hang": 180.0, "slow": INF}, restart_s=420.0)
    return Gate("FT-HSDP, simulated", "FT-HSDP: 3 min stall, replica out 10 min, 12 replicas", "queue", 80.0, 3.0,
                100 * _sim(_paper_cluster(12), policy, failures, seed=2))


CRUSOE = "pytorch.org blog (Fault Tolerant Llama, Crusoe): 30 groups, 1 failure/60 s, 10.9 s steps"
CRUSOE_ASSUMED = "assumed: 5 s heartbeat detection, 1 s rebuild, 60 s restart, 3 s heal"


def crusoe_torchft(failures: int, kind: str = "torchft") -> list[Gate]:
    """The blog's three per-step figures from one run of ``kind`` (``torchft``: the gate;
    another kind shows the gate telling policies apart)."""
    cluster = Cluster(gpus=30, gpus_per_replica=1, crash_per_gpu_hour=60.0 / 30, step_s=10.9, state_gb=3.0,
                      trace="periodic")
    policy = Policy(kind, kind, {"crash": 5.0, "hang": 5.0, "slow": INF}, restart_s=60.0,
                    reconfigure_s=1.0, catchup_gbps=1.0)
    horizon = failures * 60.0
    out = simulate(cluster, policy, make_trace(cluster, horizon, 3), horizon, bins=10)
    per_step = "per step (averaged over the steps attempted)"
    return [Gate("torchft on Crusoe: steps committed", f"{CRUSOE}; {CRUSOE_ASSUMED}", "steps committed / attempted",
                 82.3, 2.0, 100 * out.committed_fraction),
            Gate("torchft on Crusoe: groups participating per step", CRUSOE, per_step, 29.6, 0.3,
                 out.participating_per_step, blocking=False),
            Gate("torchft on Crusoe: training efficiency", f"{CRUSOE} (committed x participating / 30)", per_step,
                 81.2, 2.0, 100 * out.step_efficiency, blocking=False)]


def agreement_cases() -> list[tuple[str, Cluster, Policy]]:
    """(name, cluster, policy) inside the closed forms' domain: every policy kind, crash-only at
    lambda*stall = 0.05 / 0.2 / 0.5, and one mixed case each."""
    cases = []
    for kind in ("sync", "torchft", "freescale"):
        stall = 600.0 if kind == "sync" else 180.0
        policy = Policy(kind, kind, {"crash": stall - 20, "hang": stall, "slow": 60.0 if kind == "freescale" else INF},
                        restart_s=20.0 if kind == "sync" else 300.0, reconfigure_s=0.0 if kind == "sync" else 20.0,
                        catchup_gbps=0.5, replay_s=5.0)
        for x in (0.05, 0.2, 0.5):
            rate = 3600 * x / stall / 96
            cases.append((f"{kind}, lambda*stall={x}", Cluster(gpus=96, gpus_per_replica=8, crash_per_gpu_hour=rate,
                                                              step_s=10.0, state_gb=8.0), policy))
        mixed = Cluster(gpus=96, gpus_per_replica=8, crash_per_gpu_hour=3600 * 0.15 / stall / 96,
                        hang_per_gpu_hour=3600 * 0.1 / stall / 96, slow_per_gpu_hour=3600 * 0.2 / stall / 96,
                        slow_duration_s=300.0, correlated_fraction=0.1, step_s=10.0, state_gb=8.0)
        cases.append((f"{kind}, mixed kinds", mixed, replace(policy, checkpoint_interval_s=1800.0, checkpoint_cost_s=60.0,
                                                             overhead=0.02, catchup_slowdown=1.5)))
    return cases


def closed_form_agreement(failures: int) -> list[Gate]:
    gates = []
    for i, (name, cluster, policy) in enumerate(agreement_cases()):
        horizon = failures / sum(cluster.rate_per_s(k) for k in ("crash", "hang"))
        trace = make_trace(cluster, horizon, 10 + i)
        got = simulate(cluster, policy, trace, horizon, bins=10).ettr
        expected = closed_form(at_trace_rates(cluster, trace, horizon), policy)
        gates.append(Gate(f"closed form: {name}", "closed_form (at the trace's rates)", policy.recovery,
                          100 * expected, 1.0, 100 * got))
    return gates


def run_gates(quick: bool = False) -> list[Gate]:
    """Every gate; ``quick`` simulates fewer failures (still enough for the tolerances)."""
    n = 2_000 if quick else 5_000
    return [*sync_baseline(4 * n), ft_hsdp(n), *crusoe_torchft(n), *closed_form_agreement(n)]
