"""Dense-gradient all-reduce at low priority: chunked, in order, bounded in flight.

Replaces DDP for the prioritized pipeline.  DDP starts each gradient bucket's
all-reduce the moment the bucket fills, on the same process group as
everything else, so a large dense bucket issued late in backward sits in front
of the embedding-gradient all-to-all that the fused embedding update (and the
next step's lookups) wait for.  Here:

- dense gradients travel on their **own process group** (``dense`` channel),
  never in the queue of the embedding all-to-alls (torchrec's group);
- they are cut into **chunks** of at most ``chunk_bytes``, and at most
  ``max_inflight`` chunks are outstanding: a high-priority transfer shares the
  link with a bounded amount of low-priority bytes, never with the whole model;
- a chunk is issued as soon as backward has produced every gradient in it and
  all earlier chunks are issued (post-accumulate-grad hooks), so the reduction
  overlaps the rest of backward; ``finish()`` issues the rest and waits.

Gradients live in the chunks: ``begin()`` points each parameter's ``.grad`` at
its slice of a flat chunk buffer filled with -0.0, autograd accumulates into it in
place, and the all-reduce runs on the buffer itself (no copies in or out).  A
bucket holds whole parameters; one larger than ``chunk_bytes`` has a bucket of
its own, reduced in ``chunk_bytes`` pieces.

Issue order is the fixed chunk order on every rank (collectives must match),
whatever the timing.  Gradients are divided by the world size before the sum,
as DDP does, so the result is bit-identical to DDP's.  Parameters are
broadcast from rank 0 at construction, as DDP does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    params: list[nn.Parameter] = field(default_factory=list)
    numel: int = 0
    buffer: torch.Tensor | None = None
    waiting_for: int = 0


class DenseGradReducer:
    def __init__(
        self,
        params: list[nn.Parameter],
        group: Any,
        chunk_bytes: int = 1 << 20,
        max_inflight: int = 2,
    ) -> None:
        if chunk_bytes <= 0 or max_inflight <= 0:
            raise ValueError(f"chunk_bytes and max_inflight must be positive, got {chunk_bytes}, {max_inflight}")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.max_inflight = max_inflight
        self.params = [p for p in params if p.requires_grad]
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=0, group=group)
        # Backward produces gradients roughly in reverse order of definition.
        self.buckets: list[_Bucket] = []
        bucket = _Bucket()
        for p in reversed(self.params):
            limit = max(1, chunk_bytes // p.element_size())
            if bucket.params and (bucket.numel + p.numel() > limit or bucket.params[0].dtype != p.dtype
                                  or bucket.params[0].device != p.device):
                self.buckets.append(bucket)
                bucket = _Bucket()
            bucket.params.append(p)
            bucket.numel += p.numel()
        if bucket.params:
            self.buckets.append(bucket)
        for b in self.buckets:
            b.buffer = torch.zeros(b.numel, dtype=b.params[0].dtype, device=b.params[0].device)
        # Pieces in issue order (bucket, start, end): at most chunk_bytes each.
        self._pieces: list[tuple[int, int, int]] = []
        for index, b in enumerate(self.buckets):
            step = max(1, chunk_bytes // b.params[0].element_size())
            self._pieces += [(index, lo, min(b.numel, lo + step)) for lo in range(0, b.numel, step)]
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._next_piece = 0
        self._inflight: list[Any] = []
        self._active = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # ------------------------------------------------------------------------------
    def begin(self) -> None:
        """Call before ``loss.backward()`` (after ``zero_grad``): grads become zeroed views of the buckets."""
        for b in self.buckets:
            assert b.buffer is not None
            # -0.0, not 0.0: the IEEE additive identity.  0.0 + (-0.0) is +0.0, so a
            # zero-filled buffer would flip the sign of gradients that are exactly
            # -0.0, and with it the bits of the optimizer state.
            b.buffer.fill_(-0.0)
            offset = 0
            for p in b.params:
                p.grad = b.buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            b.waiting_for = len(b.params)
        self._next_piece = 0
        self._inflight = []
        self._active = True

    def finish(self) -> None:
        """Call after ``loss.backward()``: issue what is left and wait; grads then hold the average."""
        if not self._active:
            return
        while self._next_piece < len(self._pieces):
            if len(self._inflight) >= self.max_inflight:
                self._inflight.pop(0).wait()
            self._issue_next_piece()
        for work in self._inflight:
            work.wait()
        self._inflight = []
        self._active = False

    # ------------------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        """Issue every piece that is ready, without ever blocking: a wait here, inside
        backward, could wait for a peer that is itself blocked in an embedding
        all-to-all further along its backward."""
        if not self._active:
            return
        self.buckets[self._bucket_of[id(param)]].waiting_for -= 1
        self._inflight = [w for w in self._inflight if not w.is_completed()]
        while (
            self._next_piece < len(self._pieces)
            and self.buckets[self._pieces[self._next_piece][0]].waiting_for == 0
            and len(self._inflight) < self.max_inflight
        ):
            self._issue_next_piece()

    def _issue_next_piece(self) -> None:
        index, lo, hi = self._pieces[self._next_piece]
        bucket = self.buckets[index]
        assert bucket.buffer is not None
        piece = bucket.buffer[lo:hi]
        piece.div_(self.world_size)
        self._inflight.append(dist.all_reduce(piece, group=self.group, async_op=True))
        self._next_piece += 1
