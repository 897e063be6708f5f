"""How a model's embedding tables stay in step across replica groups: one strategy, chosen once.

``FaultTolerance`` (``freescale.ft.layer``) reduces the dense gradients itself; what keeps the
embedding tables right depends on where they live, and is decided here, at construction:

- ``union`` (``[ft] embedding_sync = "union"``, fused tables): every group applies every group's row
  gradients at each committed step (``freescale.ft.sparse_sync``).  The tables' fused update waits for
  the commit (``updates_at_commit``): a step that is skipped or redone leaves them untouched.
- ``average`` (``embedding_sync = "average"``, fused tables): each group's fused update runs inside its
  backward; a slice of the tables is averaged across the groups at each committed step
  (``freescale.ft.sparse_average``).  Its accumulators' last averages travel in the snapshot.
- ``replicated`` (no fused tables: ``data_parallel`` tables, or a dense-only model): the tables' gradients
  are dense gradients, reduced with the others; nothing of its own to exchange.

The layer calls the same methods whatever the strategy: ``reset`` at a step's start, ``header`` when the
buckets are armed, ``exchange`` (the collective riding the FTAR attempt), ``tables_finite`` and
``after_commit`` once the vote is in, ``digests`` for the audit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from freescale.digest import audit_digest, group_digest
from freescale.ft.sparse_average import AveragedSparseSync
from freescale.ft.sparse_sync import UnionSparseUpdate, fused_tbes
from freescale.ft.step_result import Exchange, StepResult
from freescale.ft.table_blocks import plan_keys

SnapshotState = tuple[Callable[[], Any], Callable[[Any], None]]


class EmbeddingSync(Protocol):
    """One of the strategies of the module docstring."""

    name: str
    updates_at_commit: bool
    """The fused tables' update waits for the commit (their rate is set for it, and ``after_commit`` runs it),
    instead of running inside backward."""
    updates_in_backward: bool
    """Some tables take the step's update inside backward (a snapshot of the last commit must be taken before it)."""
    exchange: Exchange | None
    """The collective run in the same attempt as the dense reduction (None: nothing to exchange)."""

    def start(self) -> None:
        """Before the first step, on the state every group starts from (fresh, or one checkpoint)."""

    def reset(self) -> None:
        """A step (or the warm-up) starts: nothing of the last one is kept."""

    def header(self) -> torch.Tensor | None: ...

    def tables_finite(self, result: StepResult, agree: Callable[[bool], bool]) -> bool:
        """The tables' own part of the step is finite (agreed in the group where it is checked here)."""

    def after_commit(self, result: StepResult, updates: bool) -> None:
        """The committed step's part for the tables (``updates``: the dense update was applied)."""

    def snapshot_states(self) -> dict[str, SnapshotState]:
        """State beside the tables that a recovering group needs (registered with the snapshot)."""

    def digests(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, str]:
        """The audit's fingerprints of the committed state after ``step`` (a collective on the group)."""


class UnionTables:
    name, updates_at_commit, updates_in_backward = "union", True, False

    def __init__(self, model: nn.Module) -> None:
        self.update = UnionSparseUpdate(model)
        self.exchange: Exchange | None = self.update

    def start(self) -> None:
        """Nothing: the union keeps no state between steps."""

    def reset(self) -> None:
        self.update.reset()

    def header(self) -> torch.Tensor | None:
        return self.update.header()

    def tables_finite(self, result: StepResult, agree: Callable[[bool], bool]) -> bool:
        return True  # the union's gradients are checked with the dense ones (``StepResult.finite``)

    def after_commit(self, result: StepResult, updates: bool) -> None:
        if updates:
            self.update.apply(result.extra, result.prepared)
        elif result.prepared is not None:
            self.update.discard(result.prepared)  # no update this step: the lookup built for it goes back

    def snapshot_states(self) -> dict[str, SnapshotState]:
        return {}

    def digests(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, str]:
        return {"digest": audit_digest(model, optimizer)}


class AveragedTables:
    name, updates_at_commit, updates_in_backward = "average", False, True

    def __init__(self, model: nn.Module, every: int, fence: Callable[[], None]) -> None:
        self.average = AveragedSparseSync(model, every, fence)
        self.exchange: Exchange | None = self.average

    def start(self) -> None:
        self.average.rebase()  # the state the run starts from, the same on every group

    def reset(self) -> None:
        self.average.reset()

    def header(self) -> torch.Tensor | None:
        return self.average.header()

    def tables_finite(self, result: StepResult, agree: Callable[[bool], bool]) -> bool:
        # A non-finite sum would reach every group (each rank sums its own shards' slice: agreed in the group).
        return agree(bool(torch.isfinite(result.extra.summed).all()))

    def after_commit(self, result: StepResult, updates: bool) -> None:
        self.average.apply(result.extra)  # every committed step averages its slice (the groups' updates ran)

    def snapshot_states(self) -> dict[str, SnapshotState]:
        return {"freescale.embedding_average": (self.average.state_dict, self.average.load_state_dict)}

    def digests(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, str]:
        """With tables averaged less often than every step (``average_every > 1``) the groups' tables differ:
        ``digest`` leaves them out, and ``slice_digest`` covers the slice this step averaged, equal on every
        group right after."""
        every = self.average.every
        if every == 1:
            return {"digest": audit_digest(model, optimizer)}
        return {"digest": audit_digest(model, optimizer, self.average.storages()),
                "slice_digest": group_digest(self.average.slice_digest(step % every))}


class ReplicatedTables:
    name, updates_at_commit, updates_in_backward = "replicated", False, False
    exchange: Exchange | None = None

    def start(self) -> None:
        """Nothing: the tables are dense parameters here."""

    def reset(self) -> None:
        """Nothing is kept between steps."""

    def header(self) -> torch.Tensor | None:
        return None

    def tables_finite(self, result: StepResult, agree: Callable[[bool], bool]) -> bool:
        return True  # checked with the dense gradients

    def after_commit(self, result: StepResult, updates: bool) -> None:
        """Nothing: the dense update stepped the tables."""

    def snapshot_states(self) -> dict[str, SnapshotState]:
        return {}

    def digests(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, str]:
        return {"digest": audit_digest(model, optimizer)}


def choose(model: nn.Module, embedding_sync: str, average_every: int, fence: Callable[[], None]) -> EmbeddingSync:
    """The strategy for ``model`` (module docstring): ``replicated`` without fused tables, else ``embedding_sync``."""
    if getattr(model, "fused_optimizer", None) is None or not (fused_tbes(model) or plan_keys(model)):
        return ReplicatedTables()
    if embedding_sync == "average":
        return AveragedTables(model, average_every, fence) if fused_tbes(model) else ReplicatedTables()
    # Every rank of a model with sharded tables joins the union, one holding none of them too (it sends nothing):
    # a rank of a group on fewer ranks stands in for several positions, so each position must exchange alike.
    return UnionTables(model)


__all__ = ["AveragedTables", "EmbeddingSync", "ReplicatedTables", "UnionTables", "choose"]
