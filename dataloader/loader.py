"""``BalancedLoader``: this rank's ``Batch`` of every step, planned by cost, prefetched.

Per step, on every rank, with no exchange of samples::

    planner.plan(epoch, step, live_ranks)   same answer on every rank (planner.py)
    source.read_arrays(my rows)             row-group reads of just these rows, as numpy (source.py,
                                            sequence_source.py: histories cut at read time)
    to_batch(...)                           numpy lengths/values -> KJT, no per-sample loop

A background thread runs those three for the next ``prefetch`` steps, so the
training loop only waits when reading is slower than a step (``wait_s`` in
``last`` says how long it waited).  Planning, Parquet decoding and the numpy
work release the GIL for most of their time, so the thread overlaps the
model's compute even on CPU.  ``prefetch = 0`` does it all inline.

Position and resumption: ``state_dict`` holds the next (epoch, step) to be
*consumed* (prefetched batches do not count) and the current planning window's
history; ``load_state_dict`` restarts there, also with a different set of live
ranks (the rest of the window is re-planned over them).  ``set_live_ranks``
changes the set between steps and discards batches prefetched for the old one.

Requeue: when a rank dies in the middle of a step, the survivors commit that
step without its samples and call ``requeue(its rows)`` (``last.plan_rows``
says which they were); the rows are added to the next step to be consumed and
spread over its live ranks (``BatchPlanner.requeue``), batches prefetched
without them are dropped, so each sample of an epoch is still trained exactly
once.  Carry pending at or after the consumed position is part of
``state_dict``; a failure on an epoch's last step carries into the next
epoch's step 0.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from freescale.dataloader.batch import Batch
from freescale.dataloader.cost import CostModel
from freescale.dataloader.partition import Parts
from freescale.dataloader.planner import BatchPlanner, StepPlan
from freescale.dataloader.reshape import SHAPE_KEYS, remainder, shape_of, start_remainder
from freescale.dataloader.schema import (
    CANDIDATE_ITEM,
    CANDIDATE_TIMESTAMP,
    DENSE,
    HISTORY_ITEMS,
    HISTORY_TIMESTAMPS,
    LABEL,
    SAMPLED_ITEMS,
    USER_ID,
    DataError,
)
from freescale.dataloader.sequence_source import SequenceSource
from freescale.dataloader.source import ParquetSource

# Sparse feature name -> (column, is a list column); no column: the loader makes it.
SPARSE_FEATURES: dict[str, tuple[str, bool]] = {
    HISTORY_ITEMS: (HISTORY_ITEMS, True),
    CANDIDATE_ITEM: (CANDIDATE_ITEM, False),
    USER_ID: (USER_ID, False),
    SAMPLED_ITEMS: ("", True),
}


@dataclass
class StepInfo:
    """What the loader knows about the step just handed out (for logs and benchmarks)."""

    epoch: int
    step: int
    imbalance: float
    bound: float
    global_size: int
    rank_size: int
    rank_cost: float
    wait_s: float
    rows: np.ndarray
    """Global row ids this rank trained on (after skipping bad rows)."""
    live_ranks: tuple[int, ...]
    """The ranks the step was planned over, ascending."""
    plan_rows: Parts
    """Each live rank's planned rows (read-only), in ``live_ranks`` order, carried rows
    included, before any source drops bad rows: what a dead rank would have trained."""
    rank_sizes: tuple[int, ...]
    """``len`` of each of ``plan_rows``: the sample count of each rank."""
    row_lengths: np.ndarray
    """History length of each of ``rows`` (cost-model calibration pairs them with measured time)."""
    loss_scale: float = 1.0
    """What the batch's summed per-sample loss was multiplied by (``BalancedLoader._loss_scale``)."""


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class BalancedLoader:
    def __init__(
        self,
        source: ParquetSource | SequenceSource,
        planner: BatchPlanner,
        *,
        rank: int,
        live_ranks: list[int],
        sparse_features: list[str],
        max_seq_len: int,
        prefetch: int = 2,
        epochs: int | None = None,
        pin_memory: bool = False,
        group_size: int | None = None,
        timestamps: bool = False,
        sampled_items: int = 0,
        seed: int = 0,
    ) -> None:
        unknown = [f for f in sparse_features if f not in SPARSE_FEATURES]
        if unknown:
            raise DataError(f"unknown sparse feature(s) {unknown}; known: {sorted(SPARSE_FEATURES)}")
        if planner.steps_per_epoch == 0:
            raise DataError(
                f"{source.uri}: the split has {source.num_rows} rows, fewer than one global batch "
                f"({planner.global_batch_size})"
            )
        if source.max_seq_len != max_seq_len:
            raise ValueError(f"the source cuts histories at {source.max_seq_len}, the loader was asked for {max_seq_len}")
        self.source, self.planner = source, planner
        # The producer may run ``prefetch`` steps ahead and plan one more window ahead of that (with the
        # consumer's, prefetch // window + 3 windows); the window of the consumed position (and its re-plan
        # history) must still be there when it is saved (read beside the producer: one window's margin) or
        # re-planned: evicting it would re-plan it afresh on this rank alone.
        planner.windows_kept = max(planner.windows_kept, prefetch // planner.window + 4)
        self.rank = rank
        self.sparse_features = list(sparse_features)
        self.max_seq_len = max_seq_len
        self.prefetch = prefetch
        self.epochs = epochs
        self.pin_memory = pin_memory
        self.timestamps = timestamps
        """Batches carry the history's and the candidate's timestamps (the source reads them)."""
        self.sampled_items, self.seed = sampled_items, seed
        """``sampled_item_ids``: this many ids a step, uniform over the items, drawn from (seed, epoch, step,
        rank): the same on a re-read of the step (a resume, a replay), another on every rank."""
        self.group_size = group_size or max(live_ranks) + 1
        """Ranks whose gradients are averaged together first (one replica group; without fault
        tolerance every rank): ``loss_scale`` makes that average the mean over their samples."""
        self.dense_dim = source.manifest.dense_dim
        self._live = self._check_ranks(live_ranks)
        self.epoch, self.step = 0, 0
        self._reshaped_from: tuple[int, dict[str, Any]] | None = None
        """(epoch, the state of another shape whose remainder that epoch trains)."""
        self.last: StepInfo | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._planning = threading.Lock()
        """Held while the producer thread plans: a read of the planner's windows waits for that, not for the
        producer to stop (``state_dict`` at every save)."""
        self._queue: queue.Queue[Any] = queue.Queue()
        self.made: Callable[[int, float], None] | None = None
        """Called after each batch is made, on the thread that made it, with its step (counted from the
        first epoch's start) and the seconds its rows took to read and assemble (the plan not included: it
        does not grow with the rank's share; tests: ``freescale.testing``'s slow data loading)."""

    @property
    def steps_per_epoch(self) -> int:
        return self.planner.steps_per_epoch

    @property
    def global_batch_size(self) -> int:
        return self.planner.global_batch_size

    @property
    def skipped_rows(self) -> int:
        """Rows dropped so far as invalid (``data.on_bad_rows = "skip"``)."""
        return sum(self.source.skipped.values())

    @property
    def live_ranks(self) -> tuple[int, ...]:
        return self._live

    def _check_ranks(self, ranks: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        live = tuple(sorted(set(ranks)))
        if self.rank not in live:
            raise ValueError(f"rank {self.rank} is not among the live ranks {list(live)}")
        return live

    # ----- consuming ---------------------------------------------------------------------------
    def next_batch(self) -> Batch:
        """This rank's batch of the current step; the position then moves one step on."""
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        start = time.perf_counter()
        if self.prefetch == 0:
            item = self._make(self.epoch, self.step, self._live)
        else:
            if self._thread is None:
                self._start()
            item = self._queue.get()
            if isinstance(item, _Failure):
                self._thread = None
                raise item.exc
        plan_info, batch = item
        self.last = StepInfo(**plan_info, wait_s=time.perf_counter() - start)
        self.epoch, self.step = self._advance(self.epoch, self.step)
        # Carry of consumed steps is spent; the producer only reads the carry.
        self.planner.forget_carry_before(self.epoch, self.step)
        return batch

    def start_producing(self) -> None:
        """Start producing the current step's batch now, in the background (otherwise the producer
        starts at the next ``next_batch``, which then waits for the read and the plan): after a
        change of position or live ranks, when the caller has other work before its next batch."""
        if self.prefetch > 0 and self._thread is None and (self.epochs is None or self.epoch < self.epochs):
            self._start()

    def __iter__(self) -> Any:
        while self.epochs is None or self.epoch < self.epochs:
            yield self.next_batch()

    def set_cost_model(self, model: CostModel) -> None:
        """Plan with ``model`` from the next planning window on.  Every rank must call it at
        the same step with the same model (the trainer fits it from gathered timings)."""
        self._halt()
        self.planner.set_cost_model(model, self.epoch, self.step)

    def set_capacities(self, capacities: dict[int, float] | None) -> None:
        """Plan with these ranks' speeds (global rank -> speed, 1.0 nominal; None: all alike) from the next
        planning window on: a slow rank gets a share in proportion to its speed.  Every rank that plans the
        same steps must call it at the same step with the same speeds (``BatchPlanner.set_capacities``).
        A resumed loader plans the window it resumes in as it was planned (the window state carries its
        speeds) and later windows with none: speeds are measured anew (``freescale.rank_speed``)."""
        self._halt()
        self.planner.set_capacities(capacities, self.epoch, self.step)

    def set_live_ranks(self, ranks: list[int]) -> None:
        """Use ``ranks`` from the next step on (batches prefetched for the old set are dropped)."""
        live = self._check_ranks(ranks)
        if live != self._live:
            self._halt()
            self._live = live

    def skip_step(self, live_ranks: tuple[int, ...] | list[int]) -> StepPlan:
        """Plan the current step over ``live_ranks`` and move past it without reading anything.

        For a rank that trains nothing in this step but must keep the same position and
        plan history as the ranks that do: a fault-tolerant replica that is catching up
        (replaying the steps it missed) or that is ready but not yet in the step's live
        set.  ``live_ranks`` need not include this rank.
        """
        self._halt()
        live = tuple(sorted(set(live_ranks)))
        plan = self.planner.plan(self.epoch, self.step, live)
        self.epoch, self.step = self._advance(self.epoch, self.step)
        self.planner.forget_carry_before(self.epoch, self.step)
        return plan

    def requeue(self, rows: np.ndarray) -> None:
        """Train ``rows`` (global row ids) in the next step to be consumed, on top of its plan.

        For the rows of a rank that died during the step just taken (the survivors
        commit it without them): every survivor calls this with the same rows, after
        or before ``set_live_ranks``, and the next ``next_batch`` holds this rank's
        share.  Batches prefetched without them are dropped.
        """
        if self.epochs is not None and self.epoch >= self.epochs:
            raise ValueError(f"the loader has finished its {self.epochs} epoch(s): no step is left for requeued rows")
        self._halt()
        self.planner.requeue(self.epoch, self.step, np.asarray(rows, dtype=np.int64))

    # ----- position ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {
            "epoch": self.epoch, "step": self.step, "global_batch_size": self.global_batch_size,
            "window": self._window_state_for_position(), "skipped": dict(self.source.skipped),
            "cost_model": [self.planner.cost_model.quadratic, self.planner.cost_model.linear,
                           self.planner.cost_model.constant],
            "carry": self.planner.carry_state(self.epoch, self.step),
            "shape": shape_of(self.planner, self.max_seq_len),
        }
        if self._reshaped_from is not None and self._reshaped_from[0] == self.epoch:
            state["reshaped_from"] = self._reshaped_from[1]  # this epoch is still the remainder it defined
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position.  Saved by a loader of another shape (global batch, ranks'
        window, partitioner ...: ``reshape.py``), the rest of its epoch is trained as this epoch's
        remainder, every sample once."""
        self._halt()
        mine = shape_of(self.planner, self.max_seq_len)
        saved = state.get("shape") or {}
        for key in ("num_rows", "row_groups"):
            if key in saved and saved[key] != mine[key]:
                raise DataError(f"{self.source.uri}: the checkpoint's split had {saved[key]:,} {key.replace('_', ' ')}, "
                                f"this one has {mine[key]:,}: another dataset (its position means nothing here)")
        self._reshaped_from = None
        self.planner.clear_remainder()
        if "cost_model" in state:
            self.planner.set_cost_model(CostModel(*state["cost_model"]), 0, 0)
        self.source.skipped.clear()  # the run's count as of the state (not added to what this process decoded)
        self.source.skipped.update(state.get("skipped", {}))
        if "shape" in state and any(state["shape"].get(k) != mine[k] for k in SHAPE_KEYS):
            self.epoch, self.step = start_remainder(self.planner, state, self.source.lengths, self.source.rg_rows)
            self._reshaped_from = (int(state["epoch"]), state)
            return
        if int(state["global_batch_size"]) != self.global_batch_size:  # a state from before shapes were saved
            raise DataError(
                f"{self.source.uri}: the checkpoint's global batch is {state['global_batch_size']}, this run's is "
                f"{self.global_batch_size}, and it does not say how it planned (saved by an older freescale)"
            )
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        if state.get("reshaped_from"):
            self._reshaped_from = (self.epoch, state["reshaped_from"])
            self.planner.set_remainder(*remainder(state["reshaped_from"], self.source.lengths, self.source.rg_rows))
        self.planner.load_window_state(state.get("window") or {})
        self.planner.load_carry_state(state.get("carry") or [])

    def _window_state_for_position(self) -> dict[str, Any]:
        """How the window at the position was planned.  The producer thread plans ahead meanwhile, under
        ``_planning``; it never drops the position's window (``windows_kept`` covers the steps it may be
        ahead) nor re-plans it (live ranks change only with the producer stopped), so reading between two of
        its plans is enough: the batches it prefetched stay (stopping it, as this did, cost a save's next step
        the wait for its batch)."""
        with self._planning:
            return self.planner.window_state(self.epoch, self.step)

    def close(self) -> None:
        self._halt()

    def _advance(self, epoch: int, step: int) -> tuple[int, int]:
        """The position after ``(epoch, step)`` (an epoch resumed from a remainder is shorter)."""
        return _next_position(epoch, step, self.planner.steps_in(epoch))

    # ----- producing ---------------------------------------------------------------------------
    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(
            target=self._produce, args=(self.epoch, self.step, self._live, self._stop, self._queue),
            name="freescale-loader", daemon=True,
        )
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread = None

    def _produce(self, epoch: int, step: int, live: tuple[int, ...], stop: threading.Event, out: queue.Queue[Any]) -> None:
        try:
            while not stop.is_set() and (self.epochs is None or epoch < self.epochs):
                item = self._make(epoch, step, live)
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if not stop.is_set():  # a halt waits for this thread: never for a plan no one needs
                    with self._planning:
                        self._plan_next_window(epoch, step, live)
                epoch, step = self._advance(epoch, step)
        except BaseException as exc:  # handed to the consumer, raised there
            out.put(_Failure(exc))

    def _plan_next_window(self, epoch: int, step: int, live: tuple[int, ...]) -> None:
        """Halfway through a window, plan the next one: a window's plan (``window`` global batches
        at once) then costs the producer time while the queue is full, not at the window's first
        step, whose batch the training thread is about to wait for.  It still runs on this thread:
        a step comes late when the plan takes longer than the prefetched steps.  (The plan runs
        without the GIL; live ranks that change before the window starts re-plan it: the same
        plan as afresh.)"""
        window = self.planner.window
        if window == 1 or step % window != window // 2:
            return
        first = (step // window + 1) * window
        nxt = (epoch, first) if first < self.planner.steps_in(epoch) else (epoch + 1, 0)
        if self.epochs is None or nxt[0] < self.epochs:
            self.planner.plan_window(nxt[0], nxt[1], live)

    def _make(self, epoch: int, step: int, live: tuple[int, ...]) -> tuple[dict[str, Any], Batch]:
        with self._planning:
            plan = self.planner.plan(epoch, step, live)
        start = time.perf_counter()
        rows, costs = plan.for_rank(self.rank)
        arrays, kept = self.source.read_arrays(rows)
        batch = self._to_batch(arrays, kept.size, self.planner.costs(plan.model, kept), self._loss_scale(plan),
                               (epoch, step))
        if self.pin_memory:
            batch = batch.pin_memory()
        plan_rows = Parts(_read_only(plan.rows.index), plan.rows.offsets)
        info = dict(epoch=epoch, step=step, imbalance=plan.imbalance(), bound=plan.bound(),
                    global_size=plan.global_size, rank_size=batch.size, rank_cost=float(costs.sum()), rows=kept,
                    live_ranks=plan.live_ranks, plan_rows=plan_rows, rank_sizes=tuple(plan.rows.sizes.tolist()),
                    row_lengths=self.planner.lengths[kept], loss_scale=batch.loss_scale)
        if self.made is not None:
            self.made(epoch * self.steps_per_epoch + step, time.perf_counter() - start)
        return info, batch

    def batch_of(self, rows: np.ndarray, loss_scale: float, when: tuple[int, int] = (0, 0)) -> Batch:
        """The batch of exactly ``rows`` (global row ids; bad ones dropped as in training), its summed loss
        scaled by ``loss_scale``: a reference replays a run's steps from the rows its log names
        (``freescale.audit_reference``).  Sample costs are not computed (zeros)."""
        arrays, kept = self.source.read_arrays(np.asarray(rows, dtype=np.int64))
        return self._to_batch(arrays, kept.size, np.zeros(kept.size), loss_scale, when)

    def _to_batch(self, arrays: dict[str, np.ndarray], n: int, costs: np.ndarray, loss_scale: float,
                  when: tuple[int, int]) -> Batch:
        """The source's numpy columns (``read_arrays``) -> KJT, dense and labels, no per-sample loop."""
        lengths: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for feature in self.sparse_features:
            column, is_list = SPARSE_FEATURES[feature]
            if n == 0:
                flat, lens = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
            elif feature == SAMPLED_ITEMS:  # all of them under the rank's first sample
                rng = np.random.default_rng([self.seed, *when, self.rank])
                flat = rng.integers(0, self.source.manifest.num_items, self.sampled_items, dtype=np.int64)
                lens = np.zeros(n, dtype=np.int64)
                lens[0] = flat.size
            elif is_list:  # the source cut it to the most recent max_seq_len (gather.py)
                flat, lens = arrays[column], arrays[column + "@"].astype(np.int64, copy=False)
            else:
                flat, lens = arrays[column], np.ones(n, dtype=np.int64)
            values.append(flat.astype(np.int64, copy=False))
            lengths.append(lens)
        sparse = KeyedJaggedTensor(
            keys=self.sparse_features,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )
        dense = arrays[DENSE].reshape(n, self.dense_dim) if n else np.zeros((0, self.dense_dim), dtype=np.float32)
        labels = arrays[LABEL] if n else np.zeros(0, dtype=np.float32)
        history_ts, candidate_ts = _timestamps(arrays, n) if self.timestamps else (None, None)
        return Batch(
            sparse=sparse,
            dense=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
            labels=torch.from_numpy(np.array(labels, dtype=np.float32)),
            costs=torch.from_numpy(costs.astype(np.float32)),
            loss_scale=loss_scale,
            history_timestamps=history_ts, candidate_timestamps=candidate_ts,
        )

    def _loss_scale(self, plan: StepPlan) -> float:
        """Sum of per-sample losses x (ranks / samples) of this rank's group: the in-group mean over
        ranks (DDP's, or the bucketed reducer's) then is the exact mean over the group's samples,
        whatever each rank holds; fault tolerance weights each group's mean by its samples."""
        in_group = np.asarray(plan.live_ranks) // self.group_size == self.rank // self.group_size
        return int(in_group.sum()) / max(int(plan.rows.sizes[in_group].sum()), 1)


def _read_only(rows: np.ndarray) -> np.ndarray:
    """A read-only view: the arrays are the planner's own, shared with its windows."""
    view = rows.view()
    view.flags.writeable = False
    return view


def _next_position(epoch: int, step: int, steps_in_epoch: int) -> tuple[int, int]:
    step += 1
    return (epoch + 1, 0) if step >= steps_in_epoch else (epoch, step)


__all__ = ["BalancedLoader", "StepInfo"]


def _timestamps(arrays: dict[str, np.ndarray], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The history's timestamps (cut like its items) and each candidate's: the source's own where it
    has one (format 2), else the newest history timestamp (0 for an empty history)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    history = arrays[HISTORY_TIMESTAMPS].astype(np.int64, copy=False)
    if CANDIDATE_TIMESTAMP in arrays:
        candidate = arrays[CANDIDATE_TIMESTAMP].astype(np.int64, copy=False)
    else:
        lengths = arrays[HISTORY_TIMESTAMPS + "@"]
        last = np.cumsum(lengths) - 1
        candidate = np.where(lengths > 0, history[np.clip(last, 0, None)] if history.size else 0, 0)
    return torch.from_numpy(np.ascontiguousarray(history)), torch.from_numpy(np.array(candidate, dtype=np.int64))
