"""A seeded failure trace: which replica group fails, how, and when (shared by every policy).

Failures of each kind arrive at ``gpus x rate per GPU-hour`` over the whole job, in wall-clock
time (GPUs fail whether or not the job is recovering); each hits one replica group drawn
uniformly (failures are per GPU and the groups are equal), and with probability
``correlated_fraction`` a crash or hang takes the next group down at the same moment (a
shared switch or power domain).  ``periodic`` traces space the failures evenly, as a fault
injector does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freescale.sim.params import KINDS, Cluster


@dataclass(frozen=True)
class Failure:
    time: float
    kind: str
    replicas: tuple[int, ...]


def make_trace(cluster: Cluster, horizon_s: float, seed: int) -> list[Failure]:
    """Every failure in ``[0, horizon_s)``, sorted by time; the same seed gives the same trace."""
    rng = np.random.default_rng(seed)
    replicas = cluster.replicas
    found: list[Failure] = []
    for kind in KINDS:
        rate = cluster.rate_per_s(kind)
        if rate <= 0:
            continue
        if cluster.trace == "periodic":
            gap = 1.0 / rate
            times = np.arange(rng.uniform(0, gap), horizon_s, gap)
        else:
            times = np.sort(rng.uniform(0.0, horizon_s, rng.poisson(rate * horizon_s)))
        first = rng.integers(0, replicas, size=times.size)
        pairs = (rng.random(times.size) < cluster.correlated_fraction) & (kind != "slow") & (replicas > 1)
        for t, j, pair in zip(times.tolist(), first.tolist(), pairs.tolist()):
            found.append(Failure(t, kind, (j, (j + 1) % replicas) if pair else (j,)))
    found.sort(key=lambda f: f.time)
    return found
