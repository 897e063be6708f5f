"""Keep fused embedding tables in step across replica groups by averaging them, a slice per step.

The other scheme for fused tables (``[ft] embedding_sync = "average"``; the default, the union
update, is ``freescale.ft.sparse_sync``).  The union applies every group's gradients on every
group, so a rank's update work and received bytes grow with the number of groups R; this one keeps
them flat in R at a price in semantics, as torchrec's 2D sparse parallelism does
(``DMPCollection.sync``: tables sharded within a group, replicated across groups, their weights
averaged across the replicas).  Per step:

1. **Forward and backward as without fault tolerance**: each fused TBE updates the rows its group
   looked up, in backward, with the group's own gradients (fbgemm's fused optimizer).  A pass-through
   node in front of each TBE's backward first waits for a snapshot transfer still reading the tables
   (``fence``): that update is the first write to them after a staging.
2. **Exchange** (in FTAR's quorum attempt, after the dense reduction, so a failure in it is redone with
   the survivors like the dense one): slice ``j = step mod N`` of every TBE's flat weights and fused
   optimizer state (a contiguous ``1/N`` of each buffer's elements) is summed across the participants
   in one all-reduce.  A participant catching up (no valid tables) sends zeros and is not counted.
3. **Apply** (once the step commits): slice ``j`` becomes sum / holders on every participant: the
   same bits everywhere (the ring all-reduce hands every rank the same sum; the division is local).
   Adagrad's accumulator (row-wise or element-wise) is the exception: its growth since its last average is averaged and
   scaled by ``1 / holders``.  Each group's accumulator grew by its own gradients' squares, ``R`` times
   what the union's mean gradient adds for a row one group touched or for noise-dominated gradients
   (``E[(mean of R)^2] = E[g^2] / R``); left unscaled, every row's steps shrink by about ``sqrt(R)``
   (measured: bench_embedding_sync.py).  With SGD, ``N = 1`` and equal sample shares, averaging is the
   union update up to float rounding; with Adagrad it is close, not equal.  The accumulators' last
   averages travel in snapshots (checkpoints do not carry them: a resumed run takes the accumulators it
   loaded as their last averages).  Every committed step applies its slice's average, also one nobody
   trained in; a non-finite sum stops the run (``train.nonfinite = skip_step`` is refused: the groups'
   fused updates already ran in backward).

Every element is averaged once every ``N`` steps (``[ft] average_every``).  With ``N = 1`` every
table is identical on every group at every committed step, the invariant the union keeps; with
``N > 1`` a row's copies differ between two averages by up to ``N - 1`` steps of each group's own
updates, and are identical right after.

Costs, per step and rank: one all-reduce of ``1/N`` of the rank's table bytes (weights and optimizer
state; row-wise Adagrad adds one float per row), whatever R (a ring all-reduce sends and receives
``2 (R - 1) / R`` of it), and no lookup or update beyond the group's own.

What it changes (measured by ``benchmarks/bench_embedding_sync.py``):

- a group's update of a row uses its own samples' gradients, the step of a job of the group's size;
  the groups' copies are then averaged (model averaging on the tables): not the one step over all
  groups' samples that the union update takes;
- a group that dies takes with it its own updates to the elements not averaged since (at most
  ``N - 1`` steps' worth, none with ``N = 1`` beyond the failed step, whose samples are requeued):
  those samples' dense gradients are committed, their embedding updates partly lost, and they are
  not trained again;
- the union's limits are lifted: per-sample weights, variable batch per feature, several lookups of a
  table in one step.

A recovering replica records each step's summed slice while it sits out and replays it onto the
snapshot: after replaying, the slices averaged since the snapshot hold the averages, the rest the
source's copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from freescale.digest import local_digest
from freescale.ft.client import Quorum
from freescale.ft.replica_group import ReplicaGroup
from freescale.ft.sparse_sync import check_optimizer, fused_tbes

_STATE_PREFIXES = ("weights", "momentum1")
"""What the fused optimizers ``check_optimizer`` admits keep: weights, and Adagrad's accumulator."""
_PLACEMENTS = ("dev", "host", "uvm")


def _is_adagrad(tbe: Any) -> bool:
    """Row-wise or element-wise Adagrad: its accumulator (``momentum1``) is scaled at each average."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return getattr(tbe, "optimizer", None) in (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD)


def table_buffers(name: str, tbe: Any) -> list[tuple[str, torch.Tensor]]:
    """A TBE's flat float buffers that an update changes, each with its kind (``weights``, ``momentum1``):
    its weights, then its fused optimizer's state (fbgemm keeps each in one of ``*_dev`` /
    ``*_host`` / ``*_uvm``; the empty ones and integer placeholders are skipped).  A TBE with a UVM cache
    is refused: the cache holds rows the flat buffers do not."""
    cache = getattr(tbe, "lxu_cache_weights", None)
    if isinstance(cache, torch.Tensor) and cache.numel() > 0:
        raise ValueError(f"fault tolerance: embedding '{name}' keeps a UVM cache; averaging its tables across replica "
                         "groups needs them on the device or the host (no cache), or embedding_sync = \"union\"")
    found = []
    for prefix in _STATE_PREFIXES:
        for placement in _PLACEMENTS:
            t = getattr(tbe, f"{prefix}_{placement}", None)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
                found.append((prefix, t))
    if not found:
        raise ValueError(f"fault tolerance: embedding '{name}' has no weights to average")
    return found


def slice_bounds(numel: int, index: int, every: int) -> tuple[int, int]:
    """Slice ``index`` of ``every`` contiguous slices of a buffer of ``numel`` elements."""
    return numel * index // every, numel * (index + 1) // every


@dataclass
class SliceSum:
    """One step's exchange: slice ``index`` of every buffer, summed over the ``holders`` participants
    that hold valid tables (what every participant applies, and what a recovering one records)."""

    index: int
    summed: torch.Tensor
    holders: int
    accumulators_only: bool = False
    """Recorded while catching up and superseded by a later sum of the same slice: only the accumulators' part."""

    def nbytes(self) -> int:
        return self.summed.numel() * 4


class _BeforeTableUpdate(torch.autograd.Function):
    """Identity on a TBE's looked-up rows whose backward first calls ``fence``: it runs just before the
    TBE's own backward, the fused update, the first write to the tables after the last staging."""

    @staticmethod
    def forward(ctx: Any, looked_up: torch.Tensor, fence: Callable[[], None]) -> torch.Tensor:
        ctx.fence = fence
        return looked_up.view_as(looked_up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fence()
        return grad, None


class AveragedSparseSync:
    """Averages a sharded model's fused embedding tables across replica groups, a slice per step
    (module docstring).  The same calls as the union update (``freescale.ft.ftar.Exchange``)."""

    def __init__(self, dmp: nn.Module, every: int, fence: Callable[[], None]) -> None:
        if every < 1:
            raise ValueError(f"fault tolerance: average_every must be >= 1, got {every}")
        self.every = every
        self._buffers: list[torch.Tensor] = []
        self._accumulators: list[bool] = []
        """Per buffer: Adagrad's accumulator (row-wise: one float per row), whose growth is scaled at each average."""
        self._recorded: dict[int, SliceSum] = {}
        """While catching up: the newest recorded sum of each slice (an older one is cut to its accumulators)."""
        for name, tbe in fused_tbes(dmp):
            check_optimizer(name, tbe)  # no counters or other state outside the buffers averaged
            adagrad = _is_adagrad(tbe)
            for kind, buffer in table_buffers(name, tbe):
                self._buffers.append(buffer)
                self._accumulators.append(adagrad and kind == "momentum1")
            tbe.forward = self._fenced_forward(tbe.forward, fence)  # instance attribute: state_dict etc. untouched
        if not self._buffers:
            raise ValueError("fault tolerance: the model has no fused embedding tables to keep in sync")
        self._averaged: list[torch.Tensor] = []
        """Each accumulator as it was after its last average (identical on every group), set by ``rebase``."""
        self.rebase()

    def rebase(self) -> None:
        """Take the accumulators as they are now as their last average: at the start of a run (every group holds
        the same state: fresh, or the same checkpoint), before any step trained."""
        self._averaged = [b.detach().clone() for b, acc in zip(self._buffers, self._accumulators) if acc]

    def state_dict(self) -> dict[str, Any]:
        """What a recovering group needs beside the tables (registered with the snapshot): the accumulators'
        last averages."""
        return {"averaged": list(self._averaged)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        averaged = state["averaged"]
        if [t.shape for t in averaged] != [t.shape for t in self._averaged]:
            raise RuntimeError("fault tolerance: the snapshot's embedding accumulators do not match this model's")
        for mine, theirs in zip(self._averaged, averaged):
            mine.copy_(theirs)

    def storages(self) -> frozenset[int]:
        """The buffers' storages (``data_ptr``): what a whole-state digest leaves out when ``every > 1``."""
        return frozenset(b.untyped_storage().data_ptr() for b in self._buffers)

    def slice_digest(self, index: int) -> bytes:
        """SHA-256 of this rank's slice ``index`` of every buffer: equal on every group right after it was averaged."""
        return local_digest({"slice": [b.reshape(-1)[lo:hi] for b, (lo, hi) in zip(self._buffers, self._bounds(index))]})

    @staticmethod
    def _fenced_forward(run: Any, fence: Callable[[], None]) -> Any:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            looked_up = run(*args, **kwargs)
            if torch.is_grad_enabled() and looked_up.requires_grad:
                return _BeforeTableUpdate.apply(looked_up, fence)
            return looked_up
        return forward

    def reset(self) -> None:
        """Nothing is kept between steps (the union's per-step lookups have no counterpart here)."""

    def header(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64)

    def __call__(self, group: ReplicaGroup | dist.ProcessGroup, quorum: Quorum, weights: list[float],
                 headers: list[torch.Tensor], ready: list[bool]) -> SliceSum:
        """Sum this step's slice over the participants holding valid tables (``ready``; the others send
        zeros).  The step is the quorum's (``max_step``: a participant that joined behind is at it too).
        A holder's sum stays on the replica group's device, where it is applied; a replica catching up
        keeps it on the host until it replays it (``_record``)."""
        replica_group = ReplicaGroup.of(group)
        index = quorum.max_step % self.every
        bounds = self._bounds(index)
        holder = ready[replica_group.pg.rank()]
        if holder:
            self._recorded.clear()
            summed = torch.cat([b.detach().reshape(-1)[lo:hi].to(replica_group.device, torch.float32)
                                for b, (lo, hi) in zip(self._buffers, bounds)])
        else:
            summed = torch.zeros(sum(hi - lo for lo, hi in bounds), device=replica_group.device)
        replica_group.wait(replica_group.allreduce(summed))
        update = SliceSum(index, summed if holder else summed.cpu(), sum(1 for r in ready if r))
        return update if holder else self._record(update)

    def _bounds(self, index: int) -> list[tuple[int, int]]:
        return [slice_bounds(b.numel(), index, self.every) for b in self._buffers]

    def _record(self, update: SliceSum) -> SliceSum:
        """A replica catching up keeps every committed step's sum until it replays them.  An older sum of
        the same slice is cut to its accumulators' part: a later average overwrites the rest, while each
        accumulator's value depends on every average since the snapshot.  So it holds at most one slice
        of the tables per slice index, plus the accumulators' part of each step."""
        older = self._recorded.get(update.index)
        if older is not None and not older.accumulators_only:
            kept, offset = [], 0
            for (lo, hi), accumulator in zip(self._bounds(older.index), self._accumulators):
                if accumulator:
                    kept.append(older.summed[offset:offset + hi - lo])
                offset += hi - lo
            older.summed = torch.cat(kept) if kept else torch.zeros(0)
            older.accumulators_only = True
        self._recorded[update.index] = update
        return update

    def prepare(self, exchanged: SliceSum) -> SliceSum:
        """Nothing to build while the vote is in flight: the average is a division and a copy."""
        return exchanged

    def discard(self, prepared: SliceSum) -> None:
        """The vote failed: nothing was written (the slice is copied in only by ``apply``)."""

    def apply(self, update: SliceSum, prepared: SliceSum | None = None) -> None:
        """The committed step's average: slice ``update.index`` of every buffer becomes sum / holders (an
        accumulator: its last average plus the mean growth over the holders; only the accumulators for a
        recorded sum that a later one of the same slice superseded)."""
        if update.holders < 1:
            raise RuntimeError("fault tolerance: an embedding average over no participant with valid tables")
        parts = [(b, lo, hi, acc) for b, (lo, hi), acc in zip(self._buffers, self._bounds(update.index),
                                                                self._accumulators)
                 if acc or not update.accumulators_only]
        expected = sum(hi - lo for _, lo, hi, _ in parts)
        if update.summed.numel() != expected:  # checked before any write: nothing half-applied
            raise RuntimeError(f"fault tolerance: an embedding average of {update.summed.numel()} elements for slice "
                               f"{update.index}, this model's slice has {expected}")
        offset = 0
        last = iter(self._averaged)
        with torch.no_grad():
            for buffer, lo, hi, accumulator in parts:
                summed, target = update.summed[offset:offset + hi - lo], buffer.reshape(-1)[lo:hi]
                offset += hi - lo
                if accumulator:  # its growth since the last average, scaled by 1 / holders (module docstring)
                    before = next(last).reshape(-1)[lo:hi]
                    part = summed.to(buffer.device, buffer.dtype) / update.holders
                    before.copy_(before + (part - before) / update.holders)
                    target.copy_(before)
                elif summed.device == buffer.device and buffer.dtype == torch.float32:
                    torch.div(summed, update.holders, out=target)  # one pass, straight into the table
                else:
                    target.copy_((summed / update.holders).to(buffer.device, buffer.dtype))
