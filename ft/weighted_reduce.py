"""The weighted all-reduce across replica groups: one participant's flat buffer, its reduction
bucket by bucket (during backward: ``FTARStage``, the cross-group stage of
``freescale.grad_buckets``), and what every participant receives.

Averaging is by samples, not by participants: each replica sends ``[sum_i w * g_i, w]``
(``w``: the samples its gradients average over) and everyone divides the summed gradients
by the summed weights, locally and identically (``freescale.ft.ftar`` has the why).  The
buffer also carries, per participant, a weight slot, a *ready* slot and a header of
non-negative integers (sizes for an exchange that follows), so one reduction tells every
participant all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from freescale.ft.replica_group import ReplicaGroup
from freescale.grad_buckets import BucketLayout

_HEADER_SPLIT = 1 << 20
"""Header integers travel in the float32 sum as two parts below 2**20 each: exact up to 2**40."""


class FlatReduction:
    """One participant's buffer for one weighted reduction: ``w * t`` for each tensor at its
    layout offset, then per participant a weight slot, a *ready* slot and its header
    (non-negative int64s, the same count on every participant; this one fills its own slots,
    at ``index`` of ``size``).  ``piece(k)`` is bucket ``k``'s slice (the last one with the
    meta); once every piece is reduced, ``result`` divides by the summed weights."""

    def __init__(self, layout: BucketLayout, weight: float, index: int, size: int, ready: bool,
                 header: torch.Tensor | None, device: torch.device | None = None) -> None:
        head = header.reshape(-1).to(torch.int64).cpu() if header is not None else torch.zeros(0, dtype=torch.int64)
        if head.numel() and (int(head.min()) < 0 or int(head.max()) >= _HEADER_SPLIT ** 2):
            raise ValueError(f"weighted all-reduce: header values must be in [0, 2**40), got {head.tolist()[:8]}")
        self.layout, self.weight, self.size, self.h = layout, float(weight), size, head.numel()
        # On the replica group's device (the host for gloo: device gradients take one copy each).
        # Not zero-filled: ``put`` writes every tensor's slice before its bucket is reduced (a pass
        # over the gradients saved per step); only the meta, where other participants' slots stay 0,
        # is: built on the host and copied once.
        self.flat = torch.empty(layout.total + size * (2 + 2 * self.h), dtype=torch.float32,
                                device=device or torch.device("cpu"))
        meta = torch.zeros(self.flat.numel() - layout.total, dtype=torch.float32)
        meta[index] = self.weight
        meta[size + index] = 1.0 if ready else 0.0
        if self.h:
            headers_at = meta[2 * size:].view(size, 2, self.h)
            headers_at[index, 0] = (head // _HEADER_SPLIT).float()
            headers_at[index, 1] = (head % _HEADER_SPLIT).float()
        self.flat[layout.total:].copy_(meta)

    def piece(self, k: int) -> torch.Tensor:
        lo, hi = self.layout.buckets[k]
        return self.flat[lo:self.flat.numel() if k == len(self.layout.buckets) - 1 else hi]

    def put(self, lo: int, values: torch.Tensor) -> None:
        """``w * values`` at flat offset ``lo`` (the same two operations on every path: same bits)."""
        dst = self.flat[lo:lo + values.numel()]
        src = values.detach().reshape(-1)
        if src.device != dst.device:
            src = src.to(dst.device)  # gloo: one host copy of a device gradient
        torch.mul(src.float(), self.weight, out=dst)  # one pass: the copy and the scaling

    def result(self, like: Sequence[torch.Tensor]) -> Reduced:
        layout, size, h = self.layout, self.size, self.h
        meta = self.flat[layout.total:].cpu()  # a view on the host; one small copy from a device
        weights = meta[:size].tolist()
        flags = [f > 0.5 for f in meta[size:2 * size].tolist()]
        if h:
            headers_at = meta[2 * size:].view(size, 2, h)
            headers = [headers_at[i, 0].long() * _HEADER_SPLIT + headers_at[i, 1].long() for i in range(size)]
        else:
            headers = [torch.zeros(0, dtype=torch.int64)] * size
        total = float(sum(weights))
        if total > 0:  # all weights 0 (no participant trained): the sums are zeros, the caller skips the update
            self.flat[:layout.total].div_(total)
        out = []
        for t, offset in zip(like, layout.offsets):
            piece = self.flat[offset:offset + t.numel()].view(t.shape)
            out.append(piece if t.dtype == torch.float32 and t.device == piece.device
                       else piece.to(device=t.device, dtype=t.dtype))
        return Reduced(out, weights, flags, headers)


@dataclass
class Reduced:
    """What every participant receives from one ``weighted_all_reduce``."""

    tensors: list[torch.Tensor]
    weights: list[float]
    ready: list[bool]
    headers: list[torch.Tensor]
    """Each participant's ``header`` (int64), in quorum order: sizes for a following exchange."""


def weighted_all_reduce(group: ReplicaGroup | dist.ProcessGroup, tensors: Sequence[torch.Tensor], weight: float,
                        index: int = 0, size: int = 1, ready: bool = True,
                        header: torch.Tensor | None = None, layout: BucketLayout | None = None) -> Reduced:
    """``sum_r w_r t_r / sum_r w_r`` over the group; inputs are left untouched.

    The tensors are scaled into one flat float32 buffer (``FlatReduction``), reduced bucket
    by bucket as ``layout`` says (default: one bucket), and the averages are views of it
    (no copies back unless a dtype or device differs).  Every participant receives the
    same weights, ready flags (ready: holds valid state, i.e. is not catching up; the
    trainer plans the next step's data over the ready ones) and headers (so a
    variable-size exchange that follows needs no round of its own to learn the sizes).
    """
    replica_group = ReplicaGroup.of(group)
    layout = layout or BucketLayout.single([t.numel() for t in tensors])
    layout.check(tensors)
    reduction = FlatReduction(layout, weight, index, size, ready, header, replica_group.device)
    for t, offset in zip(tensors, layout.offsets):
        reduction.put(offset, t)
    works = [replica_group.allreduce(reduction.piece(k)) for k in range(len(layout.buckets))]
    for work in works:
        replica_group.wait(work)
    return reduction.result(tensors)


class FTARStage:
    """The cross-group stage of one step's dense buckets (``freescale.grad_buckets.CrossStage``):
    each bucket's group mean, scaled by this replica's weight, into the step's ``FlatReduction``
    (the mean stays in ``param.grad``: after a failure the step is redone in the next quorum
    with exactly what this rank holds), then all-reduced in the quorum's group."""

    def __init__(self, reduction: FlatReduction, group: ReplicaGroup, quorum_id: int) -> None:
        self.reduction, self.group, self.quorum_id = reduction, group, quorum_id

    def start(self, k: int, lo: int, values: torch.Tensor) -> Any:
        self.reduction.put(lo, values)
        return self.group.allreduce(self.reduction.piece(k))

    def wait(self, work: Any) -> None:
        self.group.wait(work)

    def result(self, like: Sequence[torch.Tensor]) -> Reduced:
        return self.reduction.result(like)
