"""Keep every embedding shard and its fused optimizer state bit-identical across replica groups.

Scheme: **the union update**.  Rank position ``r`` of every replica group holds
the same embedding shards (same sharding plan, same ``r``).  Normally fbgemm's
table-batched embedding (TBE) applies its fused optimizer (row-wise Adagrad)
inside backward, to the rows this group looked up, with this group's
gradients, so replicas would drift apart at once.  Here, per step:

1. **Forward** (``_deferring_forward``): each fused TBE looks its ids up
   *without* recording its fused backward (``no_grad``), and a pass-through
   autograd node in its place catches the gradient of its output in
   backward.  The step's ids are deduplicated into row keys here
   (``freescale.ft.sparse_rows.Occurrences``): their counts must ride in the
   dense reduction, which starts during backward.  Nothing is updated.
2. **Exchange** (inside the fault-tolerant all-reduce's quorum attempt, after
   the dense reduction: a failure in it is redone with the survivors like the
   dense one): each replica turns its step into **row form**, its unique rows
   and each row's summed gradient (``RowStep.of``: the bags' gradients
   scattered onto their ids), and at position ``r`` the replicas all-gather
   them.  One all-gather per step, whatever the number of tables: the counts
   ride in the dense reduction.
3. **Apply** (once the step commits): every replica merges the same rows,
   participants in quorum order, each one's gradients scaled by its share of
   the step's samples ``w_j / sum w`` and summed per row (``prepare``, while
   the commit vote is in flight: changes nothing), then applies fbgemm's exact
   optimizer to each touched row once (``apply``: row-wise Adagrad, Adagrad or
   SGD, written out on the rows, ``sparse_rows.apply_rows``), exactly as one
   group that had trained on all the samples would (fbgemm's exact optimizers
   sum a row's gradients within a batch before its update).  Same inputs, same
   ordered arithmetic, so the tables and the optimizer state stay identical
   bit for bit; a recovering replica records the gathered rows of each step it
   sits out and replays them onto its snapshot.

Costs, per step and rank: deduplicating its own ids (forward) and summing its
own gradients onto them; the all-gather of ``R`` groups' rows (``rows x (8 +
4 x dim)`` bytes each: fewer than the ids and bag gradients it replaces when
ids repeat, as recommendation ids do; more for a multi-hot bag of distinct ids,
whose one gradient becomes one per id); merging ``R`` groups' rows and
updating the union of them.  Merging grows with ``R`` (every group applies
every group's rows): ``benchmarks/bench_union_update.py`` measures it.  What
it buys: no dense table gradient ever exists, and no step needs a second round
trip.  On a GPU the forward's deduplication reads one count back to the host
per module and width (not yet run on a GPU).

Limits (raised as errors, not silently wrong): per-sample weights and
variable batch per feature (VBE) are not supported; every table must use a
fused kernel (tables planned as data parallel would be updated by the dense
optimizer from a group-local gradient), with exact row-wise Adagrad, Adagrad
or SGD, no weight decay, clipping or max norm, on a device or host placement
(no UVM cache).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from freescale.ft.client import Quorum
from freescale.ft.replica_group import ReplicaGroup
from freescale.ft.sparse_rows import Occurrences, RowStep, TBELayout, apply_rows, merge


@dataclass
class UnionUpdate:
    """What every replica applies at a committed step: one ``RowStep`` per TBE, in model order."""

    tables: list[RowStep]

    def nbytes(self) -> int:
        return sum(k.numel() * 8 + g.numel() * 4 for t in self.tables for k, g in zip(t.keys, t.grads))


class _CatchGradient(torch.autograd.Function):
    """Identity on the looked-up embeddings whose backward stores their gradient instead of
    running the fused update (``anchor`` is a scalar that requires grad, so the node exists)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, looked_up: torch.Tensor, slot: _Slot) -> torch.Tensor:
        ctx.slot = slot
        return looked_up.view_as(looked_up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        slot: _Slot = ctx.slot
        slot.grad = grad.detach().float().contiguous() if slot.grad is None else slot.grad + grad.float()
        return None, None, None


@dataclass
class _Slot:
    name: str
    tbe: Any  # fbgemm's TBE (untyped module)
    layout: TBELayout
    run: Any  # the TBE's own forward (bound method), with its fused backward
    seen: Occurrences | None = None
    """The step's ids as row keys (set by the forward)."""
    grad: torch.Tensor | None = None
    calls: int = 0
    rows: RowStep | None = None
    """The step in row form, once ``collect`` made it."""


def _check_optimizer(name: str, tbe: nn.Module) -> None:
    """Only the exact optimizers ``sparse_rows.apply_rows`` writes out, as fbgemm would run them:
    no iteration counter, weight decay, clipping or max norm, and rows in the module's own buffers
    (a UVM cache would hold stale copies of rows updated in place)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kind = getattr(tbe, "optimizer", None)
    allowed = (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD)
    args = getattr(tbe, "optimizer_args", None)
    extras = [what for what, on in (
        ("an iteration counter", getattr(tbe, "_used_rowwise_adagrad_with_counter", False)),
        ("global weight decay", getattr(tbe, "_used_rowwise_adagrad_with_global_weight_decay", False)),
        (f"weight decay {getattr(args, 'weight_decay', 0.0)}", float(getattr(args, "weight_decay", 0.0)) != 0.0),
        ("gradient clipping", bool(getattr(args, "gradient_clipping", False))),
        (f"max norm {getattr(args, 'max_norm', 0.0)}", float(getattr(args, "max_norm", 0.0)) > 0.0),
    ) if on]
    if kind not in allowed or extras:
        raise ValueError(f"fault tolerance: embedding '{name}' uses the fused optimizer {kind}"
                         f"{' with ' + ', '.join(extras) if extras else ''}; the union update keeps tables "
                         "identical across replica groups only for exact row-wise Adagrad, Adagrad or SGD "
                         "without counters, weight decay, clipping or max norm")
    cache = getattr(tbe, "lxu_cache_weights", None)
    if isinstance(cache, torch.Tensor) and cache.numel() > 0:
        raise ValueError(f"fault tolerance: embedding '{name}' keeps rows in a UVM cache; the union update "
                         "updates rows in place and needs them on the device or the host (compute kernel 'fused')")


def fused_tbes(dmp: nn.Module) -> list[tuple[str, Any]]:
    """Every fbgemm TBE with a fused optimizer under ``dmp``'s sharded modules, in a fixed order; a table
    planned with a dense (non-fused) kernel is refused."""
    if "torchrec" not in sys.modules:  # no torchrec module can be in the model: a user loop without it starts faster
        return []
    from freescale.parallelize import embedding_kernels

    found: list[tuple[str, Any]] = []  # fbgemm's TBEs: untyped modules whose attributes are read directly
    for name, kernel, fused in embedding_kernels(dmp):
        if not fused:
            raise ValueError(
                f"fault tolerance: the embeddings of '{name.split('.lookup')[0]}' were planned with a dense "
                "(non-fused) kernel (torchrec's planner picks data_parallel for a small table); their updates could "
                "not be kept identical across replica groups. Shard the model with freescale.ft.shard (fused kernels, "
                "model-parallel tables only)")
        found.append((name, kernel.emb_module))
    return found


class UnionSparseUpdate:
    """Defers the fused embedding updates of a sharded model to a union applied by every replica."""

    def __init__(self, dmp: nn.Module) -> None:
        self._anchor = torch.zeros((), requires_grad=True)
        self._slots: list[_Slot] = []
        for name, tbe in fused_tbes(dmp):
            _check_optimizer(name, tbe)
            slot = _Slot(name, tbe, TBELayout.of(tbe), tbe.forward)
            tbe.forward = self._deferring_forward(slot)  # instance attribute: state_dict etc. untouched
            self._slots.append(slot)
        if not self._slots:
            raise ValueError("fault tolerance: the model has no fused embedding tables to keep in sync")

    @property
    def tables(self) -> list[str]:
        return [s.name for s in self._slots]

    def _deferring_forward(self, slot: _Slot) -> Any:
        def forward(indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None,
                    **kwargs: Any) -> torch.Tensor:
            if per_sample_weights is not None or any(v is not None for v in kwargs.values()):
                used = ["per_sample_weights"] * (per_sample_weights is not None) + [
                    k for k, v in kwargs.items() if v is not None]
                raise ValueError(f"fault tolerance: embedding '{slot.name}' was called with {used}; the union "
                                 "update supports plain ids and offsets only")
            with torch.no_grad():
                looked_up = slot.run(indices, offsets)
            if not torch.is_grad_enabled():
                return looked_up  # evaluation: nothing to update
            if slot.calls:
                raise RuntimeError(f"fault tolerance: embedding '{slot.name}' was looked up twice in one step")
            slot.calls += 1
            slot.seen, slot.grad = Occurrences.of(slot.layout, indices.detach().long(), offsets.detach().long()), None
            return _CatchGradient.apply(self._anchor, looked_up, slot)
        return forward

    # ------------------------------------------------------------------ one step
    def collect(self) -> None:
        """Sum this step's gradients onto its rows (after backward; the layer calls it before it waits
        for the dense reduction, whose last buckets are then still in flight)."""
        for s in self._slots:
            if s.rows is not None:
                continue
            if s.seen is None or sum(k.numel() for k in s.seen.keys) == 0:
                s.rows = RowStep.empty(s.layout)
                continue
            if s.grad is None:
                raise RuntimeError(f"fault tolerance: embedding '{s.name}' got no gradient this step")
            with _deterministic():
                s.rows = RowStep.of(s.layout, s.seen, s.grad)

    def local_step(self) -> UnionUpdate:
        """This replica's step in row form (empty for a replica that sat it out)."""
        self.collect()
        return UnionUpdate([s.rows for s in self._slots if s.rows is not None])

    def reset(self) -> None:
        for s in self._slots:
            s.seen = s.grad = s.rows = None
            s.calls = 0

    def header(self) -> torch.Tensor:
        """This replica's unique rows per TBE and width: they ride in the dense reduction
        (``freescale.ft.ftar.Exchange``), so the exchange is one all-gather.  Known once the
        forward ran (the reduction's meta is filled before backward)."""
        counts: list[int] = []
        for s in self._slots:
            counts.extend(k.numel() for k in s.seen.keys) if s.seen is not None else counts.extend(
                0 for _ in s.layout.dims)
        return torch.tensor(counts, dtype=torch.int64)

    def __call__(self, group: ReplicaGroup | dist.ProcessGroup, quorum: Quorum, weights: list[float],
                 headers: list[torch.Tensor]) -> GatheredSteps:
        """All-gather every participant's ``local_step`` (the same on all participants).

        One float32 all-gather: each participant's row keys (int64, bit-cast to float32 pairs: no
        arithmetic touches them) then its summed gradients, padded to the longest.  The merged
        rows are built from it by ``union`` (``prepare`` does, while the vote is in flight)."""
        mine = self.local_step()
        replica_group = ReplicaGroup.of(group)
        device = replica_group.device
        # Gathered on the replica group's device (gloo: the host; NCCL: the GPU, then one copy of the
        # whole gather to the host, where the rows are merged; ``apply`` moves them back).
        ints = torch.cat([k.to(device) for t in mine.tables for k in t.keys])
        floats = torch.cat([g.reshape(-1).to(device) for t in mine.tables for g in t.grads])
        mine_flat = torch.cat([ints.view(torch.float32), floats])
        sizes = [2 * int(h.sum()) + self._floats(h) for h in headers]
        # Each participant's own bytes (not views of the padded buffers: a recovering replica keeps
        # them for every step it sits out).
        gathered = [g.cpu() if g.is_cuda else g.clone() for g in _all_gather_varlen(replica_group, mine_flat, sizes)]
        return GatheredSteps(gathered, list(headers), list(weights))

    def _widths(self) -> list[int]:
        return [d for s in self._slots for d in s.layout.dims]

    def _floats(self, header: torch.Tensor) -> int:
        return sum(int(n) * d for n, d in zip(header.tolist(), self._widths()))

    def union(self, gathered: GatheredSteps) -> UnionUpdate:
        """Every participant's rows merged, weighted by sample share (same on all; module docstring, step 3)."""
        total = float(sum(gathered.weights))
        widths = self._widths()
        per_participant: list[list[RowStep]] = []
        for flat, header in zip(gathered.flat, gathered.shapes):
            counts = [int(n) for n in header.tolist()]
            if len(counts) != len(widths):
                raise RuntimeError(f"fault tolerance: a step of {len(counts)} row groups, this model has {len(widths)}")
            keys = flat[:2 * sum(counts)].contiguous().view(torch.int64).split(counts)
            grads = flat[2 * sum(counts):].split([n * d for n, d in zip(counts, widths)])
            steps, k = [], 0
            for slot in self._slots:
                n = len(slot.layout.dims)
                steps.append(RowStep(list(keys[k:k + n]),
                                     [g.view(-1, d) for g, d in zip(grads[k:k + n], slot.layout.dims)]))
                k += n
            per_participant.append(steps)
        shares = [w / total if total > 0 else 0.0 for w in gathered.weights]
        with _deterministic():
            return UnionUpdate([merge([pp[i] for pp in per_participant], shares) for i in range(len(self._slots))])

    def prepare(self, gathered: GatheredSteps | UnionUpdate) -> UnionUpdate:
        """The merged rows of every participant (run while the commit vote is in flight; changes no
        state: a failed vote has nothing to put back)."""
        update = self.union(gathered) if isinstance(gathered, GatheredSteps) else gathered
        if len(update.tables) != len(self._slots):
            raise RuntimeError(f"fault tolerance: an update for {len(update.tables)} embedding modules, "
                               f"this model has {len(self._slots)}")
        return update

    def discard(self, prepared: UnionUpdate) -> None:
        """Nothing to undo: ``prepare`` changed no row and no counter."""

    def apply(self, update: GatheredSteps | UnionUpdate, prepared: UnionUpdate | None = None) -> None:
        """The one update of the step: each TBE's exact optimizer on the merged rows."""
        rows = prepared if prepared is not None else self.prepare(update)
        with torch.no_grad(), _deterministic():
            for slot, step in zip(self._slots, rows.tables):
                report = getattr(slot.run, "report_rows", None)  # a checkpoint copying rows lazily (staging.py)
                if report is not None:
                    report(torch.cat(step.keys).to(getattr(slot.tbe, "current_device", "cpu")))
                apply_rows(slot.tbe, slot.layout, step)


@dataclass
class GatheredSteps:
    """Every participant's step as gathered (``flat``: row keys bit-cast, then summed gradients), in
    quorum order, with its row counts per TBE and width and its weight: what a committed step's
    update is built from, and what a recovering replica records to replay."""

    flat: list[torch.Tensor]
    shapes: list[torch.Tensor]
    weights: list[float]


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """CUDA's ``index_add_`` sums with atomics unless deterministic algorithms are on: different
    rounding on each replica.  On: one ordered sum (CPU's is ordered anyway)."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _all_gather(group: ReplicaGroup, tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Every participant's ``tensor`` (same shape on all)."""
    out = [torch.empty_like(tensor) for _ in range(size)]
    group.wait(group.allgather(out, tensor))
    return out


def _all_gather_varlen(group: ReplicaGroup, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    longest = max(sizes) if sizes else 0
    padded = torch.zeros(longest, dtype=tensor.dtype, device=tensor.device)
    padded[:tensor.numel()] = tensor
    gathered = _all_gather(group, padded, len(sizes))
    return [g[:n] for g, n in zip(gathered, sizes)]
