"""The step engine's vocabulary: what a step is told, what it returns, and the interfaces between its parts.

One module that the engine (``freescale.step_engine``, ``freescale.trainer``), its data side
(``freescale.step_feed``), its local sync (``freescale.step_sync``) and the fault-tolerance layer
(``freescale.ft``) all import, so none of them imports another for a word.  It imports neither torch
nor torchrec at run time: the lighthouse's HTTP client (``freescale.ft.client``) raises ``JobFinished``
and must start without them.

- ``Commit``: what the vote decided about a step (every rank of every group sees the same).
- ``Accounted``: what the data side made of a committed step (the rows it trained, this group's samples).
- ``SyncResult``: what a sync's ``exchange`` returns: the commit, the data side's account, the step's log
  fields and events, and a deferred finiteness flag.
- ``StepOutcome``: what the engine's step returns to the trainer: the above, the model's output, the
  step's batch plan and its timings.  The trainer, the log, the report and the audit read only this.
- ``StepSync`` / ``ReplicaRun``: the sync the engine calls every step, and the run-level points of a
  replica layer (fault tolerance only: one group has no run edges).
- ``SideChannel``: numbers every replica group tells the others with each step (the job's rank speeds).
- ``DataState``: the data side a sync drives (``StepFeed``, ``freescale.ft.StepSamples``, a user's own);
  ``DataSide``: one as the fault-tolerance layer calls it, its optional methods found once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from freescale.dataloader.loader import StepInfo


@dataclass(frozen=True)
class Commit:
    """What a committed step tells the data side (and the log): the vote's outcome."""

    step: int
    trained: frozenset[int]
    """Groups whose samples the committed update holds (weight > 0)."""
    ready: frozenset[int]
    """Groups holding valid state after the step: the next plans are over their ranks."""
    sizes: Mapping[int, int] = field(default_factory=dict)
    """Ranks each group of the step's quorum runs on (a group that lost ranks runs on fewer than its own): the
    next plans give a group that many rank slots.  Groups not named keep the size last known."""
    applied: bool = True
    """The update reached this rank's state (False while catching up: it is recorded, replayed later)."""
    restored: bool = False
    """This rank's state was replaced from a peer's snapshot during the step (a catch-up finished):
    batches it had in flight are void."""
    joining: frozenset[int] = frozenset()
    """Groups joining by waiting (``[ft] join = "wait"``) behind this step, which join the next one (the lighthouse
    names them, and their ranks in ``sizes``, with the vote, alike for every group): a data side plans them into the
    step it plans after this commit (the next one; with batches planned ahead, as torchrec's pipelines hold them, a
    later one); a joiner that does not make it has its share requeued at that step's commit, as any group that
    contributes nothing."""


@dataclass(frozen=True, eq=False)
class Accounted:
    """The data side's account of one committed step (``DataState.commit``)."""

    rows: np.ndarray
    """Every group's rows (or sample ids) the step trained, int64."""
    samples: int
    """Samples this group had in the step's plan (0 for a step it sat out)."""


@dataclass(frozen=True, eq=False)
class SyncResult:
    """What a sync's ``exchange`` returns for one step."""

    commit: Commit
    accounted: Accounted | None
    """The data side's account of the step (None while catching up: nothing was applied)."""
    record: dict[str, Any] = field(default_factory=dict)
    """The step's fields for the log's ``commit`` record (quorum, weights, timings, the dense update's rate)."""
    events: tuple[dict[str, Any], ...] = ()
    """Events of this step for the run log (catch-up, staging, skipped steps), each with its ``event`` name."""
    finite: torch.Tensor | None = None
    """One group: a 0-d bool on the device, the reduced dense gradients' finiteness (not synced to the host:
    the engine checks it at its log points).  Fault tolerance decides at the vote: None."""
    loss: torch.Tensor | None = None
    """This rank's loss of the step (for a non-finite message), detached; None if it did not train."""


@dataclass(frozen=True, eq=False)
class StepOutcome:
    """One step of one rank, as the engine ran it (``freescale.step_engine.StepEngine.run``)."""

    commit: Commit
    accounted: Accounted | None
    record: dict[str, Any]
    events: tuple[dict[str, Any], ...]
    output: tuple[torch.Tensor, ...] | None
    """(loss, *outputs) of the batch this rank trained; None for a step it sat out."""
    info: StepInfo | None
    """The loader's account of this rank's batch (its plan, its wait); None for a step it sat out."""
    busy_s: float
    """CPU seconds of the training thread in the step."""
    wall_s: float
    digests: dict[str, str] = field(default_factory=dict)
    """With auditing on: the committed state's fingerprints (``StepSync.state_digests``)."""


class JobFinished(Exception):
    """Another replica group finished the run (the lighthouse said so): nothing is left to train."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the run finished at step {step}")
        self.step = step


class NonFiniteError(RuntimeError):
    """A step's loss or gradients are not finite (``train.nonfinite = "stop"``): one line for the user."""


class DataState(Protocol):
    """The data side of a loop: which samples each group trains, and what happens to a dead group's.

    ``freescale.ft.StepSamples`` is the ready one for a stream of sample ids; the engine's
    ``freescale.step_feed.StepFeed`` is another.  ``FaultTolerance`` calls, on every rank:

    - ``commit(commit)``: once per committed step, in step order, after the update (a recovering group:
      for each step it replays after loading a snapshot; not for a step it only recorded,
      ``commit.applied`` False).  ``commit.trained``: the group indices whose gradients the update holds
      (plan their samples as done); ``commit.ready``: the groups holding valid state after it (plan the
      next step over these, and over ``commit.joining``, the groups joining by waiting, if the next step is
      planned after this commit: every group computes the same plan from the same commits).  May return an
      ``Accounted`` (what the step trained: the engine logs it; anything else is ignored).
    - ``state_dict()``: when a snapshot is staged for a recovering peer (JSON-able values and tensors);
      ``load_state_dict(state)``: when this rank loads a peer's snapshot, before the replayed commits.

    Optional (a data side may leave them out; ``DataSide`` finds them once, at set-up): ``weight(step)``
    the samples this group trains at ``step`` (0: it sits the step out; needed by the wrapper form and
    by ``backward`` without ``weight=``); ``rank_samples(step)`` this rank's share (the layer scales a
    per-rank mean loss by it); ``bind(group, replicas, rank, ranks)`` called once at construction with
    this rank's place.
    """

    def commit(self, commit: Commit) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DataSide:
    """A ``DataState`` as the fault-tolerance layer uses it: the optional methods looked up once, here, so the
    step's code calls one interface (an absent one answers None, or does nothing)."""

    def __init__(self, data: DataState, who: str) -> None:
        missing = [name for name in ("commit", "state_dict", "load_state_dict")
                   if not callable(getattr(data, name, None))]
        if missing:
            raise ValueError(f"{who}: data={type(data).__name__} lacks {', '.join(missing)} (a freescale.ft.DataState "
                             "has commit, state_dict and load_state_dict; freescale.ft.StepSamples is a ready one)")
        self.data = data
        self._weight: Callable[[int], float] | None = getattr(data, "weight", None)
        self._rank_samples: Callable[[int], int] | None = getattr(data, "rank_samples", None)
        self._bind: Callable[[int, int, int, int], None] | None = getattr(data, "bind", None)

    @property
    def weighs(self) -> bool:
        """Reports both ``weight`` and ``rank_samples`` (what the wrapper form and ``backward`` without
        ``weight=`` need)."""
        return self._weight is not None and self._rank_samples is not None

    def bind(self, group: int, replicas: int, rank: int, ranks: int) -> None:
        if self._bind is not None:
            self._bind(group, replicas, rank, ranks)

    def weight(self, step: int) -> float | None:
        return float(self._weight(step)) if self._weight is not None else None

    def rank_samples(self, step: int) -> int | None:
        return int(self._rank_samples(step)) if self._rank_samples is not None else None

    def commit(self, commit: Commit) -> Accounted | None:
        accounted = self.data.commit(commit)
        return accounted if isinstance(accounted, Accounted) else None

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)


class SideChannel(Protocol):
    """Numbers each replica group tells every other with a step's cross-group reduction (a header beside its
    sample weight: no collective of its own), read by every group at that step's commit, in the same order
    on every group and in a catching-up group's replay (``freescale.speed_share``: the job's rank speeds)."""

    name: str
    """Its state's name in a snapshot."""

    @property
    def size(self) -> int:
        """Its header's length (the same on every group, every step)."""

    def header(self) -> torch.Tensor:
        """This group's non-negative int64s for the step about to run (the same length on every group)."""

    def on_commit(self, commit: Commit, headers: dict[int, torch.Tensor]) -> None:
        """``commit.step`` committed (or was replayed): every participant's header, by group index."""

    def notes(self) -> dict[str, Any]:
        """What the lighthouse's status shows of it (JSON), sent with this rank's heartbeats."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StepSync(Protocol):
    """Stages 6-8 of every step (the exchange, the commit, the update).  The engine calls ``begin_step``
    and ``can_train``; the pipeline, through the engine, ``zero_grad``, ``backward`` and ``exchange`` where
    torchrec's pipelines call ``optimizer.zero_grad()``, ``backward`` and ``optimizer.step()``; the engine
    calls ``exchange`` itself for a step this rank sits out."""

    def begin_step(self, step: int) -> int:
        """The step to train: ``step``, or after fault tolerance's waiting join (``FTConfig.join``) the quorum's,
        with this rank's state and data position loaded (the engine then reads its share of that step)."""

    def can_train(self, step: int) -> bool: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None: ...

    def exchange(self) -> SyncResult: ...

    def state_digests(self) -> dict[str, str]:
        """The audit's fingerprints of the committed state (a collective over the group)."""


class ReplicaRun(Protocol):
    """The run-level points of a replica layer (fault tolerance): none of them exists for one group."""

    def warm_up(self, loss: torch.Tensor) -> None:
        """Backward of a thrown-away forward before the first quorum (lazy set-up not paid in a step)."""

    def fresh_run(self) -> bool:
        """A checkpoint may be resumed from (no group has progress yet)."""

    def agree(self, ok: bool) -> bool:
        """True only if every rank of this group got True."""

    def start(self) -> None:
        """Before the first step: wait for the peers."""

    def owns_checkpoint(self, commit: Commit) -> bool:
        """This rank's group writes the checkpoint after ``commit``."""

    def finish(self, last_step: int) -> None: ...

    def close(self) -> None: ...


__all__ = ["Accounted", "Commit", "DataSide", "DataState", "JobFinished", "NonFiniteError", "ReplicaRun",
           "StepOutcome", "StepSync", "SyncResult"]
