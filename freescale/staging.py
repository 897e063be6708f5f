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
  backward or, under fault tolerance, in the union update) first copies the
  rows it reads that the cursor has not passed and no lookup saved before:
  their values are still those of the save step, since a row is always looked
  up before it is updated;
- at the agreed step the rest is copied.  The cursor never overwrites a row a
  lookup saved (it holds a later value by then), so the host state equals a
  copy of the whole state made at the save step; DCP writes it from there.

Rows are matched to the state dict's tensors by storage: torchrec's sharded
state dict holds views of fbgemm's per-table weight and optimizer-state
tensors; a tensor matching no table is copied at the save step.  Nothing may
change the tables behind the lookups while a copy is under way: a restore of
the whole state (catch-up under fault tolerance) discards it (``Trainer``).
On CUDA the rows a lookup saves go to host memory at once (a host sync per
lookup while a copy is under way): not yet run on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from freescale import row_copy
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
        self._tbes: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        for _, kernel, fused in embedding_kernels(dmp):
            if fused:
                self._add(kernel.emb_module)

    def _add(self, tbe: Any) -> None:  # fbgemm's TBE (untyped)
        weights = tbe.split_embedding_weights()
        # Per table its optimizer's per-row state (row-wise Adagrad: one); SGD's is none at all (an empty list).
        states = list(tbe.split_optimizer_states()) if hasattr(tbe, "split_optimizer_states") else []
        states += [[] for _ in range(len(weights) - len(states))]
        starts = [0]
        for weight in weights:
            starts.append(starts[-1] + int(weight.size(0)))
        index = len(self._tbes)
        for t, weight in enumerate(weights):
            for tensor in [weight, *states[t]]:
                if tensor.numel() and tensor.size(0) == weight.size(0):
                    self.tables[tensor.data_ptr()] = (index, starts[t], int(weight.size(0)))
        device = weights[0].device if weights else torch.device("cpu")
        table_of_feature = torch.tensor(list(tbe.feature_table_map), dtype=torch.int64, device=device)
        self._tbes.append((table_of_feature, torch.tensor(starts, dtype=torch.int64, device=device), starts[-1]))
        tbe.forward = self._reporting(tbe.forward, index)

    def clear_mask(self, tbe: int, first: int, rows: int, device: torch.device) -> torch.Tensor:
        """A row mask of one table, all False: the same memory each time (a fresh one costs a page fault per
        4 KiB at the save step)."""
        mask = self._masks.get((tbe, first))
        if mask is None or mask.numel() != rows:
            mask = self._masks[(tbe, first)] = torch.zeros(rows, dtype=torch.bool, device=device)
        else:
            mask.zero_()
        return mask

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
        bounds = offsets[::(offsets.numel() - 1) // features].contiguous()  # each feature's first id, and the end
        position = torch.arange(indices.numel(), device=indices.device)
        feature = torch.bucketize(position, bounds[1:].to(position.dtype), right=True).clamp_(max=features - 1)
        return starts[table_of_feature[feature]] + indices.long()


def _leaves(state: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a state dict by the path ``checkpoint.host_copy`` names it (a ShardedTensor's local
    shard ``i`` as ``path#i``)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(state, ShardedTensor):
        for i, shard in enumerate(state.local_shards()):
            yield f"{path}#{i}", shard.tensor
    elif isinstance(state, torch.Tensor):
        yield path, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _leaves(value, f"{path}/{key}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _leaves(value, f"{path}/{i}")


@dataclass
class _Table:
    """One table's tensors being copied (its weight and per-row optimizer state: the same rows): the live
    tensors and their host buffers, the rows copied so far (``cursor``), and the rows a lookup saved
    before the cursor reached them (their host rows hold the save step's values already)."""

    tbe: int
    first: int
    rows: int
    live: list[torch.Tensor] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)
    cursor: int = 0
    saved: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    @property
    def row_bytes(self) -> int:
        return sum(max(1, t[0].numel()) * t.element_size() for t in self.live)

    def copy(self, end: int) -> None:
        """Copy rows ``cursor .. end`` to host memory, keeping the rows a lookup saved among them."""
        a = self.cursor
        saved = self.saved[a:end].nonzero().squeeze(1).add_(a).cpu()
        for live, host in zip(self.live, self.host):
            kept = host.index_select(0, saved) if saved.numel() else None
            host[a:end].copy_(live[a:end])
            if kept is not None:
                host.index_copy_(0, saved, kept)
        self.cursor = end

    def keep(self, flat_rows: torch.Tensor) -> int:
        """Before rows (of this table, not yet copied) are updated: their values now, to host memory.  The
        row copies made (on CPU each row once, ``row_copy``; elsewhere a row looked up twice in the step is
        copied twice, with the same values)."""
        if row_copy.usable(flat_rows, self.saved, *self.live, *self.host):
            fresh = row_copy.fresh_rows(flat_rows, self.first, self.cursor, self.rows, self.saved)
            for live, host in zip(self.live, self.host):
                row_copy.copy_rows(fresh, live, host)
            return int(fresh.size)
        rows = flat_rows - self.first
        rows = rows[(rows >= self.cursor) & (rows < self.rows)]
        rows = rows[~self.saved[rows]]
        if rows.numel():
            self.saved[rows] = True
            on_host = rows.cpu()
            for live, host in zip(self.live, self.host):
                host.index_copy_(0, on_host, live.index_select(0, rows).cpu())
        return int(rows.numel())


class LazySnapshot:
    """The state at one step, copied to host memory over the steps after it (module docstring): the dense
    tensors at once, the tables' rows by ``advance`` at each step boundary and at lookups, the rest by
    ``finish``; then ``assemble`` gives the host state."""

    def __init__(self, tracker: RowTracker, live: dict[str, Any], buffers: dict[str, torch.Tensor] | None = None) -> None:
        """``buffers``: host tensors by path to copy the tables into (touched before: a fresh buffer costs a
        page fault per 4 KiB, at random rows where a lookup keeps them); new ones where missing."""
        started = time.perf_counter()
        self.tracker, self._live = tracker, live
        tables: dict[tuple[int, int], _Table] = {}
        self._host: dict[str, torch.Tensor] = {}
        """Every tensor's host copy by path: the dense ones made now, the tables' filling in."""
        self._table_paths: list[str] = []
        pin = torch.cuda.is_available()
        for path, tensor in _leaves(live):
            found = tracker.tables.get(tensor.data_ptr()) if tensor.numel() else None
            if found is None:
                self._host[path] = tensor.detach().to("cpu", copy=True)
                continue
            if found[:2] not in tables:
                tables[found[:2]] = _Table(*found, saved=tracker.clear_mask(found[0], found[1], found[2], tensor.device))
            table = tables[found[:2]]
            table.live.append(tensor)
            host = (buffers or {}).get(path)
            if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin and tensor.is_cuda)
            table.host.append(host)
            self._host[path] = host
            self._table_paths.append(path)
        self._tables = list(tables.values())
        self._by_tbe: dict[int, list[_Table]] = {}
        for table in self._tables:
            self._by_tbe.setdefault(table.tbe, []).append(table)
        self.total = sum(t.rows * t.row_bytes for t in self._tables)
        self.copied, self.rows_kept, self._seconds, self.keeping_s = 0, 0, 0.0, 0.0
        self.at_step_s = time.perf_counter() - started
        tracker.listener = self._before_lookup

    @property
    def table_buffers(self) -> dict[str, torch.Tensor]:
        """The host buffers of the tables, by path (for the next snapshot, once this one is written)."""
        return {path: self._host[path] for path in self._table_paths}

    def assemble(self) -> dict[str, Any]:
        """The host state, in the live state's structure (ShardedTensors rebuilt over the host shards): once
        ``finish``ed, on any thread (the writer's), since it only reads the structure and the copies."""
        from freescale.checkpoint import host_copy

        return host_copy(self._live, lambda path, _: self._host[path])

    @property
    def bytes_per_s(self) -> float | None:
        return self.copied / self._seconds if self.copied and self._seconds > 0 else None

    @property
    def left(self) -> int:
        return sum((t.rows - t.cursor) * t.row_bytes for t in self._tables)

    def _before_lookup(self, tbe: int, flat_rows: torch.Tensor) -> None:
        """Keep the save step's values of the rows about to be read (and then updated) that the cursor has not
        copied yet and no earlier lookup kept."""
        tables = [t for t in self._by_tbe.get(tbe, ()) if t.cursor < t.rows]
        if not tables:
            return
        started = time.perf_counter()
        for t in tables:  # no dedup (a sort costs more than copying a repeated row twice: the same values)
            self.rows_kept += t.keep(flat_rows)
        self.keeping_s += time.perf_counter() - started

    def advance(self, nbytes: int) -> int:
        """Copy the next ``nbytes`` (at least one row) of the tables to host memory; the bytes copied."""
        start, moved = time.perf_counter(), 0
        for t in self._tables:
            if moved >= nbytes or t.cursor >= t.rows:
                continue
            end = min(t.rows, t.cursor + max(1, (nbytes - moved) // t.row_bytes))
            moved += (end - t.cursor) * t.row_bytes
            t.copy(end)
        self.copied += moved
        self._seconds += time.perf_counter() - start
        return moved

    def finish(self) -> dict[str, float]:
        """Copy what is left: ``state`` is complete.  What it took."""
        started = time.perf_counter()
        self.tracker.listener = None
        self.advance(1 << 62)
        return {"table_bytes": float(self.total), "rows_kept": float(self.rows_kept), "at_step_s": self.at_step_s,
                "copy_s": self._seconds, "keep_s": self.keeping_s, "finish_s": time.perf_counter() - started}

    def discard(self) -> None:
        self.tracker.listener = None


class LazySaves:
    """The pace of a ``LazySnapshot``: rows per step within ``budget`` x the step's time (the median of the
    recent steps, at the copy's measured throughput; ``assumed_bytes_per_s`` before the first measure), and
    the step by which it is done, the same on every rank (``due``: the slowest rank's estimate).  The host
    buffers are made and touched once (``prepare``, at the start) and reused by every save whose previous
    one is written: the job holds one host copy of its tables, as DCP's caching stager does."""

    def __init__(self, tracker: RowTracker, budget: float, assumed_bytes_per_s: float = 2e9) -> None:
        self.tracker, self.budget, self.bytes_per_s = tracker, budget, assumed_bytes_per_s
        self._steps: list[float] = []
        self.snapshot: LazySnapshot | None = None
        self.due = self._began = -1
        self._kept_s = 0.0
        self._buffers: dict[str, torch.Tensor] = {}

    def prepare(self, live: dict[str, Any]) -> float:
        """Make and touch the host buffers of the tables in ``live``; the seconds it took."""
        started = time.perf_counter()
        snapshot = LazySnapshot(self.tracker, live)
        snapshot.discard()
        self._buffers = snapshot.table_buffers
        row_copy.warm_up(list(self._buffers.values()))
        for buffer in self._buffers.values():
            buffer.zero_()
        return time.perf_counter() - started

    def _step_s(self) -> float:
        recent = sorted(self._steps[-20:])
        return recent[len(recent) // 2] if recent else 0.0

    def steps_needed(self, within: int | None = None) -> int:
        """The steps the next snapshot's copy is planned over (before it exists: from the tables' size): half the
        budget for the copy (the other half for the rows kept at lookups), and at most ``within`` steps (the
        steps before the next save, where that save would otherwise finish this copy all at once)."""
        per_step = self.budget * self._step_s() * self.bytes_per_s / 2
        table_bytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        steps = int(table_bytes / per_step) + 1 if per_step > 0 else 1
        if within is not None:
            steps = min(steps, max(1, within))
        return min(steps, 1 << 20)

    def begin(self, live: dict[str, Any], done: int, steps: int, reuse: bool) -> LazySnapshot:
        """At the save step: the snapshot, due ``steps`` steps later (every rank's ``steps_needed``, agreed: the
        largest).  ``reuse``: no earlier save is still being written from the buffers."""
        self.snapshot = LazySnapshot(self.tracker, live, self._buffers if reuse else None)
        self._buffers = self.snapshot.table_buffers
        self.due, self._began, self._kept_s = done + steps, done, 0.0
        return self.snapshot

    def boundary(self, done: int, step_s: float) -> bool:
        """After each step: copy this step's share (the budget less what keeping rows at its lookups took, or
        more where the copy would not be done in time); True when the snapshot is due (``finish`` it now)."""
        self._steps.append(step_s)
        if self.snapshot is None or done == self._began:  # the save step itself copies no table rows
            return False
        if done >= self.due:
            return True
        snapshot = self.snapshot
        keeping, self._kept_s = snapshot.keeping_s - self._kept_s, snapshot.keeping_s
        allowed = max(0.0, self.budget * self._step_s() - keeping) * self.bytes_per_s
        snapshot.advance(int(max(allowed, snapshot.left / max(1, self.due - done), 1)))
        if snapshot.bytes_per_s:
            self.bytes_per_s = snapshot.bytes_per_s
        return False

    def take(self) -> LazySnapshot | None:
        found, self.snapshot = self.snapshot, None
        return found
