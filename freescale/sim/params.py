"""What the ETTR simulator takes: the cluster and its failure trace, and each recovery policy.

Units: seconds, GPU-hours for failure rates, GB and GB/s for state and bandwidth.

``Cluster`` is what the three policies share (the same GPUs fail the same way); ``Policy`` is
how one way of training reacts.  Three kinds of policy (``Policy.kind``):

``sync``       fully synchronous training with checkpoint restart: any crash or hang stops
               the whole job (detection, then a job restart); the work since the last
               completed checkpoint is redone; a slow GPU slows every GPU.
``torchft``    replica groups, torchft-like: on a failure the in-flight step is discarded on
               every replica (survivors finish their compute, wait in the all-reduce until the
               failure is detected, then redo the step in a new quorum); the restarted group
               heals from a peer while that peer (and so, through the synchronous all-reduce,
               every replica) stalls; a slow replica slows every replica.
``freescale``  this project: no step discarded (survivors redo only the exchange, with the
               gradients they hold; the dead group's rows are requeued: only its share of the
               in-flight step is lost); crash found by failure reports, hang by the FT
               all-reduce's timeout (heartbeats run on their own thread: a hung trainer keeps
               beating); non-blocking catch-up (the others keep stepping, at most
               ``catchup_slowdown`` slower); a slow replica, once detected (``detect_s["slow"]``),
               keeps training at a reduced share instead of setting everyone's pace
               (``slow_recovered`` of what it cost won back; ``inf``: never detected).

``recovery`` says how a failure that arrives during a recovery is counted (the three
accountings of published figures):

``queue``      it queues: its own recovery follows (wall-clock arrivals; ETTR = 1 - lambda*s)
``renewal``    it is not counted: failures arrive only while training (ETTR = 1/(1 + lambda*s))
``restart``    it restarts the recovery in progress (ETTR = exp(-lambda*s))
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

KINDS = ("crash", "hang", "slow")
POLICY_KINDS = ("sync", "torchft", "freescale")
RECOVERY = ("queue", "renewal", "restart")


class SimError(ValueError):
    """Bad simulator input (one line naming the field)."""


@dataclass(frozen=True)
class Cluster:
    """The machines and their failures (shared by every policy compared in one run)."""

    gpus: int = 16_384
    gpus_per_replica: int = 1_024
    """Replica group size: the unit of failure under the replica policies (must divide ``gpus``)."""
    crash_per_gpu_hour: float = 3.4e-5
    hang_per_gpu_hour: float = 0.0
    slow_per_gpu_hour: float = 0.0
    slow_speed: float = 0.5
    """A slow replica's speed relative to a healthy one, while its episode lasts."""
    slow_duration_s: float = 600.0
    correlated_fraction: float = 0.0
    """Fraction of crash/hang events that take a second replica group down at the same moment."""
    step_s: float = 1.0
    """Step time of the healthy job (the simulator's unit of discarded work)."""
    state_gb: float = 8.0
    """Bytes each rank fetches to catch up (its shard of parameters and optimizer state)."""
    trace: str = "poisson"
    """``poisson`` (exponential gaps, the default) or ``periodic`` (a failure every 1/lambda: injected failures)."""
    repair_s: float = 0.0
    """A crashed GPU's slot is back (a spare swapped in, the host repaired) this long after the crash; 0: a spare
    takes over at once (the restart alone).  Until then a group that lost it waits with nothing to train on, or,
    under a policy that shrinks, trains on the GPUs it has left."""

    @property
    def replicas(self) -> int:
        return max(1, self.gpus // self.gpus_per_replica)

    def rate_per_s(self, kind: str) -> float:
        """Job-level arrivals per second of one failure kind."""
        per_gpu_hour = {"crash": self.crash_per_gpu_hour, "hang": self.hang_per_gpu_hour,
                        "slow": self.slow_per_gpu_hour}[kind]
        return self.gpus * per_gpu_hour / 3600.0

    def validate(self) -> None:
        _require(self.gpus >= 1, "gpus", f"must be >= 1, got {self.gpus}")
        _require(1 <= self.gpus_per_replica <= self.gpus, "gpus_per_replica",
                 f"must be in 1..gpus ({self.gpus}), got {self.gpus_per_replica}")
        _require(self.gpus % self.gpus_per_replica == 0, "gpus_per_replica",  # failure rates count every GPU
                 f"must divide gpus ({self.gpus}), got {self.gpus_per_replica}")
        for name in ("crash_per_gpu_hour", "hang_per_gpu_hour", "slow_per_gpu_hour", "slow_duration_s", "state_gb",
                     "repair_s"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _require(0 < self.slow_speed <= 1, "slow_speed", f"must be in (0, 1], got {self.slow_speed}")
        _require(0 <= self.correlated_fraction <= 1, "correlated_fraction",
                 f"must be in [0, 1], got {self.correlated_fraction}")
        _require(self.step_s > 0, "step_s", f"must be > 0, got {self.step_s}")
        _require(self.trace in ("poisson", "periodic"), "trace", f"must be poisson or periodic, got '{self.trace}'")


@dataclass(frozen=True)
class Policy:
    """How one way of training reacts to each failure kind (see the module docstring)."""

    name: str
    kind: str
    detect_s: dict[str, float] = field(default_factory=lambda: {"crash": 0.0, "hang": 0.0, "slow": float("inf")})
    """Failure to the moment the survivors act on it, per kind (``slow``: to a reduced share;
    ``inf``: never, the job rides at the slow replica's pace)."""
    restart_s: float = 600.0
    """``sync``: the whole job's restart (after detection).  Replica policies: one group's."""
    reconfigure_s: float = 0.0
    """Replica policies: global stall to form the new quorum's communicators, per failure."""
    catchup_gbps: float = 1.0
    """Per-rank transfer rate of the catch-up (heal) snapshot."""
    replay_s: float = 0.0
    """``freescale``: loading and replaying the recorded steps after the transfer."""
    catchup_slowdown: float = 1.0
    """``freescale``: the others' step time factor while a group catches up (1: none)."""
    checkpoint_interval_s: float = 0.0
    """Training time between checkpoints; 0: none taken and none needed (no work is ever redone)."""
    checkpoint_cost_s: float = 0.0
    """Blocking time of one checkpoint save."""
    overhead: float = 0.0
    """Steady-state cost per step as a fraction of the step (e.g. 0.014: 1.4% slower)."""
    slow_recovered: float = 1.0
    """``freescale``: the share of a detected slow replica's cost won back, against an ideal proportional split
    (1: only its own lost speed is lost; 0: everyone still waits for it)."""
    shrink: bool = False
    """``freescale``: a group that lost a GPU waiting for repair (``Cluster.repair_s``) trains at once on the GPUs it
    has left (``[ft] on_rank_loss = "shrink"``), at a share in proportion, and grows back (a restart and a catch-up)
    once the slot is back."""
    shrink_s: float = 0.0
    """``freescale`` with ``shrink``: from the loss to the shrunk group's first contributing commit (measured by
    ``benchmarks/bench_degraded.py`` on a toy, whose catch-up moves kilobytes); the simulator adds the catch-up of
    two positions' state (``2 x catchup_s``: the rank standing in for the lost one fetches its shards too)."""
    recovery: str = "queue"

    def catchup_s(self, cluster: Cluster) -> float:
        """Snapshot transfer time of one rank (every rank of a group fetches its own shard at once)."""
        return cluster.state_gb / self.catchup_gbps if cluster.state_gb else 0.0

    def validate(self) -> None:
        _require(self.kind in POLICY_KINDS, "kind", f"must be one of {', '.join(POLICY_KINDS)}, got '{self.kind}'")
        _require(self.recovery in RECOVERY, "recovery", f"must be one of {', '.join(RECOVERY)}, got '{self.recovery}'")
        _require(set(self.detect_s) == set(KINDS), "detect_s", f"needs exactly {', '.join(KINDS)}")
        _require(all(v >= 0 for v in self.detect_s.values()), "detect_s", "must be >= 0")
        for name in ("restart_s", "reconfigure_s", "replay_s", "checkpoint_interval_s", "checkpoint_cost_s", "shrink_s"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _require(self.catchup_gbps > 0, "catchup_gbps", f"must be > 0, got {self.catchup_gbps}")
        _require(self.catchup_slowdown >= 1, "catchup_slowdown", f"must be >= 1, got {self.catchup_slowdown}")
        _require(0 <= self.overhead < 1, "overhead", f"must be in [0, 1), got {self.overhead}")
        _require(0 <= self.slow_recovered <= 1, "slow_recovered", f"must be in [0, 1], got {self.slow_recovered}")
        _require(not self.shrink or self.kind == "freescale", "shrink", "only the freescale policy shrinks a group")

    def with_recovery(self, recovery: str) -> Policy:
        return replace(self, recovery=recovery)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise SimError(f"{name}: {message}")
