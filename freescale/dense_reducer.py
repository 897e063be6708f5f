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
class _Piece:
    param: nn.Parameter
    start: int
    end: int


@dataclass
class _Chunk:
    pieces: list[_Piece] = field(default_factory=list)
    numel: int = 0
    waiting_for: int = 0
    buffer: torch.Tensor | None = None
    work: Any = None


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
        self.chunks: list[_Chunk] = []
        chunk = _Chunk()
        for p in reversed(self.params):
            per_chunk = max(1, chunk_bytes // p.element_size())
            start = 0
            while start < p.numel():
                take = min(p.numel() - start, per_chunk - chunk.numel)
                chunk.pieces.append(_Piece(p, start, start + take))
                chunk.numel += take
                start += take
                if chunk.numel >= per_chunk:
                    self.chunks.append(chunk)
                    chunk = _Chunk()
        if chunk.pieces:
            self.chunks.append(chunk)
        self._chunks_of: dict[int, list[int]] = {}
        for index, c in enumerate(self.chunks):
            for piece in c.pieces:
                ids = self._chunks_of.setdefault(id(piece.param), [])
                if index not in ids:
                    ids.append(index)
        self._next_issue = 0
        self._inflight: list[_Chunk] = []
        self._active = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # ------------------------------------------------------------------------------
    def begin(self) -> None:
        """Call before ``loss.backward()``."""
        for c in self.chunks:
            c.waiting_for = len({id(piece.param) for piece in c.pieces})
            c.buffer, c.work = None, None
        self._next_issue = 0
        self._inflight = []
        self._active = True

    def finish(self) -> None:
        """Call after ``loss.backward()``: issue what is left, wait, write averaged gradients back."""
        if not self._active:
            return
        while self._next_issue < len(self.chunks):
            self._issue(self.chunks[self._next_issue], force=True)
        for c in self._inflight:
            c.work.wait()
        self._inflight = []
        for c in self.chunks:
            self._scatter_back(c)
        self._active = False

    # ------------------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._active:
            return
        for index in self._chunks_of[id(param)]:
            self.chunks[index].waiting_for -= 1
        self._pump()

    def _pump(self) -> None:
        self._inflight = [c for c in self._inflight if not c.work.is_completed()]
        while (
            self._next_issue < len(self.chunks)
            and self.chunks[self._next_issue].waiting_for == 0
            and len(self._inflight) < self.max_inflight
        ):
            self._issue(self.chunks[self._next_issue], force=False)

    def _issue(self, chunk: _Chunk, force: bool) -> None:
        if force and len(self._inflight) >= self.max_inflight:
            self._inflight.pop(0).work.wait()
        parts = []
        for piece in chunk.pieces:
            grad = piece.param.grad
            flat = grad.reshape(-1)[piece.start:piece.end] if grad is not None else None
            parts.append(flat if flat is not None else torch.zeros(piece.end - piece.start, device=piece.param.device,
                                                                   dtype=piece.param.dtype))
        chunk.buffer = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        chunk.buffer.div_(self.world_size)
        chunk.work = dist.all_reduce(chunk.buffer, group=self.group, async_op=True)
        self._inflight.append(chunk)
        self._next_issue += 1

    @staticmethod
    def _scatter_back(chunk: _Chunk) -> None:
        assert chunk.buffer is not None
        offset = 0
        for piece in chunk.pieces:
            n = piece.end - piece.start
            p = piece.param
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.view(-1)[piece.start:piece.end].copy_(chunk.buffer[offset:offset + n])
            offset += n
        chunk.buffer = None
