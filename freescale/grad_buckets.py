"""Dense gradients in buckets, reduced while backward runs: the one bucketing every path uses.

DDP reduces a bucket of gradients the moment backward has filled it.  Here
the same idea serves three callers with one layout:

- the prioritized pipeline (no DDP): an **in-group** all-reduce of each
  bucket on a process group of its own (never queued behind torchrec's
  embedding all-to-alls, which the fused embedding update and the next
  lookups wait for), cut into pieces of at most ``chunk_bytes`` with at most
  ``max_inflight`` outstanding, so a high-priority transfer shares the link
  with a bounded amount of dense bytes;
- fault tolerance (``freescale.ft``): the same in-group stage, then a
  **cross-group** stage per bucket (``CrossStage``: the weighted FTAR across
  replica groups, ``freescale.ft.weighted_reduce.FTARStage``), started once the
  in-group stage of that bucket is done and every earlier bucket's cross stage has started;
- the reduction after backward (a replica that did not train a step): the
  same layout, so its collectives match the others' one for one.

Layout (``BucketLayout``): whole tensors in reverse definition order (the
order backward produces them), a small first bucket (a reduction starts early
in backward), the others capped at ``bucket_bytes`` (a larger tensor has a
bucket of its own).  Gradients live in one flat buffer: ``begin`` points each
``param.grad`` at its slice, filled with -0.0 (the IEEE additive identity:
+0.0 would flip the sign of gradients that are exactly -0.0), autograd
accumulates in place, and the in-group reduction runs on the buffer itself.
Gradients are divided by the group size before the sum, as DDP does: with
two ranks (what the tests run) the result is bit-identical to DDP's; with more,
the ring's summation order follows each value's place in the buffer, and DDP's
buckets (rebuilt in ready order) may differ from this layout in the last bit.

Nothing here blocks or raises inside backward: a post-accumulate-grad hook
starts only work whose inputs are complete and records an error instead of
raising it (a wait inside backward could wait for a peer that is itself
blocked in an embedding all-to-all further along its backward).  ``finish``
starts what is left, waits, and raises: ``GroupFailure`` when the in-group
stage failed (the group lost a rank), the cross stage's own error otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn


class GroupFailure(RuntimeError):
    """A collective inside this replica group failed: the group lost a rank (torchrun restarts
    it).  Not a peer group's failure: never redone in another quorum."""


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor sits in a flat buffer, and the buckets it is reduced in (issue order)."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    buckets: tuple[tuple[int, int], ...]
    """Flat ``[lo, hi)`` of each bucket, in issue order."""
    members: tuple[tuple[int, ...], ...]
    """Indices of the tensors in each bucket."""
    total: int

    @classmethod
    def of(cls, numels: Sequence[int], first_bucket_bytes: int = 1 << 20,
           bucket_bytes: int = 25 << 20) -> BucketLayout:
        if first_bucket_bytes <= 0 or bucket_bytes <= 0:
            raise ValueError(f"bucket sizes must be positive, got {first_bucket_bytes} and {bucket_bytes}")
        offsets = [0] * len(numels)
        buckets: list[tuple[int, int]] = []
        members: list[tuple[int, ...]] = []
        current: list[int] = []
        lo = pos = 0
        for i in reversed(range(len(numels))):
            cap = (bucket_bytes if buckets else first_bucket_bytes) // 4
            if current and pos - lo + numels[i] > cap:
                buckets.append((lo, pos))
                members.append(tuple(current))
                current, lo = [], pos
            offsets[i] = pos
            pos += int(numels[i])
            current.append(i)
        if current or not buckets:
            buckets.append((lo, pos))
            members.append(tuple(current))
        return cls(tuple(int(n) for n in numels), tuple(offsets), tuple(buckets), tuple(members), pos)

    @classmethod
    def single(cls, numels: Sequence[int]) -> BucketLayout:
        """One bucket: one reduction of everything (the layout when nothing overlaps)."""
        return cls.of(numels, 1 << 62, 1 << 62)

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        if tuple(t.numel() for t in tensors) != self.numels:
            raise ValueError(f"weighted all-reduce: {len(tensors)} tensors of sizes "
                             f"{[t.numel() for t in tensors][:6]}.. do not fit the layout {list(self.numels)[:6]}..")


class CrossStage(Protocol):
    """The second stage of a bucket's reduction (across replica groups:
    ``freescale.ft.weighted_reduce.FTARStage``)."""

    def start(self, k: int, lo: int, values: torch.Tensor) -> Any:
        """Take bucket ``k`` (flat offset ``lo``; the group mean) and start its reduction; a work handle."""

    def wait(self, work: Any) -> None: ...

    def result(self, like: Sequence[torch.Tensor]) -> Any:
        """Once every bucket's work is waited for: the step's reduced values."""


class BucketedGrads:
    """One rank's dense gradients, reduced bucket by bucket during backward (module docstring).

    Per step::

        grads.begin()                 # before backward: grads become views of the buckets
        grads.attach(cross)           # optional: the cross-group stage of this step
        loss.backward()               # buckets are reduced here
        grads.finish()                # the rest; the cross stage's result (or None)
    """

    def __init__(self, params: Sequence[nn.Parameter], in_group: Any = None, first_bucket_bytes: int = 1 << 20,
                 bucket_bytes: int = 25 << 20, chunk_bytes: int | None = None, max_inflight: int | None = None,
                 broadcast: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32 or p.device != self.params[0].device:
                raise ValueError(f"dense gradient buckets: parameter {i} is {p.dtype} on {p.device}; every dense "
                                 f"parameter must be float32 on {self.params[0].device}")
        self.layout = BucketLayout.of([p.numel() for p in self.params], first_bucket_bytes, bucket_bytes)
        self.in_group = in_group
        self.in_group_size = dist.get_world_size(in_group) if in_group is not None else 1
        if self.in_group_size > 1 and broadcast:
            with torch.no_grad():  # the same initial weights on every rank, as DDP broadcasts them
                for p in self.params:
                    dist.broadcast(p.data, src=dist.get_global_rank(in_group, 0), group=in_group)
        self._stream_ordered = self.in_group_size > 1 and dist.get_backend(in_group) == "nccl"
        """NCCL in the group: a bucket's cross stage can queue behind its in-group stage on the stream."""
        self.max_inflight = max_inflight or 1 << 30
        chunk = max(1, (chunk_bytes or 1 << 62) // 4)
        self._pieces = [[(lo, min(hi, lo + chunk)) for lo in range(lo, max(hi, lo + 1), chunk)]
                        for lo, hi in self.layout.buckets]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grads = torch.zeros(self.layout.total, dtype=torch.float32, device=device)
        """The gradients, in layout order: each ``param.grad`` is a view of it during a step."""
        self._bucket_of = {id(self.params[i]): k for k, members in enumerate(self.layout.members) for i in members}
        self._missing = [0] * len(self.layout.buckets)
        self._in_works: list[list[Any]] = []
        self._next_bucket = self._next_piece = 0
        self._cross_works: list[Any] = []
        self._cross: CrossStage | None = None
        self._error: BaseException | None = None
        self._group_error: BaseException | None = None
        self._active = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    @property
    def active(self) -> bool:
        """Between ``begin`` and ``finish``/``settle``."""
        return self._active

    @property
    def attached(self) -> bool:
        return self._cross is not None

    def views(self) -> list[torch.Tensor]:
        """Each parameter's gradient as it stands (views of ``grads``; the group mean after ``settle``)."""
        return [self.grads[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.layout.offsets)]

    def begin(self) -> None:
        """Before ``loss.backward()``: gradients become views of the buckets, filled with -0.0."""
        self.grads.fill_(-0.0)
        for p, view in zip(self.params, self.views()):
            p.grad = view
        self._missing = [len(members) for members in self.layout.members]
        self._in_works, self._cross_works = [], []
        self._next_bucket = self._next_piece = 0
        self._error = self._group_error = None
        self._cross = None
        self._active = True

    def attach(self, cross: CrossStage) -> None:
        """Run ``cross`` on each bucket once its in-group stage is done (before backward)."""
        assert self._active, "attach() after begin()"
        self._cross = cross

    def finish(self) -> Any:
        """After ``loss.backward()``: start what is left and wait; the cross stage's result, or None."""
        if not self._active:
            raise RuntimeError("dense gradient buckets: finish() without begin()")
        try:
            self._advance(block=True)
            self._settle_in_group()
            if self._error is not None:
                raise self._error
            if self._cross is None:
                return None
            for work in self._cross_works:
                self._cross.wait(work)
            return self._cross.result(self.params)
        finally:
            self._done()

    def settle(self) -> None:
        """After ``loss.backward()``, when the cross stage will not be used (not attached, or its
        quorum failed): finish the in-group stage only, so the gradients hold the group mean."""
        if not self._active:
            return
        try:
            self._cross = None
            self._advance(block=True)
            self._settle_in_group()
        finally:
            self._done()

    def _settle_in_group(self) -> None:
        for works in self._in_works:
            for work in works:
                if work is not None and self._group_error is None:
                    try:
                        work.wait()
                    except (RuntimeError, dist.DistError) as exc:
                        self._group_error = exc
        if self._group_error is not None:
            raise GroupFailure(f"in-group reduction of the dense gradients failed: {self._group_error}") \
                from self._group_error

    def _done(self) -> None:
        # Drop every reference to the cross stage and its pending work: after a failure its group is
        # aborted, and a peer blocked in one of its collectives only sees the connections close once
        # the last reference is gone.
        self._active = False
        self._cross = None
        self._cross_works = []

    # ------------------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._active:
            return
        self._missing[self._bucket_of[id(param)]] -= 1
        self._advance(block=False)

    def _start_in_group(self, block: bool) -> None:
        """Issue in-group pieces in bucket order; at most ``max_inflight`` outstanding unless ``block``."""
        while self._next_bucket < len(self._pieces):
            k, i = self._next_bucket, self._next_piece
            if i == 0:
                if not block and self._missing[k] > 0:
                    return  # backward has not made every gradient of bucket k yet
                self._in_works.append([])
            lo, hi = self._pieces[k][i]
            work = None
            if self.in_group_size > 1 and hi > lo and self._group_error is None:
                while True:
                    pending = [w for ws in self._in_works for w in ws if w is not None and not w.is_completed()]
                    if len(pending) < self.max_inflight:
                        break
                    if not block:
                        return
                    pending[0].wait()
                piece = self.grads[lo:hi]
                piece.div_(self.in_group_size)
                try:
                    work = dist.all_reduce(piece, group=self.in_group, async_op=True)
                except (RuntimeError, dist.DistError) as exc:
                    self._group_error = exc
            self._in_works[k].append(work)
            self._next_piece += 1
            if self._next_piece == len(self._pieces[k]):
                self._next_bucket, self._next_piece = k + 1, 0

    def _advance(self, block: bool) -> None:
        """Start every stage whose inputs are complete, in bucket order; ``block``: all of them."""
        self._start_in_group(block)
        while (self._cross is not None and len(self._cross_works) < len(self._in_works)
               and len(self._in_works[len(self._cross_works)]) == len(self._pieces[len(self._cross_works)])
               and self._group_error is None and self._error is None):
            k = len(self._cross_works)
            for work in self._in_works[k]:
                if work is None:
                    continue
                if not block and not self._stream_ordered and not work.is_completed():
                    return  # a host buffer would make the cross stage wait here, inside backward
                try:
                    work.wait()
                except (RuntimeError, dist.DistError) as exc:
                    self._group_error = exc
                    return
            lo, hi = self.layout.buckets[k]
            try:
                self._cross_works.append(self._cross.start(k, lo, self.grads[lo:hi]))
            except (RuntimeError, dist.DistError) as exc:
                self._error = exc
