"""SM-free all-to-all for ranks on one node: bytes moved by copy engines, in priority order.

NCCL's all-to-all runs as SM kernels, so while it overlaps compute it takes
SMs (and L2 bandwidth) from that compute.  Here each rank's send chunks are
written straight into its peers' memory with ``cudaMemcpyAsync`` (torch's
``copy_`` between contiguous same-dtype tensors), which the GPU executes on its
copy engines (DMA), not on SMs:

    setup (once):   every rank allocates a symmetric buffer of ``world x slot_bytes``
                    (``torch.distributed._symmetric_memory``) and maps every peer's
    per call:       for each peer p: copy my chunk for p into p's buffer, slot [my rank]
                    (on the copy stream; at most ``chunk_bytes`` per memcpy, so a later
                    high-priority call is queued behind at most one chunk, not a whole
                    transfer: copy engines ignore stream priority, so ordering is ours)
                    barrier on the group (one single-CTA signal kernel: the only SM work)
                    copy my slots into the output (local copy engine)

``Transfer`` objects wait in a priority queue; ``flush()`` issues them highest
priority first, chunk by chunk.  On CPU, or when the group spans nodes, the
same call falls back to ``dist.all_to_all_single`` (gloo or NCCL): identical
results, which is what the CPU tests check.

Status: the CUDA path (torch's symmetric-memory API: ``empty``, ``rendezvous``,
``get_buffer``, ``barrier``) has run once, on one H100 with a one-rank NCCL group
(``benchmarks/gpu_all.py``): exact, 360 GB/s at 256 MB; never across two GPUs. It is
not yet wired into torchrec's output dist; ``bench_sm_free.py`` measures the mechanism
it relies on (copy-engine memcpy beside compute vs an SM copy kernel).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(order=True)
class Transfer:
    priority: int
    """Lower runs first (0 = what the first dense layers need)."""
    sequence: int
    output: torch.Tensor = field(compare=False)
    input: torch.Tensor = field(compare=False)
    output_splits: list[int] = field(compare=False)
    input_splits: list[int] = field(compare=False)


class CopyEngineAllToAll:
    def __init__(self, group: dist.ProcessGroup | None = None, slot_bytes: int = 64 << 20,
                 chunk_bytes: int = 4 << 20) -> None:
        world = dist.group.WORLD
        assert group is not None or world is not None, "copy-engine all-to-all: no process group"
        self.group: dist.ProcessGroup = group or world  # type: ignore[assignment]
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.slot_bytes, self.chunk_bytes = slot_bytes, chunk_bytes
        self._queue: list[Transfer] = []
        self._sequence = 0
        self._handle: Any = None  # torch's _SymmetricMemory handle (a private type)
        self._buffer: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        self.uses_copy_engines = torch.cuda.is_available() and dist.get_backend(self.group) == "nccl" and (
            self.world <= torch.cuda.device_count()
        )

    def submit(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
               priority: int) -> None:
        """Queue one all-to-all (splits in rows of dim 0, as ``all_to_all_single``)."""
        if len(output_splits) != self.world or len(input_splits) != self.world:
            raise ValueError(f"copy-engine all-to-all: need {self.world} splits per side, got "
                             f"{len(output_splits)} and {len(input_splits)}")
        heapq.heappush(self._queue, Transfer(priority, self._sequence, output, input, output_splits, input_splits))
        self._sequence += 1

    def flush(self) -> None:
        """Run every queued transfer, highest priority first (same order on every rank)."""
        while self._queue:
            t = heapq.heappop(self._queue)
            if self.uses_copy_engines:
                self._copy_engine(t)
            else:
                dist.all_to_all_single(t.output, t.input, t.output_splits, t.input_splits, group=self.group)

    # ------------------------------------------------------------------------------
    def _setup(self, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self._buffer = symm_mem.empty(self.world * self.slot_bytes, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(self._buffer, self.group)
        self._stream = torch.cuda.Stream(device=device)

    def _copy_engine(self, t: Transfer) -> None:
        if self._handle is None:
            self._setup(t.input.device)
        assert self._handle is not None and self._buffer is not None and self._stream is not None
        row_bytes = t.input[0:1].numel() * t.input.element_size() if t.input.shape[0] else 0
        if max(t.input_splits + t.output_splits, default=0) * row_bytes > self.slot_bytes:
            raise ValueError(f"copy-engine all-to-all: a chunk exceeds the {self.slot_bytes}-byte slot; raise slot_bytes")
        send = t.input.contiguous().view(torch.uint8).reshape(-1)
        offsets = [0]
        for n in t.input_splits:
            offsets.append(offsets[-1] + n * row_bytes)
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for peer in range(self.world):
                peer_buffer = self._handle.get_buffer(peer, (self.world * self.slot_bytes,), torch.uint8)
                start, end = offsets[peer], offsets[peer + 1]
                slot = self.rank * self.slot_bytes
                for lo in range(start, end, self.chunk_bytes):
                    hi = min(end, lo + self.chunk_bytes)
                    peer_buffer[slot + lo - start: slot + hi - start].copy_(send[lo:hi], non_blocking=True)
            self._handle.barrier(channel=0)
            received = t.output.view(torch.uint8).reshape(-1)
            at = 0
            for peer in range(self.world):
                n = t.output_splits[peer] * row_bytes
                received[at:at + n].copy_(self._buffer[peer * self.slot_bytes: peer * self.slot_bytes + n],
                                          non_blocking=True)
                at += n
            self._handle.barrier(channel=0)  # peers may reuse their slots in our buffer after this
        current.wait_stream(self._stream)


def all_to_all_by_priority(requests: list[tuple[int, torch.Tensor, torch.Tensor, list[int], list[int]]],
                           group: dist.ProcessGroup | None = None) -> None:
    """Convenience: run ``(priority, output, input, output_splits, input_splits)`` requests in priority order."""
    engine = CopyEngineAllToAll(group)
    for priority, output, input, out_splits, in_splits in requests:
        engine.submit(output, input, out_splits, in_splits, priority)
    engine.flush()
