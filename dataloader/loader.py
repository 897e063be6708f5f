"""``BalancedLoader``: this rank's ``Batch`` of every step, planned by cost, prefetched.

Per step, on every rank, with no exchange of samples::

    planner.plan(epoch, step, live_ranks)   same answer on every rank (planner.py)
    source.read_runs(my rows of each step)  row-group reads of just these rows, as numpy (source.py,
                                            sequence_source.py: histories cut at read time; step_reader.py)
    assembler.batches(...)                  numpy lengths/values -> KJT, no per-sample loop (assemble.py)

A background thread runs those three ahead of the training loop, so the loop only waits when reading is
slower than a step (``wait_s`` in ``last`` says how long it waited).  Once running it reads ``READ_STEPS``
steps at a time (each planned as alone; their rows in one read, their batches built in one pass): at a few
hundred samples a step the fixed costs of a read and of building tensors outweigh the bytes.  Up to
``prefetch + READ_STEPS`` batches wait ready: a read's batches are handed over together (``handoff.py``: the
consumer is woken once a read, not at every batch, each a hand-over of the GIL; measured: docs/data.md).
Planning, Parquet decoding and the numpy work release the GIL for most of their time, so the thread overlaps the
model's compute even on CPU.  The row groups the coming
steps draw on are read and decoded to Arrow ahead, on a thread of their own (``read_ahead`` of them at most,
``read_ahead.py``), so the prefetch thread mostly finds them decoded and only checks them.  ``prefetch = 0`` does
it all inline, one step at a time.

Position and resumption: ``state_dict`` holds the next (epoch, step) to be *consumed* (prefetched batches do not
count), the current planning window's history and the order's draws at its window (``EpochOrder.state_at``: the
order is made from there); ``load_state_dict`` restarts there, also with a different set of live ranks (the rest of
the window is re-planned over them).  ``set_live_ranks`` changes the set between steps and discards batches
prefetched for the old one.

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

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from freescale.dataloader.assemble import SPARSE_FEATURES, BatchAssembler
from freescale.dataloader.batch import Batch
from freescale.dataloader.copy_thread import CopyThread
from freescale.dataloader.cost import CostModel
from freescale.dataloader.handoff import Handoff
from freescale.dataloader.partition import Parts
from freescale.dataloader.planner import BatchPlanner
from freescale.dataloader.reshape import SHAPE_KEYS, remainder, shape_of, start_remainder
from freescale.dataloader.schema import (
    DataError,
)
from freescale.dataloader.sequence_source import SequenceSource
from freescale.dataloader.source import ParquetSource
from freescale.dataloader.step_plan import StepPlan
from freescale.dataloader.step_reader import StepInfo, StepReader


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


log = logging.getLogger("freescale.dataloader")
READ_STEPS = 16
"""Steps the prefetching producer reads at once (their rows in one read: ``source.read_runs``), once running.  A
halt (a change of live ranks, a requeue, a new cost model) waits for the read in flight: up to this many steps'
reads (~1.5 ms at 256 samples a step of format 2 on a 2-core VM, ~5 ms of format 1)."""


RESERVED_BUFFERS = 3
"""KJT values' buffers of full reads mapped on the copy thread at a loader's first read: as many as a loader at
``prefetch`` 2 keeps in use at once (the read being taken, the one handed over, the one being built)."""


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
        read_ahead: int = 8,
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
        # The producer may run ``prefetch + READ_STEPS`` steps ahead (its queue), with up to ``READ_STEPS`` more
        # made in one read, up to ``READ_STEPS`` more planned while that read is copied (``_make``'s ``then``), and
        # plan one more window ahead of that (with the consumer's, (prefetch + 3 READ_STEPS) // window + 3
        # windows); the window of the consumed position (and its re-plan history) must still be there when it is
        # saved (read beside the producer: one window's margin) or re-planned: evicting it would re-plan it afresh
        # on this rank alone.
        planner.windows_kept = max(planner.windows_kept, (prefetch + 3 * READ_STEPS) // planner.window + 4)
        self.rank = rank
        self.sparse_features = list(sparse_features)
        self.max_seq_len = max_seq_len
        self.prefetch = prefetch
        self.epochs = epochs
        self.timestamps = timestamps
        """Batches carry the history's and the candidate's timestamps (the source reads them)."""
        self.sampled_items, self.seed = sampled_items, seed
        """``sampled_item_ids``: this many ids a step, uniform over the items, drawn from (seed, epoch, step,
        rank): the same on a re-read of the step (a resume, a replay), another on every rank."""
        self.group_size = group_size or max(live_ranks) + 1
        """Ranks whose gradients are averaged together first (one replica group; without fault
        tolerance every rank): ``loss_scale`` makes that average the mean over their samples."""
        self.dense_dim = source.manifest.dense_dim
        self.assembler = BatchAssembler(self.sparse_features, self.dense_dim, rank, timestamps, sampled_items,
                                        source.manifest.num_items, seed)
        self.reader = StepReader(source, planner, self.assembler, rank, self.group_size, pin_memory)
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
        self._handoff: Handoff[Any] = Handoff(prefetch + READ_STEPS)
        self._buffers_due = True
        """The KJT values' buffers not reserved yet (``BufferPool.reserve``: after the first read)."""
        self._next_plans: tuple[tuple[int, int, int, tuple[int, ...]], list[StepPlan]] | None = None
        """The next read's plans, made by the producer while a read's histories are copied (``_make``), with their
        ``(epoch, first, count, live ranks)``; dropped at a halt."""
        self._ahead = (source.read_ahead(planner.global_batch_size, read_ahead)
                       if read_ahead > 0 and prefetch > 0 and not planner.locality else None)
        """Reads the row groups of the coming steps on a thread of its own (``read_ahead.py``), told where the
        reads are by each ``_make``; stopped by ``close``, or when this loader is collected unclosed."""
        if self._ahead is not None:
            weakref.finalize(self, self._ahead.stop)
        self.made: Callable[[int, float], None] | None = None
        """Called for each batch made, on the thread that made it, before it is queued (a halt may still drop
        it), with its step (counted from the first epoch's start) and the seconds its rows took to read and
        assemble (its share of a read of several steps; the plan not included: it does not grow with the rank's
        share; tests: ``freescale.testing``'s slow data loading)."""

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
            info, batch, seconds = self._make(self.epoch, self.step, self._live, 1)[0]
            if self.made is not None:
                self.made(self.epoch * self.steps_per_epoch + self.step, seconds)
            item = (info, batch)
        else:
            if self._thread is None:
                self._start()
            item = self._handoff.get()
            if isinstance(item, _Failure):
                self._thread = None
                raise item.exc
        self.last, batch = item
        self.last.wait_s = time.perf_counter() - start
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
        else:  # (the order's draws at the position's window: a resume makes its order from there)
            window = self.planner.window
            order = self.planner.order.state_at(self.epoch, self.step // window * window * self.global_batch_size)
            if order is not None:
                state["order"] = order
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position.  Saved by a loader of another shape (global batch, ranks'
        window, partitioner ...: ``reshape.py``), the rest of its epoch is trained as this epoch's
        remainder, every sample once."""
        self._halt()
        if self._ahead is not None:  # (the epoch's rows may change: its schedule is made again)
            self._ahead.close()
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
        elif state.get("order") and int(state["order"]["epoch"]) == self.epoch:
            self.planner.order.restore(state["order"])
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
        """Stop the prefetch thread (and its copying thread) and close the files the source holds open (reopened
        if read again)."""
        self._halt()
        if self.assembler.copier is not None:
            self.assembler.copier.close()
        self.source.close()

    def _advance(self, epoch: int, step: int) -> tuple[int, int]:
        """The position after ``(epoch, step)`` (an epoch resumed from a remainder is shorter)."""
        return _next_position(epoch, step, self.planner.steps_in(epoch))

    # ----- producing ---------------------------------------------------------------------------
    def _start(self) -> None:
        if self.assembler.copier is None:  # (a read's histories copied while its batches are built: copy_thread.py)
            self.assembler.copier = CopyThread()
        self._stop = threading.Event()
        self._handoff = Handoff(self.prefetch + READ_STEPS)
        self._thread = threading.Thread(
            target=self._produce, args=(self.epoch, self.step, self._live, self._stop, self._handoff),
            name="freescale-loader", daemon=True,
        )
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                self._handoff.clear()
                self._thread.join(0.05)
            self._handoff.clear()
            self._thread = None
        self._next_plans = None  # (what changes during a halt may change them)

    def _produce(self, epoch: int, step: int, live: tuple[int, ...], stop: threading.Event, out: Handoff[Any]) -> None:
        """Make batches from ``(epoch, step)`` on into ``out`` until stopped: 1, 2, 4 .. ``READ_STEPS`` steps
        a read (the first batch after a (re)start comes as soon as one step's read allows), a read's batches handed
        out together (``handoff.py``: the consumer is woken once a read), or each on its own when ``made`` is set
        (called before each is handed out, so a slowed loader is slow step by step).  A read of
        several steps that fails is made again one step a read up to its end: the steps before the one at fault
        are handed out and its error is raised at its own step, as when reading step by step (and where no step
        fails alone, a warning says so and the reads grow again)."""
        try:
            ramp, failed = 1, None  # failed: a read of several steps that failed, (where it ended, its error)
            while not stop.is_set() and (self.epochs is None or epoch < self.epochs):
                if failed is not None and (epoch, step) >= failed[0]:  # each step of it read alone without a fault:
                    log.warning("a read of several steps failed where each step alone did not (%r); reading on",
                                failed[1])
                    failed = None
                count = 1 if failed is not None else min(ramp, self.planner.steps_in(epoch) - step)
                then = None
                if failed is None and self.made is None:  # (the next read's position and size, planned meanwhile)
                    after = _next_position(epoch, step + count - 1, self.planner.steps_in(epoch))
                    then = (*after, min(2 * ramp, READ_STEPS, self.planner.steps_in(after[0]) - after[1]))
                try:
                    made = self._make(epoch, step, live, count, then)
                except Exception as exc:
                    if count <= 1:
                        raise
                    failed, ramp = ((epoch, step + count), exc), 1
                    continue
                ramp = min(2 * ramp, READ_STEPS)
                if self.made is None:
                    if not out.put_all([(info, batch) for info, batch, _ in made], stop.is_set):
                        return  # (the read's batches handed over before the next window is planned: none waits)
                    if self.planner.window == 1:  # (no window to plan ahead: on to the read's end at once)
                        epoch, step = _next_position(epoch, step + len(made) - 1, self.planner.steps_in(epoch))
                        continue
                for info, batch, seconds in made:
                    if stop.is_set():  # (a halt waits for this thread: never for a plan no one needs)
                        return
                    if self.made is not None:
                        self.made(epoch * self.steps_per_epoch + step, seconds)
                        if not out.put_all([(info, batch)], stop.is_set):
                            return
                    with self._planning:
                        self._plan_next_window(epoch, step, live)
                    epoch, step = self._advance(epoch, step)
        except BaseException as exc:  # handed to the consumer, raised there
            out.put_now(_Failure(exc))

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

    def _make(self, epoch: int, first: int, live: tuple[int, ...], count: int,
              then: tuple[int, int, int] | None = None) -> list[tuple[StepInfo, Batch, float]]:
        """Steps ``first .. first + count - 1`` of ``epoch`` (all in it): each one's info, batch and the seconds its
        rows took to read and assemble (a share of the whole: the read is one).  The steps are planned together
        (``plan_steps``: the same plans as one at a time), their rows read together (``read_runs``: one gather for
        them all) and their batches built together (``assemble``).  ``then``: the next read's ``(epoch, first,
        count)``, planned while this one's histories are copied (one-step windows only: a larger window's plan may
        take longer than the copy, and this read's batches would wait for it)."""
        with self._planning:
            # Until the epoch's order is whole (made a window at a time: the plans below make the windows they need,
            # the read-ahead thread the rest when it has nothing to decode), the read-ahead decodes the row groups
            # of this read's windows and the next; then it follows the epoch's schedule (and makes the next epoch's
            # order on its thread: ``EpochOrder`` keeps two).
            read_ahead = self._ahead
            unordered = self.planner.groups_while_ordering(epoch, first, count) if read_ahead is not None else None
            if read_ahead is not None and unordered is not None:
                read_ahead.prime(epoch, first, unordered, functools.partial(self.planner.order.advance, epoch))
            plans = self._planned_ahead(epoch, first, count, live) or self.planner.plan_steps(epoch, first, count, live)
            if read_ahead is not None and unordered is None:
                read_ahead.at(epoch, first, self.planner.epoch_rows, self.epochs is None or epoch + 1 < self.epochs)

        def plan_next() -> None:
            assert then is not None
            with self._planning:
                try:
                    self._next_plans = ((*then, live), self.planner.plan_steps(*then, live))
                except Exception:  # (planned again by its own read, which raises it)
                    self._next_plans = None

        ahead = then is not None and self.planner.window == 1 and (self.epochs is None or then[0] < self.epochs)
        made = self.reader.read(plans, plan_next if ahead else None)
        if self._buffers_due and self.assembler.copier is not None and made:
            self._reserve_buffers(self.assembler.copier, made)
        return made

    def _reserve_buffers(self, copier: CopyThread, made: list[tuple[StepInfo, Batch, float]]) -> None:
        """The KJT values' buffers of full reads, sized from ``made`` (the first read), mapped on the copy thread."""
        self._buffers_due = False
        per_step = sum(int(batch.sparse.values().numel()) for _, batch, _ in made) / len(made)
        size, pool = int(1.3 * per_step * READ_STEPS) + 1, self.assembler.pool
        copier.aside(lambda: pool.reserve(size, np.int64, RESERVED_BUFFERS))

    def _planned_ahead(self, epoch: int, first: int, count: int, live: tuple[int, ...]) -> list[StepPlan] | None:
        """The plans of the read ``_make`` planned ahead, if it is this one (and forgotten either way)."""
        planned, self._next_plans = self._next_plans, None
        return planned[1] if planned is not None and planned[0] == (epoch, first, count, live) else None

    def read_planned(self, epoch: int, step: int, live_ranks: tuple[int, ...], plan_rows: Parts) -> tuple[StepInfo, Batch]:
        """This rank's batch of a step planned elsewhere (``StepReader.read_planned``); the position does not move."""
        return self.reader.read_planned(epoch, step, live_ranks, plan_rows)

    def batch_of(self, rows: np.ndarray, loss_scale: float, when: tuple[int, int] = (0, 0)) -> Batch:
        """The batch of exactly ``rows`` (``StepReader.batch_of``: a reference replays a run's steps from its log)."""
        return self.reader.batch_of(rows, loss_scale, when)


def _next_position(epoch: int, step: int, steps_in_epoch: int) -> tuple[int, int]:
    step += 1
    return (epoch + 1, 0) if step >= steps_in_epoch else (epoch, step)


__all__ = ["BalancedLoader", "StepInfo"]

