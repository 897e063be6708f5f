"""``[ft]`` config section: fault-tolerant training across replica groups (FT-HSDP)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from freescale.config import ConfigError, require

BACKENDS = ("auto", "gloo", "nccl")
"""``[ft] replica_backend`` choices (``freescale.ft.replica_group``)."""
EMBEDDING_SYNCS = ("union", "average")
"""``[ft] embedding_sync`` choices: how fused embedding tables stay in step across groups."""
JOIN_MODES = ("record", "wait")
"""``[ft] join`` choices: how a restarted group joins the step in progress (``FTConfig.join``)."""
RANK_LOSS_POLICIES = ("restart", "shrink")
"""``[ft] on_rank_loss`` choices (``freescale launch --on-rank-loss``): what a group's agent does when one of its
ranks fails (``freescale.launch``)."""

LIGHTHOUSE_ENV = "FREESCALE_LIGHTHOUSE"
REPLICA_INDEX_ENV = "FREESCALE_REPLICA_INDEX"
REPLICAS_ENV = "FREESCALE_REPLICAS"
TOKEN_ENV = "FREESCALE_LIGHTHOUSE_TOKEN"
RUN_ID_ENV = "FREESCALE_RUN_ID"
GROUP_RANKS_ENV = "FREESCALE_GROUP_RANKS"
INCARNATION_BASE_ENV = "FREESCALE_INCARNATION_BASE"

ENVIRONMENT = {
    LIGHTHOUSE_ENV: "the lighthouse's URL, http(s)://host:port (empty or unset: no fault tolerance)",
    REPLICAS_ENV: "replica groups the run plans over at step 0",
    REPLICA_INDEX_ENV: "this group's index, 0 .. replicas - 1 (its replica id is replica<index>)",
    RUN_ID_ENV: "the job's id: the lighthouse refuses a group of another run (optional; launch sets one)",
    TOKEN_ENV: "shared secret the lighthouse and snapshot servers ask for (optional)",
    GROUP_RANKS_ENV: "ranks of a whole replica group: a group running on fewer (it lost one) serves the missing "
                     "rank positions too (optional; default: the group's world size)",
    INCARNATION_BASE_ENV: "incarnations of this group before the current elastic launch (optional; launch sets "
                          "it when a group re-forms at another size)",
}
"""What ``freescale launch --replicas`` sets in each group's environment, and a launcher of one's own must."""


@dataclass
class FTConfig:
    lighthouse: str = ""
    """Lighthouse URL (``http://host:port``); empty: no fault tolerance (one group).  ``freescale
    launch --replicas R`` sets it (and the two below) through the environment."""
    replicas: int = 1
    """Replica groups the data is planned over at step 0 (replica ids ``replica0 ..``)."""
    replica_index: int = 0
    """This group's index in ``0 .. replicas-1``."""
    name: str = ""
    """This group's replica id; default ``replica<replica_index>`` (the form the data plan reads
    group indices from: a loop with ``data`` accounting must keep it)."""
    timeout_s: float = 10.0
    """Collective timeout of the fault-tolerant all-reduce: the longest a hung (not crashed) peer can
    stall a step.  Usually the lighthouse ends the wait sooner: once the hung group's heartbeat times
    out, the others are told their quorum is lost and redo the step without it."""
    snapshots: bool = True
    """Serve snapshots so a restarted group can catch up from this one."""
    wait_for_replicas_s: float = 60.0
    """Before step 0, wait up to this long for ``replicas`` groups to be up (a late group would
    have to catch up from the first step)."""
    overlap_backward: bool = True
    """Reduce each dense gradient bucket across groups while backward runs; false: after backward
    (the in-group reduction still overlaps backward).  The same collectives either way."""
    standby_lock: str = ""
    """A lock file per group (``{replica}``, the replica id, filled in; else ``FREESCALE_STANDBY_LOCK``), on a local
    file system: the active process holds
    it, a warm standby started beside it waits for it in ``FaultTolerance(...)`` and takes over when the active
    one dies (``ft/standby.py``; one-rank groups)."""
    join: str = "record"
    """How a restarted group joins (``docs/catch-up.md``).  ``record``: it sits the step in progress out with weight
    0, records it while its snapshot arrives, replays it and contributes from a later step; nobody waits for it.
    ``wait``: on its first step it downloads the snapshot of the step before and trains the step in progress,
    while the other groups wait for its gradients in that step's all-reduce (a transfer's wait on every other
    group, against one step of one group's batch: it pays in jobs of a few groups, below about 1 + step time /
    transfer time of them).  The loop trains the step ``begin_step`` returns; with ``data=`` (``StepSamples``) the
    commit before it plans the joiner in (``Commit.joining``), as ``freescale train`` does; torchrec's pipelines
    hold batches planned two steps ahead, so there the joiner sits out (weight 0, replaying nothing) the steps
    planned before it was named, up to two, and trains from the first planned with it.  A snapshot not in within
    ``timeout_s / 2`` falls back to ``record``."""
    first_bucket_kb: int = 1024
    """Dense gradients are reduced across groups in buckets during backward: the first (the last
    layers' gradients, ready first) holds at most this many KiB, so a reduction starts early."""
    bucket_kb: int = 25 * 1024
    """The other buckets' cap in KiB (a larger tensor has a bucket of its own); as DDP's ``bucket_cap_mb``."""
    replica_backend: str = "auto"
    """Process groups across replica groups (``freescale.ft.replica_group``): ``gloo`` (host
    buffers), ``nccl`` (GPU buffers, bounded waits, abort on failure; needs a GPU per rank) or
    ``auto``: ``nccl`` on CUDA ranks, ``gloo`` otherwise."""
    embedding_sync: str = "union"
    """How fused embedding tables stay in step across replica groups.  ``union``: every group applies every
    group's row gradients at each committed step (``freescale.ft.sparse_sync``): the update of one job over all
    groups' samples, identical on every group; its work and bytes per rank grow with the number of groups.
    ``average``: each group updates its tables with its own gradients and a slice of the tables is averaged
    across the groups at each step (``freescale.ft.sparse_average``, as torchrec's 2D sparse parallelism): its
    cost per rank does not grow with the groups, but it is model averaging, not the one job's step."""
    accept_rollback: bool = False
    """Let a group restored from a checkpoint commit again steps the job's groups had committed (their records
    say so: ``freescale.ft.commit_record``) when the groups that hold them cannot be reached.  Off: the group
    waits for them, saying so in one line."""
    average_every: int = 1
    """With ``embedding_sync = "average"``: every table element is averaged once every this many steps (1/N of
    each table a step).  1: tables identical on every group at every committed step."""
    on_rank_loss: str = "restart"
    """What ``freescale launch`` does when a rank of a group fails: ``restart`` the whole group at its size (up to
    ``--max-restarts``), or ``shrink``: the group re-forms at once on the ranks it has left (down to
    ``min_group_ranks``), catches up from a peer group and trains a share in proportion to its ranks; a failure at
    the minimum restarts the group as ``restart`` does (``freescale.launch``)."""
    min_group_ranks: int = 1
    """With ``on_rank_loss = "shrink"``: the fewest ranks a group keeps training on."""
    grow_back_after_s: float = 0.0
    """With ``on_rank_loss = "shrink"``: a group on fewer ranks than its own re-forms at its size after this long
    (the lost rank's slot, a repaired host or a spare, is tried again; it catches up from its peers once more);
    0: it stays smaller until the job ends (``freescale.group_sizes``)."""
    group_ranks: int = 0
    """Ranks of a whole replica group (``FREESCALE_GROUP_RANKS``; 0: this group's world size).  A group that lost
    ranks runs on fewer and its ranks serve the missing rank positions of the exchange across groups too."""

    @classmethod
    def from_env(cls, **overrides: object) -> FTConfig:
        """The defaults, then what ``freescale launch --replicas`` put in the environment (``ENVIRONMENT``),
        then ``overrides`` (any field by name)."""
        cfg = cls()
        cfg.resolve_env()
        for name, value in overrides.items():
            if not hasattr(cfg, name):
                raise ValueError(f"FTConfig.from_env: no field {name!r}")
            setattr(cfg, name, value)
        return cfg

    def resolve_env(self) -> None:
        """Read ``FREESCALE_LIGHTHOUSE``, ``FREESCALE_REPLICAS`` and ``FREESCALE_REPLICA_INDEX`` where set
        (a malformed number is refused naming its variable)."""
        self.lighthouse = os.environ.get(LIGHTHOUSE_ENV, self.lighthouse)
        for name, field in ((REPLICAS_ENV, "replicas"), (REPLICA_INDEX_ENV, "replica_index"),
                            (GROUP_RANKS_ENV, "group_ranks")):
            text = os.environ.get(name)
            if text is not None:
                try:
                    setattr(self, field, int(text))
                except ValueError:
                    raise ConfigError(f"{name}={text!r}: not an integer") from None

    @property
    def enabled(self) -> bool:
        return bool(self.lighthouse)

    @property
    def replica_id(self) -> str:
        return self.name or f"replica{self.replica_index}"

    def validate(self) -> None:
        """Refuse a bad field in one line naming it."""
        require(self.replicas >= 1, "replicas", f"must be >= 1, got {self.replicas}")
        require(0 <= self.replica_index < self.replicas, "replica_index",
                f"must be in 0..{self.replicas - 1}, got {self.replica_index}")
        require(self.timeout_s > 0, "timeout_s", "must be positive")
        require(self.first_bucket_kb > 0 and self.bucket_kb > 0, "bucket_kb",
                f"bucket sizes must be positive, got first_bucket_kb={self.first_bucket_kb}, bucket_kb={self.bucket_kb}")
        require(self.replica_backend in BACKENDS, "replica_backend",
                f"must be one of {', '.join(BACKENDS)}, got '{self.replica_backend}'")
        require(self.embedding_sync in EMBEDDING_SYNCS, "embedding_sync",
                f"must be one of {', '.join(EMBEDDING_SYNCS)}, got '{self.embedding_sync}'")
        require(self.average_every >= 1, "average_every", f"must be >= 1, got {self.average_every}")
        require(self.join in JOIN_MODES, "join", f"must be one of {', '.join(JOIN_MODES)}, got '{self.join}'")
        require(self.on_rank_loss in RANK_LOSS_POLICIES, "on_rank_loss",
                f"must be one of {', '.join(RANK_LOSS_POLICIES)}, got '{self.on_rank_loss}'")
        require(self.min_group_ranks >= 1, "min_group_ranks", f"must be >= 1, got {self.min_group_ranks}")
        require(self.group_ranks >= 0, "group_ranks", f"must be >= 0, got {self.group_ranks}")
        require(self.grow_back_after_s >= 0, "grow_back_after_s", f"must be >= 0 (0: never), got {self.grow_back_after_s}")
        require(not self.lighthouse or self.lighthouse.startswith(("http://", "https://")), "lighthouse",
                f"must be an http(s):// URL, got '{self.lighthouse}'")


def incarnation() -> int:
    """This process's incarnation of its replica group: the incarnations of earlier elastic launches of the group
    (``FREESCALE_INCARNATION_BASE``: a group re-formed at another size is a new launch) plus torch's restart
    count within this one.  The lighthouse tells a group's incarnations apart by it."""
    return int(os.environ.get(INCARNATION_BASE_ENV, "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def skip_step_refusal(fault_tolerant: bool, embedding_sync: str) -> str | None:
    """Why ``train.nonfinite = "skip_step"`` cannot be exact here, or None: skipping a step needs every table's
    update to wait for the commit, which only the union update across replica groups does."""
    if not fault_tolerant:
        return ("'skip_step' needs fault tolerance (--replicas), whose embedding update waits for the commit; "
                "without it the fused update already ran inside backward")
    if embedding_sync == "average":
        return ("'skip_step' needs the union update (ft.embedding_sync = \"union\"): with \"average\" each group's "
                "fused update already ran inside backward")
    return None


def replica_index_of(replica_id: str) -> int:
    """``replica3`` -> 3 (ids the launcher and ``FTConfig.replica_id`` give out)."""
    if not replica_id.startswith("replica") or not replica_id[len("replica"):].isdigit():
        raise ValueError(f"fault tolerance: replica id '{replica_id}' is not of the form replica<N>")
    return int(replica_id[len("replica"):])
