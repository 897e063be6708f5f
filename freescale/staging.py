"""Copy a checkpoint's tables to host memory after its step, a little per step, so the save step pays almost nothing.

An asynchronous save (``checkpoint.CheckpointWriter``) writes in the background,
but it must first hold a copy of the state as it was at the save step; copying
it all at that step costs about 0.26 s per GB on a CPU host (25 steps of 10 ms).
Most of a recommendation model's state is its embedding tables and their
row-wise optimizer state, and a step changes only the rows it looked up.  So
the tables are copied *after* the step, copy-on-write:

- at the save step, the dense state (parameters, AdamW moments, small tensors)
  is copied at once, and each table tensor (a weight, or a fused optimizer's
  per-row state) gets an empty host buffer and a cursor at row 0;
- at each later step boundary the next rows of the tables are copied, as much as
  ``budget`` of the step's time allows (the copy's throughput is measured as it
  goes), paced to finish by a step every rank agreed on at the save step;
- every lookup with gradient in between (``RowTracker``: fbgemm's fused
  optimizer updates exactly the rows a lookup read, later in that step's
  backward or, under fault tolerance, in the union update) first saves the rows
  it reads that the cursor has not passed and were not saved before: their
  values are still those of the save step, since a row is always looked up
  before it is updated;
- at the agreed step the rest is copied and the saved rows are laid over the
  buffers (a row copied by the cursor after its first update holds a later
  value).  The host state equals a copy of the whole state made at the save
  step; DCP writes it from there.

Rows are matched to the state dict's tensors by storage: torchrec's sharded
state dict holds views of fbgemm's per-table weight and optimizer-state
tensors; a tensor matching no table is copied at the save step.  Nothing may
change the tables behind the lookups while a copy is under way: a restore of
the whole state (catch-up under fault tolerance) discards it (``Trainer``).
On CUDA the rows saved at a lookup stay on the device until the end, and the
masking syncs the host once per lookup: not yet run on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from freescale.parallelize import embedding_kernels


class RowTracker:
    """Tells ``listener`` the rows of every fused table that a lookup with gradient is about to read.

    Wraps each fbgemm TBE's ``forward`` (an instance attribute, installed before any other wrapper such as
    fault tolerance's union update, which calls through it).  A TBE's tables share one flat row space
    (table ``t``'s row ``r`` is ``first[t] + r``); ``listener(tbe, flat_rows)`` gets the looked-up rows in
    it, computed on the TBE's device without a host sync.  A lookup with per-feature batch sizes (VBE)
    reports every row of its TBE."""

    def __init__(self, dmp: nn.Module) -> None:
        self.listener: Callable[[int, torch.Tensor], None] | None = None
        self.tables: dict[int, tuple[int, int, int]] = {}
        """Storage address of a table's weight or per-row optimizer state -> (TBE, its first flat row, rows)."""
        self.nbytes = 0
        """Bytes of those tensors."""
        self._tbes: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for _, kernel, fused in embedding_kernels(dmp):
            if fused:
                self._add(kernel.emb_module)

    def _add(self, tbe: nn.Module) -> None:
        weights = tbe.split_embedding_weights()
        states = tbe.split_optimizer_states() if hasattr(tbe, "split_optimizer_states") else [[] for _ in weights]
        starts = [0]
        for weight in weights:
            starts.append(starts[-1] + int(weight.size(0)))
        index = len(self._tbes)
        for t, weight in enumerate(weights):
            for tensor in [weight, *states[t]]:
                if tensor.numel() and tensor.size(0) == weight.size(0):
                    self.tables[tensor.data_ptr()] = (index, starts[t], int(weight.size(0)))
                    self.nbytes += tensor.numel() * tensor.element_size()
        device = weights[0].device if weights else torch.device("cpu")
        table_of_feature = torch.tensor(list(tbe.feature_table_map), dtype=torch.int64, device=device)
        self._tbes.append((table_of_feature, torch.tensor(starts, dtype=torch.int64, device=device), starts[-1]))
        tbe.forward = self._reporting(tbe.forward, index)

    def _reporting(self, forward: Callable[..., Any], index: int) -> Callable[..., Any]:
        def reported(indices: torch.Tensor, offsets: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.listener is not None and torch.is_grad_enabled() and indices.numel():
                self.listener(index, self._flat_rows(index, indices, offsets,
                                                     kwargs.get("batch_size_per_feature_per_rank")))
            return forward(indices, offsets, *args, **kwargs)
        return reported

    def _flat_rows(self, index: int, indices: torch.Tensor, offsets: torch.Tensor, vbe: Any) -> torch.Tensor:
        table_of_feature, starts, total = self._tbes[index]
        features = table_of_feature.numel()
        if vbe is not None or (offsets.numel() - 1) % features:
            return torch.arange(total, device=indices.device)
        bounds = offsets[::(offsets.numel() - 1) // features]  # where each feature's ids start, and the end
        position = torch.arange(indices.numel(), device=indices.device)
        feature = torch.bucketize(position, bounds[1:].to(position.dtype), right=True).clamp_(max=features - 1)
        return starts[table_of_feature[feature]] + indices.long()


@dataclass
class _Table:
    """One table tensor being copied: the live tensor, its host buffer, the rows copied so far (``cursor``),
    the rows saved at a lookup before the cursor reached them, and their values."""

    path: str
    live: torch.Tensor
    host: torch.Tensor
    tbe: int
    first: int
    cursor: int = 0
    saved: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def row_bytes(self) -> int:
        return max(1, self.live[0].numel()) * self.live.element_size()


class LazySnapshot:
    """The state at one step, copied to host memory over the steps after it (module docstring).  ``state``
    is the host copy (table buffers filling in); ``advance`` at each step boundary; ``finish`` once."""

    def __init__(self, tracker: RowTracker, live: dict[str, Any]) -> None:
        from freescale.checkpoint import host_copy

        started = time.perf_counter()
        self.tracker = tracker
        self._tables: list[_Table] = []
        pin = torch.cuda.is_available()

        def buffer(path: str, tensor: torch.Tensor) -> torch.Tensor | None:
            found = tracker.tables.get(tensor.data_ptr()) if tensor.numel() else None
            if found is None:
                return None
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin and tensor.is_cuda)
            self._tables.append(_Table(path, tensor, host, found[0], found[1],
                                       saved=torch.zeros(found[2], dtype=torch.bool, device=tensor.device)))
            return host

        self.state = host_copy(live, buffer)
        self.total = sum(t.live.numel() * t.live.element_size() for t in self._tables)
        self.copied, self.rows_kept, self._seconds = 0, 0, 0.0
        self.at_step_s = time.perf_counter() - started
        tracker.listener = self._before_lookup

    @property
    def bytes_per_s(self) -> float | None:
        return self.copied / self._seconds if self.copied and self._seconds > 0 else None

    @property
    def left(self) -> int:
        return sum((int(t.live.size(0)) - t.cursor) * t.row_bytes for t in self._tables)

    def _before_lookup(self, tbe: int, flat_rows: torch.Tensor) -> None:
        """Keep the save step's values of the rows about to be read (and then updated) that the cursor has not
        copied yet and no earlier lookup kept."""
        for t in self._tables:
            if t.tbe != tbe or t.cursor >= t.live.size(0):
                continue
            rows = flat_rows - t.first
            rows = rows[(rows >= t.cursor) & (rows < t.live.size(0))]
            rows = torch.unique(rows[~t.saved[rows]])
            if rows.numel():
                t.saved[rows] = True
                t.kept.append((rows, t.live.index_select(0, rows)))
                self.rows_kept += int(rows.numel())

    def advance(self, nbytes: int) -> int:
        """Copy the next ``nbytes`` (at least one row) of the tables to host memory; the bytes copied."""
        start, moved = time.perf_counter(), 0
        for t in self._tables:
            rows = int(t.live.size(0))
            if moved >= nbytes or t.cursor >= rows:
                continue
            end = min(rows, t.cursor + max(1, (nbytes - moved) // t.row_bytes))
            t.host[t.cursor:end].copy_(t.live[t.cursor:end])
            moved += (end - t.cursor) * t.row_bytes
            t.cursor = end
        self.copied += moved
        self._seconds += time.perf_counter() - start
        return moved

    def finish(self) -> dict[str, float]:
        """Copy what is left and lay the kept rows over it: ``state`` is complete.  What it took."""
        started = time.perf_counter()
        self.tracker.listener = None
        self.advance(1 << 62)
        for t in self._tables:
            for rows, values in t.kept:
                t.host.index_copy_(0, rows.cpu(), values.cpu())
        return {"table_bytes": float(self.total), "rows_kept": float(self.rows_kept),
                "at_step_s": self.at_step_s, "finish_s": time.perf_counter() - started}

    def discard(self) -> None:
        self.tracker.listener = None


class LazySaves:
    """The pace of a ``LazySnapshot``: rows per step within ``budget`` x the step's time (the median of the
    recent steps, at the copy's measured throughput; ``assumed_bytes_per_s`` before the first measure), and
    the step by which it is done, the same on every rank (``due``: the slowest rank's estimate)."""

    def __init__(self, tracker: RowTracker, budget: float, assumed_bytes_per_s: float = 2e9) -> None:
        self.tracker, self.budget, self.bytes_per_s = tracker, budget, assumed_bytes_per_s
        self._steps: list[float] = []
        self.snapshot: LazySnapshot | None = None
        self.due = self._began = -1

    def per_step(self) -> float:
        """Bytes a step may copy within the budget (0 before any step was timed)."""
        recent = sorted(self._steps[-20:])
        return self.budget * recent[len(recent) // 2] * self.bytes_per_s if recent else 0.0

    def begin(self, live: dict[str, Any], done: int, agree: Callable[[int], int]) -> LazySnapshot:
        """At the save step: the snapshot, and the step it is due at (``agree``: the max over ranks)."""
        self.snapshot = LazySnapshot(self.tracker, live)
        per_step = self.per_step()
        steps = int(self.snapshot.left / per_step) + 1 if per_step > 0 else 1
        self.due, self._began = done + agree(min(steps, 1 << 20)), done
        return self.snapshot

    def boundary(self, done: int, step_s: float) -> bool:
        """After each step: copy this step's share; True when the snapshot is due (``finish`` it now)."""
        self._steps.append(step_s)
        if self.snapshot is None or done == self._began:  # the save step itself copies no table rows
            return False
        if done >= self.due:
            return True
        self.snapshot.advance(int(max(self.per_step(), self.snapshot.left / max(1, self.due - done))))
        if self.snapshot.bytes_per_s:
            self.bytes_per_s = self.snapshot.bytes_per_s
        return False

    def take(self) -> LazySnapshot | None:
        found, self.snapshot = self.snapshot, None
        return found
