"""Keep every embedding shard and its fused optimizer state bit-identical across replica groups.

Scheme: **the union update**.  Rank position ``r`` of every replica group holds
the same embedding shards (same sharding plan, same ``r``).  Normally fbgemm's
table-batched embedding (TBE) applies its fused optimizer (row-wise Adagrad)
inside backward, to the rows this group looked up, with this group's
gradients, so replicas would drift apart at once.  Here, per step:

1. **Forward** (``_deferring_forward``): each fused TBE looks its ids up
   *without* recording its fused backward (``no_grad``), and a pass-through
   autograd node in its place catches the gradient of its output in
   backward.  Nothing is updated; nothing extra crosses the network during the
   step.
2. **Exchange** (inside the fault-tolerant all-reduce's quorum attempt, after
   the dense reduction: a failure in it is redone with the survivors like the
   dense one): at position ``r`` the replicas all-gather each TBE's
   ``(indices, offsets, output gradient)``.  One all-gather per step,
   whatever the number of tables: the sizes ride in the dense reduction.
3. **Apply** (the update only once the step commits): every replica builds the same
   *union* batch, participants in quorum order, each one's gradient rows
   scaled by its share of the step's samples ``w_j / sum w``, and runs the
   TBE forward on it while the commit vote is in flight (``prepare``: a
   lookup, no row changes) and its backward once the vote passed
   (``apply``): the fused optimizer then updates each
   touched row once, from the gradients of all replicas' samples, exactly as
   one group that had trained on all of them would (row-wise Adagrad sums
   a row's gradients within a batch before its update).  Same inputs, same
   deterministic kernel, so the tables and the optimizer state stay identical
   bit for bit; a recovering replica records the gathered lookups of each
   step it sits out and replays them onto its snapshot.

Costs: one more TBE lookup per step over the union (``R`` times the group's
ids at position ``r``), and the all-gather of the looked-up ids and their
output gradients (``ids x dim`` floats per replica).  What it buys: no dense
table gradient ever exists, and no step needs a second round trip.

Limits (raised as errors, not silently wrong): per-sample weights and
variable batch per feature (VBE) are not supported.  Tables planned
``data_parallel`` (whole on every rank, a dense kernel) are not in the union:
their dense gradients are reduced with the other dense ones, in the group and
across groups (``freescale.parallelize.replicated_kernel_weights``), and the
dense optimizer steps them on the committed average, so no union, all-gather
or second lookup is paid for them: the cheaper choice for small tables.
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
from freescale.ft.table_blocks import (
    Block,
    ShardSpec,
    empty_blocks,
    id_cuts,
    plan_keys,
    served_groups,
    shard_specs,
    split,
    union_step,
)


@dataclass
class TBEStep:
    """One TBE's lookups of a step: ``T`` features, ``B`` bags per feature."""

    indices: torch.Tensor  # int64 [N]
    offsets: torch.Tensor  # int64 [T * B + 1]
    grad: torch.Tensor  # float32 [B, sum of dims] pooled, [N, dim] sequence


@dataclass
class UnionUpdate:
    """What every replica applies at a committed step: one ``TBEStep`` per TBE, in model order."""

    tables: list[TBEStep]

    def nbytes(self) -> int:
        return sum(t.indices.numel() * 8 + t.offsets.numel() * 8 + t.grad.numel() * 4 for t in self.tables)


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
    features: int
    pooled: bool
    run: Any  # the TBE's own forward (bound method), with its fused backward
    specs: list[ShardSpec]
    """Its table shards, in its order (``freescale.ft.table_blocks``)."""
    indices: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    calls: int = 0
    shape: tuple[int, ...] = ()
    """The looked-up output's shape (its gradient's): known after the forward."""


def check_optimizer(name: str, tbe: nn.Module) -> None:
    """Only fused optimizers whose update reads no iteration count and whose forward writes no row:
    the union's forward also runs for votes that fail, and a group catching up skips the local
    lookups, so counters may differ between groups (harmless only where nothing reads them); and
    the averaged tables (``freescale.ft.sparse_average``) average weights and accumulators only."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kind = getattr(tbe, "optimizer", None)
    allowed = (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD)
    counted = getattr(tbe, "_used_rowwise_adagrad_with_counter", False) or \
        getattr(tbe, "_used_rowwise_adagrad_with_global_weight_decay", False)
    if kind not in allowed or counted:
        raise ValueError(f"fault tolerance: embedding '{name}' uses the fused optimizer {kind}"
                         f"{' with an iteration counter' if counted else ''}; fault tolerance keeps tables "
                         "in step across replica groups only for exact row-wise Adagrad, Adagrad or SGD "
                         "without counters or global weight decay")


def fused_kernels(dmp: nn.Module) -> list[tuple[str, Any]]:
    """Every torchrec kernel with a fused optimizer under ``dmp``'s sharded modules, in a fixed order (a
    ``data_parallel`` table's dense kernel is not one: the layer reduces its gradient like a dense one)."""
    if "torchrec" not in sys.modules:  # no torchrec module can be in the model: a user loop without it starts faster
        return []
    from freescale.parallelize import embedding_kernels

    return [(name, kernel) for name, kernel, fused in embedding_kernels(dmp) if fused]


def fused_tbes(dmp: nn.Module) -> list[tuple[str, Any]]:
    """The fbgemm TBEs of ``fused_kernels`` (untyped modules whose attributes are read directly)."""
    return [(name, kernel.emb_module) for name, kernel in fused_kernels(dmp)]


class UnionSparseUpdate:
    """Defers the fused embedding updates of a sharded model to a union applied by every replica."""

    def __init__(self, dmp: nn.Module) -> None:
        from freescale.parallelize import shard_positions
        from freescale.shrunk_plan import group_ranks

        self._anchor = torch.zeros((), requires_grad=True)
        self._slots: list[_Slot] = []
        positions, own = shard_positions(dmp), dist.get_rank() if dist.is_initialized() else 0
        for name, kernel in fused_kernels(dmp):
            tbe = kernel.emb_module
            check_optimizer(name, tbe)
            pooled = int(tbe.pooling_mode) != 2  # fbgemm PoolingMode.NONE == 2: one row per id
            specs = shard_specs(kernel, positions, own)
            if sum(spec.features for spec in specs) != len(tbe.feature_table_map):
                raise ValueError(f"fault tolerance: embedding '{name}': its tables' features do not match its TBE's")
            slot = _Slot(name, tbe, len(tbe.feature_table_map), pooled, tbe.forward, specs)
            tbe.forward = self._deferring_forward(slot)  # instance attribute: state_dict etc. untouched
            self._slots.append(slot)
        self._keys = plan_keys(dmp)
        if not self._keys:
            raise ValueError("fault tolerance: the model has no fused embedding tables to keep in sync")
        """Every table shard of the model, in the order headers list them (the same on every group)."""
        self._index = {key: i for i, key in enumerate(self._keys)}
        self._position = {spec.key: spec.position for slot in self._slots for spec in slot.specs}
        self._group_ranks = group_ranks(dist.get_world_size() if dist.is_initialized() else 1)
        """A whole group's ranks: a participant running on fewer stands in for the others' positions."""
        missing = sorted(set(self._position) - set(self._index))
        if missing:
            raise ValueError(f"fault tolerance: table shards {missing[:3]} are not in the sharding plan")

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
            slot.indices, slot.offsets, slot.grad = indices.detach().long(), offsets.detach().long(), None
            slot.shape = tuple(looked_up.shape)
            return _CatchGradient.apply(self._anchor, looked_up, slot)
        return forward

    # ------------------------------------------------------------------ one step
    def local_blocks(self) -> dict[str, Block]:
        """This replica's lookups and gradients of the step by table shard (empty for a replica that sat it out)."""
        blocks: dict[str, Block] = {}
        for s in self._slots:
            if s.indices is None or s.offsets is None:
                parts = empty_blocks(s.specs, s.pooled)
            else:
                rows = (s.offsets.numel() - 1) // s.features if s.pooled else s.indices.numel()
                if s.grad is None and rows:
                    raise RuntimeError(f"fault tolerance: embedding '{s.name}' got no gradient this step")
                grad = s.grad if s.grad is not None else torch.zeros(rows, 0)
                parts = split(s.specs, s.indices, s.offsets, grad.reshape(rows, -1), s.pooled)
            blocks.update((spec.key, block) for spec, block in zip(s.specs, parts))
        return blocks

    def reset(self) -> None:
        for s in self._slots:
            s.indices = s.offsets = s.grad = None
            s.calls = 0

    def header(self) -> torch.Tensor:
        """Sizes of this replica's step per table shard of the model, ``[ids, lengths, grad rows, grad cols]``
        (zeros for shards it does not hold): they ride in the dense reduction (``freescale.ft.ftar.Exchange``),
        the same length on every participant, so the exchange is one all-gather per rank position.  Known once
        the forward ran (the reduction's meta is filled before backward)."""
        sizes = torch.zeros(len(self._keys), 4, dtype=torch.int64)
        for s in self._slots:
            if s.indices is None or s.offsets is None:
                for spec in s.specs:
                    sizes[self._index[spec.key]] = torch.tensor([0, 0, 0, spec.features * spec.dim if s.pooled else spec.dim])
                continue
            bags = (s.offsets.numel() - 1) // s.features
            cuts = id_cuts(s.specs, s.offsets)
            for spec, lo, hi in zip(s.specs, cuts, cuts[1:]):
                ids = hi - lo
                rows, cols = (bags, spec.features * spec.dim) if s.pooled else (ids, spec.dim)
                sizes[self._index[spec.key]] = torch.tensor([ids, spec.features * bags, rows, cols])
        return sizes.reshape(-1)

    def __call__(self, group: ReplicaGroup | dist.ProcessGroup, quorum: Quorum, weights: list[float],
                 headers: list[torch.Tensor], ready: list[bool] | None = None) -> GatheredSteps:
        """All-gather every participant's ``local_blocks`` (the same on all participants): at each rank position
        this rank serves, the table shards of that position (``table_blocks.served_groups``).

        One float32 all-gather per position: each participant's lengths and ids (int64, bit-cast to float32
        pairs: no arithmetic touches them) then its gradients, padded to the longest.  The weighted union is
        built from it by ``union`` (``prepare`` does, while the vote is in flight).  ``ready`` is not needed: a
        participant catching up has weight 0."""
        mine = self.local_blocks()
        # A participant on fewer ranks than its own serves several positions with one header (its own
        # position's peers' headers are all it gets back): then each position's sizes are gathered first.
        whole = self._group_ranks
        degraded = any(0 < len(p.addresses) < whole for p in quorum.participants)
        gathered: dict[str, list[Block]] = {}
        for position, replica_group in served_groups(ReplicaGroup.of(group)):
            keys = [k for k in self._keys if k in mine and (position is None or self._position[k] == position)]
            index = [self._index[k] for k in keys]
            device = replica_group.device
            if degraded:
                rows = torch.tensor([mine[k].sizes() for k in keys], dtype=torch.int64).reshape(-1, 4)
                sizes = [g.cpu().view(-1, 4) for g in _all_gather(replica_group, rows.to(device), len(headers))]
            else:
                sizes = [h.view(-1, 4)[index] for h in headers]
            # Gathered on the replica group's device (gloo: the host; NCCL: the GPU, then one copy of the whole
            # gather to the host, where the union is built; ``apply`` moves it back).
            ints = [t.to(device) for k in keys for t in (mine[k].lengths, mine[k].indices)]
            floats = [mine[k].grad.reshape(-1).float().to(device) for k in keys]
            flat = torch.cat([torch.cat(ints or [torch.zeros(0, dtype=torch.int64, device=device)]).view(torch.float32),
                              *floats])
            lengths = [2 * int(s[:, :2].sum()) + int((s[:, 2] * s[:, 3]).sum()) for s in sizes]
            # Each participant's own bytes (not views of the padded buffers: a recovering replica keeps
            # them for every step it sits out).
            for flat_of, sizes_of in zip(_all_gather_varlen(replica_group, flat, lengths), sizes):
                own = flat_of.cpu() if flat_of.is_cuda else flat_of.clone()
                for key, block in zip(keys, _decode(own, sizes_of)):
                    gathered.setdefault(key, []).append(block)
        return GatheredSteps(gathered, list(weights))

    def union(self, gathered: GatheredSteps) -> UnionUpdate:
        """The weighted union of every participant's step (same on all; module docstring, step 3).  A participant's
        gradient rows are its group's sample mean whatever ranks it runs on: each rank's loss is scaled to the group's
        mean times its ranks (the loader's ``loss_scale``) and torchrec divides the gradient its all-to-all returns
        to a shard by the group's size.  So each is weighted by its share of the step's samples alone."""
        total = float(sum(gathered.weights))
        shares = [torch.tensor(w / total if total > 0 else 0.0, dtype=torch.float32) for w in gathered.weights]
        tables = []
        for slot in self._slots:
            parts = [gathered.blocks[spec.key] for spec in slot.specs]
            tables.append(TBEStep(*union_step(slot.specs, parts, shares, slot.pooled, slot.name)))
        return UnionUpdate(tables)

    def prepare(self, gathered: GatheredSteps | UnionUpdate) -> PreparedUnion:
        """The union built, and each TBE's forward over it, recording its fused backward: the
        lookup half of the update, which reads the tables and changes no row (run while the
        commit vote is in flight; ``apply`` runs the backward, the update, once the step commits).
        fbgemm's forward does count its calls (``step``; ``iter``): ``discard`` puts them back if
        the step does not commit.  Memory: every TBE's union output (and its autograd graph) is
        held until ``apply``, where running them one at a time held one; the gradients move to
        the device only in ``apply``."""
        update = self.union(gathered) if isinstance(gathered, GatheredSteps) else gathered
        outputs: list[tuple[_Slot, torch.Tensor, torch.Tensor, _Counters]] = []
        with _deterministic(), torch.enable_grad():
            for slot, step in zip(self._slots, self._matching(update)):
                if step.indices.numel() == 0:
                    continue
                device = slot.tbe.current_device if hasattr(slot.tbe, "current_device") else step.indices.device
                counters = _Counters.of(slot.tbe)
                out = slot.run(step.indices.to(device), step.offsets.to(device))
                outputs.append((slot, out, step.grad, counters))
        return PreparedUnion(outputs)

    def discard(self, prepared: PreparedUnion) -> None:
        for slot, _, _, counters in reversed(prepared.take()):
            counters.restore(slot.tbe)

    def apply(self, update: GatheredSteps | UnionUpdate, prepared: PreparedUnion | None = None) -> None:
        """The one update of the step: each TBE's fused backward over the union (``prepare``'s
        forward, run now unless it already ran while the vote was in flight)."""
        prepared = prepared if prepared is not None else self.prepare(update)
        # fbgemm's CUDA backward sums a row's gradients with atomics when it occurs more than
        # ~1024 times in a batch (the union of all replicas' ids easily does): different
        # rounding on each replica.  Deterministic mode makes it one ordered sum.
        with _deterministic():
            for _, out, grad, _ in prepared.take():
                out.backward(grad.reshape(out.shape).to(device=out.device, dtype=out.dtype))

    def _matching(self, update: UnionUpdate) -> list[TBEStep]:
        if len(update.tables) != len(self._slots):
            raise RuntimeError(f"fault tolerance: an update for {len(update.tables)} embedding modules, "
                               f"this model has {len(self._slots)}")
        return update.tables


def _decode(flat: torch.Tensor, sizes: torch.Tensor) -> list[Block]:
    """One participant's gathered blocks (``sizes``: their header rows, in the order they were sent)."""
    n_ints = int(sizes[:, :2].sum())
    ints = flat[:2 * n_ints].contiguous().view(torch.int64)
    floats = flat[2 * n_ints:]
    blocks, i, f = [], 0, 0
    for n_ids, n_lengths, rows, cols in sizes.tolist():
        lengths, ids = ints[i:i + n_lengths], ints[i + n_lengths:i + n_lengths + n_ids]
        blocks.append(Block(lengths, ids, floats[f:f + rows * cols].view(rows, cols)))
        i, f = i + n_lengths + n_ids, f + rows * cols
    return blocks


@dataclass
class GatheredSteps:
    """Every participant's step as gathered, by table shard, with its weight (quorum order): what a committed
    step's union is built from, and what a recovering replica records to replay."""

    blocks: dict[str, list[Block]]
    """Each table shard's blocks, one per participant in quorum order."""
    weights: list[float]

    def nbytes(self) -> int:
        """What the all-gathers delivered (every participant's step, this replica's own included)."""
        return sum(b.nbytes() for parts in self.blocks.values() for b in parts)


@dataclass
class _Counters:
    """fbgemm TBE call counters a forward advances (``step``; ``iter``/``iter_cpu`` for optimizers
    that count iterations), to put back after a forward whose backward never runs."""

    step: int
    iters: dict[str, torch.Tensor]

    @classmethod
    def of(cls, tbe: Any) -> _Counters:
        iters = {name: t.clone() for name in ("iter", "iter_cpu")
                 if isinstance(t := getattr(tbe, name, None), torch.Tensor)}
        return cls(int(getattr(tbe, "step", 0)), iters)

    def restore(self, tbe: Any) -> None:
        if hasattr(tbe, "step"):
            tbe.step = self.step
        for name, saved in self.iters.items():
            getattr(tbe, name).copy_(saved)


@dataclass
class PreparedUnion:
    """A union's forward per TBE: (slot, looked-up output, its gradient, counters before).  Used
    once: by ``apply`` or by ``discard``."""

    outputs: list[tuple[_Slot, torch.Tensor, torch.Tensor, _Counters]]
    used: bool = False

    def take(self) -> list[tuple[_Slot, torch.Tensor, torch.Tensor, _Counters]]:
        if self.used:
            raise RuntimeError("fault tolerance: a prepared union update was applied or discarded twice")
        self.used, outputs, self.outputs = True, self.outputs, []
        return outputs


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
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
