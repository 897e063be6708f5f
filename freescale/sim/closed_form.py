"""Closed forms of ETTR: the check every simulated policy must pass, and the published accountings.

Three accountings of a job whose failures arrive at rate ``lambda`` and cost ``s`` of stall each
(``Policy.recovery`` names them; the simulator implements each as what happens to a failure that
arrives during a recovery):

- ``queue``:   ``1 - lambda*s``       recoveries queue in wall-clock time (FT-HSDP's accounting:
                                      ``1 - lambda*(stall + lost work)``)
- ``renewal``: ``1/(1 + lambda*s)``   failures arrive only while training
- ``restart``: ``exp(-lambda*s)``     a failure during a recovery starts it again

``closed_form`` extends these per policy: the availability factor applied to the global stalls,
then first-order terms for what happens outside them (replicas out, discarded shares, slow
replicas, checkpoints).  Exact for ``sync`` (the rollback term uses the exact expectation of the
checkpoint cycles completed between failures); for the replica policies it neglects overlaps of
second order (two slow episodes at once, an out replica's time cut by another's stall), which
stay below a point while ``lambda*stall <= 0.5`` (``tests/test_simulate.py``).
"""

from __future__ import annotations

import math

from freescale.sim.params import Cluster, Policy, SimError

FAILURES = ("crash", "hang")


def availability(x: float, recovery: str) -> float:
    """Share of wall time outside global recoveries, for ``x = lambda * stall``."""
    if recovery == "queue":
        return max(0.0, 1.0 - x)
    if recovery == "renewal":
        return 1.0 / (1.0 + x)
    if recovery == "restart":
        return math.exp(-x)
    raise SimError(f"recovery: must be queue, renewal or restart, got '{recovery}'")


def paper_accounting(mtbf_s: float, stall_s: float, lost_work_s: float = 0.0) -> dict[str, float]:
    """A job MTBF and a stall (+ lost work) per failure, in each accounting."""
    x = (stall_s + lost_work_s) / mtbf_s
    return {r: availability(x, r) for r in ("queue", "renewal", "restart")}


def _checkpoint_kept(lam: float, policy: Policy, rolls_back: bool) -> float:
    """Share of training time whose work is kept, given the checkpoint cycle (compute I, save c).

    Rolling back (``sync``): between failures (training time ~ Exp(lam)) only completed cycles
    count: ``E[floor(X/T)] = q/(1-q)`` with ``q = exp(-lam*T)``, each worth ``I``."""
    interval, cost = policy.checkpoint_interval_s, policy.checkpoint_cost_s
    if interval <= 0:
        return 1.0
    cycle = interval + cost
    if not rolls_back or lam <= 0:
        return interval / cycle
    q = math.exp(-lam * cycle)
    return lam * interval * q / (1 - q)


def _slow_factor(cluster: Cluster, policy: Policy, replicas: int) -> float:
    """Throughput kept under slow episodes: the whole job at the slow pace until detected
    (``sync``/``torchft``: for the whole episode), then the slow replica's own share lost, and the part of the
    rest planning does not win back (``1 - slow_recovered``) lost by everyone."""
    lam, v, dur = cluster.rate_per_s("slow"), cluster.slow_speed, cluster.slow_duration_s
    if lam <= 0 or v >= 1:
        return 1.0
    waited = dur if policy.kind != "freescale" else min(policy.detect_s["slow"], dur)
    shared, kept = dur - waited, policy.slow_recovered
    return 1.0 - (1 - v) * ((1 - math.exp(-lam * (waited + (1 - kept) * shared))) + lam * kept * shared / replicas)


def _torchft_stall(step: float, detect: float, reconfigure: float) -> float:
    """Expected survivors' loss per failure: the discarded part of the step (``e ~ U(0, step)``),
    then the rest of it computed in vain or the detection, whichever is longer, then the rebuild."""
    rest = detect if detect >= step else (step * step + detect * detect) / (2 * step)
    return step / 2 + rest + reconfigure


def closed_form(cluster: Cluster, policy: Policy) -> float:
    """Expected ETTR of ``policy`` on ``cluster`` (see the module docstring for what it neglects)."""
    lam = {k: cluster.rate_per_s(k) for k in FAILURES}
    total = sum(lam.values())
    keep = 1.0 - policy.overhead
    if policy.kind == "sync":
        x = sum(lam[k] * (policy.detect_s[k] + policy.restart_s) for k in FAILURES)
        return (availability(x, policy.recovery) * keep * _checkpoint_kept(total, policy, True)
                * _slow_factor(cluster, policy, cluster.replicas))
    R, per_event = cluster.replicas, 1 + cluster.correlated_fraction * (cluster.replicas > 1)
    catch = policy.catchup_s(cluster) + (policy.replay_s if policy.kind == "freescale" else 0.0)
    heal = catch if policy.kind == "torchft" else 0.0
    stall, out, lost_share = {}, {}, 0.0
    for k in FAILURES:
        d = policy.detect_s[k]
        if policy.kind == "torchft":
            stall[k] = _torchft_stall(cluster.step_s, d, policy.reconfigure_s)
            out[k] = max(d + policy.restart_s - (stall[k] - cluster.step_s / 2), 0.0)
        else:
            stall[k] = d + policy.reconfigure_s
            out[k] = max(d + policy.restart_s - stall[k], 0.0) + catch
            lost_share += lam[k] * per_event * cluster.step_s / 2 / R
    down = sum(lam[k] * per_event * (policy.detect_s[k] + policy.restart_s + (catch if heal == 0 else 0.0))
               for k in FAILURES) / R
    x = (1 - down) * sum(lam[k] * (stall[k] + heal) for k in FAILURES)
    a = availability(x, policy.recovery)
    out_share = (1 - down) * a * sum(lam[k] * per_event * out[k] for k in FAILURES) / R
    slowdown = 0.0
    if policy.kind == "freescale" and policy.catchup_slowdown > 1:
        slowdown = a * (1 - 1 / policy.catchup_slowdown) * (1 - down) * total * per_event * catch * (R - 1) / R
    useful = a - out_share - (1 - down) * a * lost_share - slowdown
    return max(0.0, useful) * keep * _checkpoint_kept(total, policy, False) * _slow_factor(cluster, policy, R)


def at_trace_rates(cluster: Cluster, trace: list, horizon_s: float) -> Cluster:
    """``cluster`` with each kind's rate set to what ``trace`` realised (removes the Poisson noise
    of the failure count when a simulation is compared with its closed form)."""
    from dataclasses import replace

    counts = {k: sum(1 for f in trace if f.kind == k) for k in ("crash", "hang", "slow")}
    per_gpu_hour = {k: counts[k] / horizon_s * 3600.0 / cluster.gpus for k in counts}
    return replace(cluster, crash_per_gpu_hour=per_gpu_hour["crash"], hang_per_gpu_hour=per_gpu_hour["hang"],
                   slow_per_gpu_hour=per_gpu_hour["slow"])
