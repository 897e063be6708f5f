"""FTAR overlapped with backward: each gradient bucket is reduced as soon as backward has made it.

``weighted_all_reduce`` reduces after backward, so the whole cross-group
transfer sits between the last gradient and the optimizer step.  Here, as in
DDP, the gradients live in buckets (``ReduceLayout``: whole tensors in reverse
definition order, a small first bucket) and a post-accumulate-grad hook starts
a bucket's reduction the moment backward has produced every gradient in it,
so it overlaps the rest of backward.  Per bucket, two stages:

1. **in-group** (groups of more than one rank): sum over the group's ranks on
   the group's own dense process group, divided by the group size first (as
   DDP does); in place, so ``param.grad`` then holds the group mean;
2. **across groups**: ``w * bucket`` copied into the step's ``FlatReduction``
   (the group mean stays in ``param.grad``: after a failure the step is redone
   in the next quorum with exactly what this rank holds) and all-reduced in the
   quorum's replica-dimension group.  The meta (weights, ready flags, headers)
   rides in the last bucket.

Stage 2 of bucket ``k`` starts only after stage 1 of ``k`` finished and stage 2
of every bucket before it started, so every participant issues the same
collectives in the same order, whatever the timing: a participant that did
not train (catching up, or not planned in) runs ``weighted_all_reduce`` with
the same layout and its collectives match these one for one.

Nothing here blocks or raises inside backward: a hook only starts work whose
inputs are complete (``is_completed``) and records an error instead of raising
it (a wait inside backward could wait for a peer that is itself blocked in an
embedding all-to-all further along its backward).  ``finish()`` starts what is
left, waits, and raises: ``GroupFailure`` when the in-group stage failed (the
group has lost a rank; torchrun restarts it), the backend's error when the
cross-group stage failed (a peer group died: ``ReplicaSync`` redoes the step).

CUDA: the gradients stay on the device.  With NCCL in the group (the in-group
stage) stage 2 of a bucket is queued right behind its stage 1 on the GPU
stream (``work.wait()`` there orders streams and does not block the CPU), and
with NCCL across groups (``[ft] replica_backend``, ``freescale.ft.replica_group``)
the step's buffer is on the GPU too; with gloo across groups the copy into
the host buffer waits for that bucket's gradients.  Not yet run on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from freescale.ft.ftar import FlatReduction, GroupFailure, Reduced, ReduceLayout
from freescale.ft.replica_group import ReplicaGroup

__all__ = ["GroupFailure", "OverlappedFTAR"]


class OverlappedFTAR:
    """Dense gradients of one rank, reduced bucket by bucket during backward (see the module docstring).

    Per step, on a rank whose group trains::

        reduction.begin(weight, header)          # before backward: grads become bucket views
        sync.begin_overlapped(step, reduction)   # attach the step's quorum (False: behind it / no group)
        loss.backward()                          # buckets are reduced here
        sync.reduce_and_commit(step, [p.grad ...], weight, overlapped=reduction)   # finish() or settle()
    """

    def __init__(self, params: Sequence[nn.Parameter], in_group: Any = None, in_group_size: int = 1,
                 first_bucket_bytes: int = 1 << 20, bucket_bytes: int = 25 << 20) -> None:
        self.params = [p for p in params if p.requires_grad]
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32 or p.device != self.params[0].device:
                raise ValueError(f"overlapped FTAR: parameter {i} is {p.dtype} on {p.device}; every dense "
                                 f"parameter must be float32 on {self.params[0].device}")
        self.layout = ReduceLayout.of([p.numel() for p in self.params], first_bucket_bytes, bucket_bytes)
        self.in_group, self.in_group_size = in_group, in_group_size
        self._in_group_stream_ordered = (in_group is not None and in_group_size > 1
                                         and dist.get_backend(in_group) == "nccl")
        """NCCL in the group: a bucket's stage 2 can be queued behind its stage 1 without waiting on the CPU."""
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grads = torch.zeros(self.layout.total, dtype=torch.float32, device=device)
        """The gradients, in layout order: each ``param.grad`` is a view of it during a step."""
        self._bucket_of = {id(self.params[i]): k for k, members in enumerate(self.layout.members) for i in members}
        self._missing = [0] * len(self.layout.buckets)
        self._in_works: list[Any] = []
        self._cross_works: list[Any] = []
        self._reduction: FlatReduction | None = None
        self._group: ReplicaGroup | None = None
        self._error: BaseException | None = None
        self._group_error: BaseException | None = None
        self._active = False
        self._weight, self._header = 0.0, None
        self.quorum_id = -1
        """The quorum the current step's reduction runs in (-1: none started)."""
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def active(self) -> bool:
        """Between ``begin`` and ``finish``/``settle``."""
        return self._active

    @property
    def attached(self) -> bool:
        """The cross-group stage runs in a quorum (``attach`` was called this step)."""
        return self._reduction is not None

    def grads_view(self) -> list[torch.Tensor]:
        """Each parameter's gradient as it stands (views of ``grads``; the group mean after ``finish``)."""
        return [self.grads[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.layout.offsets)]

    def begin(self, weight: float, header: torch.Tensor | None = None) -> None:
        """Before ``loss.backward()`` on every rank of a group that trains this step: gradients
        become views of the buckets (filled with -0.0, the additive identity: +0.0 would flip
        the sign of gradients that are exactly -0.0) and the in-group stage is armed."""
        self.grads.fill_(-0.0)
        for p, view in zip(self.params, self.grads_view()):
            p.grad = view
        self._missing = [len(members) for members in self.layout.members]
        self._in_works, self._cross_works = [], []
        self._error = self._group_error = None
        self._weight, self._header = float(weight), header
        self._reduction, self._group, self.quorum_id = None, None, -1
        self._active = True

    def attach(self, group: ReplicaGroup | dist.ProcessGroup, quorum_id: int, index: int, size: int) -> None:
        """Run the cross-group stage in this quorum's group (``ReplicaSync.begin_overlapped``; before backward)."""
        assert self._active, "attach() after begin()"
        replica_group = ReplicaGroup.of(group)
        self._reduction = FlatReduction(self.layout, self._weight, index, size, True, self._header,
                                        replica_group.device)
        self._group, self.quorum_id = replica_group, quorum_id

    def finish(self) -> Reduced:
        """After ``loss.backward()``, attached: start what is left, wait for all of it; the
        averages (as ``weighted_all_reduce`` returns them), or raise (see the module docstring)."""
        if not self._active or self._reduction is None:
            raise RuntimeError("overlapped FTAR: finish() without begin() and attach()")
        try:
            self._advance(block=True)
            self._settle_in_group()
            if self._error is not None:
                raise self._error
            assert self._group is not None
            for work in self._cross_works:
                self._group.wait(work)
            return self._reduction.result(self.params)
        finally:
            self._done()

    def settle(self) -> None:
        """After ``loss.backward()``, when the cross-group stage will not be used (not attached, or
        its quorum failed): finish the in-group stage, so the gradients hold the group mean for a
        reduction after backward.  Raises ``GroupFailure`` when the in-group stage failed."""
        if not self._active:
            return
        try:
            self._reduction = None  # no more cross-group work
            self._advance(block=True)
            self._settle_in_group()
        finally:
            self._done()

    def _settle_in_group(self) -> None:
        for work in self._in_works:
            if work is not None and self._group_error is None:
                try:
                    work.wait()
                except (RuntimeError, dist.DistError) as exc:
                    self._group_error = exc
        if self._group_error is not None:
            raise GroupFailure(f"in-group reduction of the dense gradients failed: {self._group_error}") \
                from self._group_error

    def _done(self) -> None:
        # Drop every reference to the quorum's group, its pending work included: after a failure the
        # group is aborted, and a peer still blocked in one of its collectives only sees the
        # connections close once the last reference to the group is gone.
        self._active = False
        self._reduction, self._group, self.quorum_id = None, None, -1
        self._in_works, self._cross_works = [], []

    # ------------------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._active:
            return
        self._missing[self._bucket_of[id(param)]] -= 1
        self._advance(block=False)

    def _advance(self, block: bool) -> None:
        """Start every stage whose inputs are complete, in bucket order; ``block``: wait for them (finish)."""
        buckets = self.layout.buckets
        while len(self._in_works) < len(buckets) and (block or self._missing[len(self._in_works)] <= 0):
            lo, hi = buckets[len(self._in_works)]
            work = None
            if self.in_group is not None and self.in_group_size > 1 and self._group_error is None:
                piece = self.grads[lo:hi]
                piece.div_(self.in_group_size)
                try:
                    work = dist.all_reduce(piece, group=self.in_group, async_op=True)
                except (RuntimeError, dist.DistError) as exc:
                    self._group_error = exc
            self._in_works.append(work)
        while (self._reduction is not None and len(self._cross_works) < len(self._in_works)
               and self._group_error is None and self._error is None):
            k = len(self._cross_works)
            work = self._in_works[k]
            if work is not None:
                # NCCL in the group and a device buffer: stage 2 queues behind stage 1 on the stream; a
                # host buffer would make ``put`` wait for it here, inside backward.
                ordered = self._in_group_stream_ordered and self._reduction.flat.is_cuda
                if not block and not ordered and not work.is_completed():
                    return
                try:
                    work.wait()
                except (RuntimeError, dist.DistError) as exc:
                    self._group_error = exc
                    return
            lo, hi = buckets[k]
            self._reduction.put(lo, self.grads[lo:hi])
            try:
                assert self._group is not None
                self._cross_works.append(self._group.allreduce(self._reduction.piece(k)))
            except (RuntimeError, dist.DistError) as exc:
                self._error = exc
