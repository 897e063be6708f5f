"""Reading planned steps into batches: this rank's rows of each plan read from the source, built into ``Batch``es
with their loss scale, and what the loader knows of each step (``StepInfo``).

``BalancedLoader`` (``loader.py``) owns the position, the plans and the prefetch thread, and calls ``read`` with
the steps it planned; ``read_planned`` builds a step another rank planned (a waiting joiner's share of a peer's
plan in flight) exactly as ``read`` would have, and ``batch_of`` the batch of given rows (a reference replaying a
run's log).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from freescale.dataloader.assemble import BatchAssembler, StepRows
from freescale.dataloader.batch import Batch
from freescale.dataloader.partition import Parts
from freescale.dataloader.planner import BatchPlanner
from freescale.dataloader.sequence_source import SequenceSource
from freescale.dataloader.source import ParquetSource
from freescale.dataloader.step_plan import StepPlan


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
    """What the batch's summed per-sample loss was multiplied by (``StepReader.loss_scale``)."""
    wait_s: float = 0.0
    """Seconds the training thread waited for the batch (set as it takes it)."""


class StepReader:
    """One rank's reads and batch building of planned steps (module docstring)."""

    def __init__(self, source: ParquetSource | SequenceSource, planner: BatchPlanner, assembler: BatchAssembler,
                 rank: int, group_size: int, pin_memory: bool) -> None:
        self.source, self.planner, self.assembler = source, planner, assembler
        self.rank, self.group_size, self.pin_memory = rank, group_size, pin_memory
        self._group_span: dict[tuple[int, ...], tuple[int, int]] = {}

    def read_planned(self, epoch: int, step: int, live_ranks: tuple[int, ...], plan_rows: Parts) -> tuple[StepInfo, Batch]:
        """This rank's batch of a step planned elsewhere (``live_ranks``, ``plan_rows``: a peer's plan in flight,
        loaded with its snapshot; ``epoch``, ``step``: the position it was planned at), read and built as
        ``next_batch`` would have had this rank planned it (the same rows, order, sampled negatives and loss
        scale).  The position does not move."""
        rows = Parts(np.asarray(plan_rows.index, dtype=np.int64), plan_rows.offsets)
        model = self.planner.cost_model
        plan = StepPlan(epoch, step, tuple(live_ranks), rows, Parts(self.planner.costs(model, rows.index), rows.offsets),
                        model)
        info, batch, _ = self.read([plan])[0]
        return info, batch

    def read(self, plans: list[StepPlan], meanwhile: Callable[[], None] | None = None
             ) -> list[tuple[StepInfo, Batch, float]]:
        """Planned steps (all of one epoch) read and built: each one's info, batch and its share of the seconds the
        read and build took (their rows in one read, ``read_runs``; their batches in one pass, ``assemble``).
        ``meanwhile``: called while the histories are copied on the assembler's ``copier`` (if they are), before the
        batches are ready (the loader plans its next read there: it must not read the source)."""
        epoch = plans[0].epoch
        start = time.perf_counter()
        mine = [plan.live_ranks.index(self.rank) for plan in plans]
        scales = [self.loss_scale(plan) for plan in plans]
        with self.source.read_lock():  # (the histories stay in the source's buffers until the batches are built)
            arrays, kept, sizes = self.source.read_runs([plan.rows[i] for plan, i in zip(plans, mine)], uncut=True)
            cuts = np.concatenate([[0], np.cumsum(sizes)])
            if all(plan.model == plans[0].model for plan in plans):
                costs = self.planner.costs(plans[0].model, kept)
            else:  # (a new cost model from a window inside these steps)
                costs = np.concatenate([self.planner.costs(plan.model, kept[cuts[j]:cuts[j + 1]])
                                        for j, plan in enumerate(plans)])
            batches, copying = self.assembler.start_batches(
                arrays, StepRows(sizes, costs, scales, [(epoch, plan.step) for plan in plans]))
            try:  # (while the histories are copied; the source's buffers held until the copy is done, whatever)
                infos = self._infos(plans, mine, kept, cuts.tolist(), costs, scales)
                if copying is not None and meanwhile is not None:
                    meanwhile()
            finally:
                if copying is not None:
                    copying.finish()
        if self.pin_memory:
            batches = [batch.pin_memory() for batch in batches]
        share = (time.perf_counter() - start) / len(plans)
        return [(info, batch, share) for info, batch in zip(infos, batches, strict=True)]

    def _infos(self, plans: list[StepPlan], mine: list[int], kept: np.ndarray, at: list[int], costs: np.ndarray,
               scales: list[float]) -> list[StepInfo]:
        """Each of ``plans``' info: this rank's part ``mine``, its rows ``kept`` (the steps' back to back from
        ``at``), their ``costs``, the loss scales."""
        lengths = self.planner.lengths[kept]
        infos = []
        for j, (plan, i) in enumerate(zip(plans, mine)):
            a, b = at[j], at[j + 1]
            rank_sizes = tuple(plan.rows.sizes.tolist())
            planned = costs[a:b] if b - a == rank_sizes[i] else self.planner.costs(
                plan.model, np.sort(plan.rows[i]))  # (the planned rows' cost, summed in row order, bad ones too)
            imbalance, bound = plan.balance()
            rows = plan.rows if not plan.rows.index.flags.writeable else Parts(_read_only(plan.rows.index),
                                                                                plan.rows.offsets)
            infos.append(StepInfo(epoch=plan.epoch, step=plan.step, imbalance=imbalance, bound=bound,
                                  global_size=plan.global_size, rank_size=b - a, rank_cost=float(planned.sum()),
                                  rows=kept[a:b], live_ranks=plan.live_ranks, plan_rows=rows, rank_sizes=rank_sizes,
                                  row_lengths=lengths[a:b], loss_scale=scales[j]))
        return infos

    def batch_of(self, rows: np.ndarray, loss_scale: float, when: tuple[int, int] = (0, 0)) -> Batch:
        """The batch of exactly ``rows`` (global row ids; bad ones dropped as in training), its summed loss
        scaled by ``loss_scale``: a reference replays a run's steps from the rows its log names
        (``freescale.audit_reference``).  Sample costs are not computed (zeros)."""
        arrays, kept = self.source.read_arrays(np.asarray(rows, dtype=np.int64))
        steps = StepRows(np.array([kept.size]), np.zeros(kept.size), [loss_scale], [when])
        return self.assembler.batches(arrays, steps)[0]

    def loss_scale(self, plan: StepPlan) -> float:
        """Sum of per-sample losses x (ranks / samples) of this rank's group: the in-group mean over
        ranks (DDP's, or the bucketed reducer's) then is the exact mean over the group's samples,
        whatever each rank holds; fault tolerance weights each group's mean by its samples."""
        span = self._group_span.get(plan.live_ranks)
        if span is None:  # the group's ranks, contiguous among the sorted live ranks
            mine = np.flatnonzero(np.asarray(plan.live_ranks) // self.group_size == self.rank // self.group_size)
            span = (int(mine[0]), int(mine[-1]) + 1)
            if span[1] - span[0] != mine.size:
                raise ValueError(f"live ranks {list(plan.live_ranks)} are not in ascending order")
            self._group_span = {plan.live_ranks: span}  # (one set of live ranks at a time, as a rule)
        first, end = span
        return (end - first) / max(int(plan.rows.offsets[end] - plan.rows.offsets[first]), 1)


def _read_only(rows: np.ndarray) -> np.ndarray:
    """A read-only view: the arrays are the planner's own, shared with its windows."""
    view = rows.view()
    view.flags.writeable = False
    return view


__all__ = ["StepInfo", "StepReader"]
