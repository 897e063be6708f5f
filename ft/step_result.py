"""The vocabulary of one step's exchange across replica groups (``freescale.ft.ftar`` runs it): what an exchange
beside the dense reduction provides (``Exchange``), what a committed step hands on (``StepResult``), what a
recovering replica loads and replays (``CatchUp``), and how the side header and the exchange's header share one
reduction's header (``join_headers`` / ``split_headers``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from freescale.ft.client import Quorum
from freescale.ft.replica_group import ReplicaGroup


class Exchange(Protocol):
    """An extra collective run in the same quorum attempt as the dense reduction, after it (so
    a failure in it is redone with the survivors too).  ``header()`` (int64, the same length on
    every participant) rides along in the reduction, so ``__call__`` knows every participant's
    sizes without a round of its own; ``ready`` says which participants hold valid state.  The trainer
    exchanges the touched embedding rows here (``freescale.ft.sparse_sync``), or a slice of the tables
    to average (``freescale.ft.sparse_average``)."""

    def header(self) -> torch.Tensor: ...

    def __call__(self, group: ReplicaGroup, quorum: Quorum, weights: list[float],
                 headers: list[torch.Tensor], ready: list[bool]) -> Any: ...

    def prepare(self, exchanged: Any) -> Any:
        """Local work on what ``__call__`` returned that changes no state the step's update reads
        (the union and its lookup): run while the commit vote is in flight, so the vote's round
        trip hides behind it.  Its result is handed to the update when the step commits."""

    def discard(self, prepared: Any) -> None:
        """The vote failed: undo whatever ``prepare`` left behind (the step is redone)."""


@dataclass
class StepResult:
    step: int
    """The step that committed: the caller's, or the quorum's when this replica joined behind it."""
    tensors: list[torch.Tensor]
    quorum: Quorum
    attempts: int
    """1 when the first quorum committed; more when the step was redone with survivors."""
    seconds: float
    recovering: bool
    """This replica holds no valid state yet: it must not apply ``tensors`` itself (see ``ReplicaSync``)."""
    stage_snapshot: bool
    """A participant is catching up and this one is a source: call ``stage()`` after the optimizer step."""
    weights: dict[str, float] = field(default_factory=dict)
    """Samples each participant contributed (0 for one that is catching up or idle)."""
    ready: frozenset[str] = frozenset()
    """Participants holding valid state at this step: the next step's data is planned over them."""
    joining: tuple[tuple[str, int], ...] = ()
    """Groups joining by waiting behind this step, with their ranks, from the vote's answer (the same for every
    participant): they train the next step."""
    extra: Any = None
    """What the step's ``exchange`` returned (every participant's embedding lookups and gradients,
    as gathered: what the update is built from, and what a recovering replica records)."""
    prepared: Any = None
    """What ``exchange.prepare`` made of ``extra`` while the vote was in flight (None when
    recovering: a recorded step is prepared when it is replayed)."""
    finite: bool | None = None
    """The averaged dense gradients are all finite (checked while the vote was in flight)."""
    discarded: int = 0
    """Updates prepared for this step's earlier attempts and put back (their vote failed)."""
    quorum_wait_s: float = 0.0
    """Time blocked on the step's quorum (zero when it arrived during the forward)."""
    reduce_s: float = 0.0
    prepare_s: float = 0.0
    """Building the update while the vote was in flight."""
    vote_s: float = 0.0
    """Time blocked on the vote after that (the part of its round trip left exposed)."""
    failed_at: float | None = None
    """Wall time this rank found an earlier attempt failed (a peer's death: detection), None if none did;
    from then to the commit is the redo."""
    side_headers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each participant's ``side_header`` of the step (``ReplicaSync.side_header``), by replica id: recorded
    with the step, so a recovering replica replays what the others read from it."""


def join_headers(side: torch.Tensor | None, exchange: torch.Tensor | None) -> torch.Tensor | None:
    """A reduction's header: the side header (``ReplicaSync.side_header``), then the exchange's."""
    if side is None:
        return exchange
    flat = side.reshape(-1).to(torch.int64).cpu()
    return flat if exchange is None else torch.cat([flat, exchange.reshape(-1).to(torch.int64).cpu()])


def split_headers(headers: list[torch.Tensor], side: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Each participant's side header: its first ``side`` integers, its exchange header: the rest)."""
    return [h[:side] for h in headers], [h[side:] for h in headers]


@dataclass
class CatchUp:
    """A recovering replica's snapshot and the committed steps it sat out after it: load the
    snapshot, then apply each result in order, and the replica is bit-identical to the others."""

    snapshot_step: int
    state: dict[str, torch.Tensor]
    replay: list[StepResult]
