"""Which rows each live rank trains on at each step, decided without moving samples.

Every rank builds the same ``BatchPlanner`` from the same inputs (the split's
history lengths, the seed, the cost model) and asks it for the same steps, so
all ranks agree on the partition without exchanging anything.

Global batch ``s`` of an epoch is rows ``order[s*G : (s+1)*G]`` of its order (``EpochOrder``: row groups
shuffled, then rows within windows of them), ``G`` the global batch size; the partial last batch of an epoch is
dropped in training (every step holds G samples); for evaluation (``keep_partial``) the last step also holds those
rows, so one pass scores every sample and no rank's share is empty (a sharded table's lookup cannot take an empty
batch).

Planning: the samples of ``window`` consecutive global batches are split by
the partitioner into ``window * R`` parts of equal cost (R = live ranks), the
parts are sorted by their heaviest sample, and step ``j`` of the window takes
parts ``j*R .. (j+1)*R - 1``.  With ``window = 1`` that is a plain per-step
partition of global batch s.  With a larger window the samples too heavy to
balance inside one step (heavier than a rank's share) land in the same steps,
one per rank, instead of each stretching a different step; steps then hold
different numbers of samples, and the loss is normalised by each step's count.

Read locality (``locality=True``): the partition above spreads every rank's samples over
all the window's row groups, so at R ranks each rank decodes about R times the bytes it
trains on.  With locality each rank's share of a window is one contiguous run of the
window's samples in row-group order, cut at equal cost, so it lies in one or two row
groups; LPT then splits the run into the window's steps and the
rank's steps are ordered by their heaviest sample (``local_plan.local_window_owner``).
Rank totals are equal to within a sample's cost, so each step is balanced once the
window holds enough samples per rank (window > 1); a rank's step draws on a few users
(format 2) while the global batch still mixes the whole window.

Live ranks may change between steps (fault tolerance shrinks or grows the
set): the unconsumed samples of the current window are re-planned over the new
set, so every sample of an epoch is still trained on exactly once.  The history
of such re-plans in the current window is part of ``state_dict`` so a restart
rebuilds the identical plan.

Requeue (``requeue``): when a rank dies in the middle of step s, the survivors
commit s without its samples; those rows are *carried* into a later step (the
loader uses the next one) and trained there on top of its planned rows.  The
carried rows of a step, sorted (a canonical order), are split by the same
partitioner into one part per live rank, the heaviest part going to the rank
with the lightest planned load, and added to the ranks' rows.  Carry is kept
apart from the windows (``_carry``), so a window re-plan neither loses nor
duplicates it; it lives until the consumer says the step is in the past
(``forget_carry_before``), and ``carry_state``/``load_carry_state`` save it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from freescale.dataloader import balance_kernels
from freescale.dataloader.cost import CostModel
from freescale.dataloader.epoch_order import EpochOrder
from freescale.dataloader.local_plan import local_window_owner
from freescale.dataloader.partition import Parts, lpt_steps, partition
from freescale.dataloader.step_plan import StepPlan

_WINDOWS_KEPT = 8
T = TypeVar("T")


class _Schedule(Generic[T]):
    """A planning input that changes at window boundaries (the cost model, the ranks' speeds): a value from each
    boundary on; a later setting replaces what it covers."""

    def __init__(self, first: T) -> None:
        self._entries: list[tuple[tuple[int, int], T]] = [((0, 0), first)]

    def set(self, boundary: tuple[int, int], value: T) -> None:
        self._entries = [entry for entry in self._entries if entry[0] < boundary]
        self._entries.append((boundary, value))

    def at(self, epoch: int, step: int) -> T:
        """The value in force at ``(epoch, step)``."""
        return [value for start, value in self._entries if start <= (epoch, step)][-1]

    def changes_within(self, epoch: int, first: int, last: int) -> bool:
        """Whether a value starts after step ``first`` of ``epoch``, up to ``last`` (else ``at`` is one over them)."""
        return any((epoch, first) < start <= (epoch, last) for start, _ in self._entries)


@dataclass
class _Window:
    """The global batches of ``window`` steps, planned together.  ``samples`` (row ids, in the
    epoch's order: the same on every rank) and their ``costs`` are computed once; each step's
    parts are positions into them, so a re-plan sorts positions (its canonical order), and a
    window planned afresh (positions 0..n-1) equals one re-planned from its first step."""

    epoch: int
    index: int
    first_step: int
    model: CostModel
    initial_ranks: tuple[int, ...]
    samples: np.ndarray
    costs: np.ndarray
    steps: list[tuple[tuple[int, ...], Parts]]  # per step: (live ranks, positions per rank)
    replans: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    capacities: dict[int, float] | None = None
    """Speed per global rank the window is planned with (a rank not named: 1.0; None: all alike)."""


class BatchPlanner:
    def __init__(
        self,
        lengths: np.ndarray,
        order: EpochOrder,
        *,
        cost_model: CostModel,
        partitioner: str,
        global_batch_size: int,
        window: int = 1,
        equal_count: bool = False,
        max_seq_len: int | None = None,
        locality: bool = False,
        keep_partial: bool = False,
    ) -> None:
        if window > 1 and (equal_count or partitioner == "round_robin"):
            raise ValueError("window > 1 needs a cost-balancing partitioner and equal_count = false")
        if locality and equal_count:
            raise ValueError("locality cuts each rank's share by cost: it cannot also give equal counts")
        self.locality = locality
        clipped = np.maximum(lengths, 0)
        if max_seq_len is not None:
            clipped = np.minimum(clipped, max_seq_len)
        self.lengths = clipped
        self.valid = lengths >= 0  # null histories cost nothing; the source rejects them on read
        # Costs come from a table per cost model, indexed by length (one gather per plan instead of
        # evaluating the model): null histories index the table's last entry, 0.0.
        self._null_index = int(clipped.max(initial=0)) + 1
        # 16 bits where the lengths fit (they do below 65,535): half the bytes to gather from per sample.
        index_type = np.uint16 if self._null_index <= np.iinfo(np.uint16).max else np.int32
        self._table_index = np.where(self.valid, clipped, self._null_index).astype(index_type)
        self._tables: dict[tuple[float, float, float], np.ndarray] = {}
        self.cost_model = cost_model
        self._models: _Schedule[CostModel] = _Schedule(cost_model)
        self.capacities: dict[int, float] | None = None
        """Speed per global rank (1.0: nominal) the next windows are planned with; None: every rank alike."""
        self._capacity_plan: _Schedule[dict[int, float] | None] = _Schedule(None)
        self.order, self.partitioner, self.global_batch_size = order, partitioner, global_batch_size
        self.window, self.equal_count, self.keep_partial = window, equal_count, keep_partial
        self.steps_per_epoch = order.num_rows // global_batch_size
        if keep_partial and self.steps_per_epoch == 0 and order.num_rows:
            self.steps_per_epoch = 1  # fewer rows than one batch: one step of all of them
        # Recently planned windows: a prefetching loader plans ahead, and after a
        # restart of its thread goes back to the window of the consumed position.
        self._windows: OrderedDict[tuple[int, int], _Window] = OrderedDict()
        self.windows_kept = _WINDOWS_KEPT
        # (epoch, step) -> rows requeued onto that step, ascending.  Separate from the windows: re-plans only move a
        # window's own rows, carry is added in ``plan``.  Mutated only by the consumer (the loader halts its producer
        # first, or the producer merely reads it), so a prefetching thread needs no lock.
        self._carry: dict[tuple[int, int], np.ndarray] = {}
        self._remainder: tuple[int, np.ndarray] | None = None

    def set_remainder(self, epoch: int, rows: np.ndarray) -> None:
        """Epoch ``epoch`` trains ``rows``, in this order, instead of its own order: what was left of it
        when a run of another shape saved its position (``reshape.py``).  Its last ``len(rows) % G``
        rows are not planned: the caller carries them."""
        if self.keep_partial:
            raise ValueError("an evaluation planner (keep_partial) plans one pass from its start: no remainder")
        self._remainder = (int(epoch), np.asarray(rows, dtype=np.int64))
        for key in [k for k in self._windows if k[0] == epoch]:
            del self._windows[key]

    def clear_remainder(self) -> None:
        if self._remainder is not None:
            self.set_remainder(self._remainder[0], self.order(self._remainder[0]))
            self._remainder = None

    def steps_in(self, epoch: int) -> int:
        """Steps of ``epoch``: ``steps_per_epoch``, or fewer for an epoch resumed from a remainder."""
        if self._remainder is not None and self._remainder[0] == epoch:
            return int(self._remainder[1].size) // self.global_batch_size
        return self.steps_per_epoch

    def epoch_rows(self, epoch: int, until: int | None = None, first: int = 0) -> np.ndarray:
        """The rows of ``epoch`` in planning order (global batch ``s`` is ``[s*G, (s+1)*G)`` of them); with ``until``,
        only rows ``[first, until)`` sure to be made (``EpochOrder.rows_until``): read no others."""
        if self._remainder is not None and self._remainder[0] == epoch:
            return self._remainder[1]
        return self.order(epoch) if until is None else self.order.rows_until(epoch, until, first)

    def groups_while_ordering(self, epoch: int, first: int, count: int) -> list[int] | None:
        """The row groups steps ``first .. first + count - 1`` of ``epoch`` draw on while its order is not whole
        (``EpochOrder.groups_of_rows``: a read-ahead decodes them meanwhile); else None."""
        if (self._remainder is not None and self._remainder[0] == epoch) or self.order.complete(epoch):
            return None
        return self.order.groups_of_rows(epoch, first * self.global_batch_size, (first + count) * self.global_batch_size)

    def _remember(self, win: _Window) -> _Window:
        self._windows[(win.epoch, win.index)] = win
        while len(self._windows) > self.windows_kept:
            self._windows.popitem(last=False)
        return win

    # ----- planning -------------------------------------------------------------------------
    def plan(self, epoch: int, step: int, live_ranks: tuple[int, ...]) -> StepPlan:
        if not 0 <= step < self.steps_in(epoch):
            raise IndexError(f"step {step} outside the epoch's {self.steps_in(epoch)} steps")
        index = step // self.window
        win = self._windows.get((epoch, index))
        if win is None:
            win = self._remember(self._new_window(epoch, index, tuple(live_ranks)))
        ranks, positions = win.steps[step - win.first_step]
        if ranks != tuple(live_ranks):
            self._replan(win, step, tuple(live_ranks))
            ranks, positions = win.steps[step - win.first_step]
        rows, costs = positions.map(win.samples), positions.map(win.costs)
        speeds = _speeds(win.capacities, ranks)
        carried = self._carry.get((epoch, step))
        if carried is not None and carried.size:
            rows = self._add_carry(win.model, rows, carried, speeds)
            costs = Parts(self.costs(win.model, rows.index), rows.offsets)
        return StepPlan(epoch, step, ranks, rows, costs, win.model, 0 if carried is None else int(carried.size),
                        speeds)

    def plan_steps(self, epoch: int, first: int, count: int, live_ranks: tuple[int, ...]) -> list[StepPlan]:
        """``plan`` of ``count`` steps of ``epoch`` from ``first``: the same plans, the one-step windows among them
        not planned yet partitioned in one call (``lpt_steps``: no Python call a step) where they plan alike, and
        their rows and costs taken in one call each."""
        if not (0 <= first and count >= 0 and first + count <= self.steps_in(epoch)):
            raise IndexError(f"steps {first}..{first + count - 1} outside the epoch's {self.steps_in(epoch)} steps")
        ranks = tuple(live_ranks)
        todo = [step for step in range(first, first + count) if (epoch, step) not in self._windows]
        fresh: dict[int, StepPlan] = {}
        if self._plan_alike(epoch, todo, ranks):
            g, model = self.global_batch_size, self._models.at(epoch, todo[0])
            samples = self.epoch_rows(epoch, (todo[-1] + 1) * g, todo[0] * g)[todo[0] * g:(todo[-1] + 1) * g]
            costs = self.costs(model, samples)
            parts = lpt_steps(costs, len(todo), len(ranks), self.equal_count)
            taken = np.concatenate([part.index for part in parts]) + np.repeat(np.arange(len(todo)) * g, g)
            rows_taken, costs_taken = balance_kernels.take(samples, taken), balance_kernels.take(costs, taken)
            rows_taken.flags.writeable = False  # (the plans' own: handed out as they are, StepInfo.plan_rows)
            capacities = self._capacity_plan.at(epoch, todo[0])
            for j, part in enumerate(parts):
                step, at = todo[j], slice(j * g, (j + 1) * g)
                self._remember(_Window(epoch, step, step, model, ranks, samples[at], costs[at], [(ranks, part)],
                                       capacities=capacities))
                if (epoch, step) not in self._carry:  # (``plan``'s answer, its rows mapped above)
                    fresh[step] = StepPlan(epoch, step, ranks, Parts(rows_taken[at], part.offsets),
                                           Parts(costs_taken[at], part.offsets), model)
        return [fresh.get(step) or self.plan(epoch, step, ranks) for step in range(first, first + count)]

    def _plan_alike(self, epoch: int, steps: list[int], ranks: tuple[int, ...]) -> bool:
        """Whether ``steps`` (not planned yet) can be partitioned in one call: several, consecutive, one-step
        windows of LPT without read locality or a partial last step, one cost model, the ranks alike."""
        if len(steps) < 2 or steps[-1] - steps[0] != len(steps) - 1:
            return False
        if self.window != 1 or self.partitioner != "lpt" or self.locality or self.keep_partial:
            return False
        first, last = steps[0], steps[-1]
        if self._models.changes_within(epoch, first, last) or self._capacity_plan.changes_within(epoch, first, last):
            return False
        return _speeds(self._capacity_plan.at(epoch, first), ranks) is None

    def plan_window(self, epoch: int, step: int, live_ranks: tuple[int, ...]) -> None:
        """Plan the window holding ``(epoch, step)`` now, if it is not planned yet (planning ahead)."""
        index = step // self.window
        if (epoch, index) not in self._windows:
            self._remember(self._new_window(epoch, index, tuple(live_ranks)))

    def _add_carry(self, model: CostModel, rows: Parts, carried: np.ndarray, speeds: np.ndarray | None) -> Parts:
        """``rows`` (one array per live rank) with a share of ``carried`` (ascending)
        added to each, merged in ascending order (the order the source returns).  The
        carry is partitioned on its own, like a step; its heaviest part goes to the
        rank with the lightest planned load (with ``equal_count``: its largest part
        to the rank with the fewest samples), so the step stays as balanced as the
        two partitions allow; with ranks' speeds (``speeds``), part ``i`` is planned for
        rank ``i``'s speed and goes to it.  Deterministic: stable sorts of values every rank
        computes alike."""
        costs = self.costs(model, carried)
        parts = partition(self.partitioner, costs, self.lengths[carried], len(rows), self.equal_count, speeds)
        if speeds is not None:  # part i was planned for rank i's speed
            part_of_rank = np.arange(len(rows), dtype=np.int64)
        else:
            if self.equal_count:
                planned, weight = rows.sizes.astype(np.float64), parts.sizes.astype(np.float64)
            else:
                planned, weight = rows.sums_of(lambda r: self.costs(model, r)), parts.sums(costs)
            part_of_rank = np.empty(len(rows), dtype=np.int64)
            part_of_rank[np.argsort(planned, kind="stable")] = np.argsort(-weight, kind="stable")
        extra = parts.select(part_of_rank).map(carried)
        values = np.concatenate([rows.index, extra.index])
        owners = np.concatenate([rows.owner(), extra.owner()])
        merged = np.lexsort((values, owners))
        sizes = rows.sizes + extra.sizes
        return Parts(values[merged], np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    # ----- requeue ----------------------------------------------------------------------------
    def requeue(self, epoch: int, step: int, rows: np.ndarray) -> None:
        """Train ``rows`` (global row ids) in step ``(epoch, step)`` on top of its plan.

        For samples a dead rank did not train: ``plan`` spreads them over the step's
        live ranks.  Adds to rows already carried onto that step.  Every rank that
        plans the step must requeue the same rows onto it (the loader's callers do).
        """
        if self.keep_partial:
            raise ValueError("an evaluation planner (keep_partial) plans one pass as it is: nothing is requeued")
        if not 0 <= step < self.steps_in(epoch):
            raise IndexError(f"step {step} outside the epoch's {self.steps_in(epoch)} steps")
        if epoch < 0:
            raise IndexError(f"epoch {epoch} is negative")
        new = np.asarray(rows, dtype=np.int64).ravel()
        if new.size == 0:
            return
        if new.min() < 0 or new.max() >= self.order.num_rows:
            raise ValueError(f"requeued row ids must lie in [0, {self.order.num_rows}), got {new.min()}..{new.max()}")
        key = (int(epoch), int(step))
        old = self._carry.get(key)
        self._carry[key] = np.sort(new if old is None else np.concatenate([old, new]), kind="stable")

    def carried(self, epoch: int, step: int) -> np.ndarray:
        """Rows carried onto ``(epoch, step)`` (ascending; empty when none)."""
        return self._carry.get((epoch, step), np.zeros(0, dtype=np.int64)).copy()

    def forget_carry_before(self, epoch: int, step: int) -> None:
        """Drop the carry of every step before ``(epoch, step)``: those are trained
        (the loader calls it with its consumed position, which it never goes back
        behind except through ``load_carry_state``)."""
        for key in [k for k in self._carry if k < (epoch, step)]:
            del self._carry[key]

    def carry_state(self, epoch: int, step: int) -> list[list[object]]:
        """The carry of ``(epoch, step)`` and later steps, JSON-friendly:
        ``[[epoch, step, [row, ...]], ...]`` in step order."""
        return [[e, s, rows.tolist()] for (e, s), rows in sorted(self._carry.items()) if (e, s) >= (epoch, step)]

    def load_carry_state(self, state: list[list[object]]) -> None:
        """Replace the carry with ``state`` (from ``carry_state``)."""
        self._carry.clear()
        for epoch, step, rows in state:
            self.requeue(int(epoch), int(step), np.asarray(rows, dtype=np.int64))  # type: ignore[call-overload]

    def costs(self, model: CostModel, rows: np.ndarray) -> np.ndarray:
        """Per-sample cost of ``rows`` under ``model`` (lengths clipped to max_seq_len)."""
        key = (model.quadratic, model.linear, model.constant)
        table = self._tables.get(key)
        if table is None:
            table = np.append(model(np.arange(self._null_index, dtype=np.int64)), 0.0)
            self._tables[key] = table
        return balance_kernels.lookup(table, self._table_index, np.ascontiguousarray(rows, dtype=np.int64))

    def set_cost_model(self, model: CostModel, epoch: int, step: int) -> None:
        """Plan with ``model`` from the first window that starts at or after ``(epoch, step)``.

        The window holding that step keeps the model it was planned with; windows a
        prefetching thread planned beyond it are forgotten and planned again.  So every
        rank that calls this at the same step gets the same plans, whatever each had
        prefetched.
        """
        self._models.set(self._boundary(epoch, step), model)
        self.cost_model = model

    def set_capacities(self, capacities: dict[int, float] | None, epoch: int, step: int) -> None:
        """Plan with these ranks' speeds (global rank -> speed, 1.0 nominal; a rank not named: 1.0; None: all
        alike) from the first window that starts at or after ``(epoch, step)``, as ``set_cost_model`` does.
        Every rank must call it at the same step with the same speeds (``lpt`` only; not with ``locality``)."""
        if capacities is not None:
            if self.partitioner != "lpt":
                raise ValueError(f"partitioner '{self.partitioner}' does not plan by rank speed (capacities): use 'lpt'")
            if self.locality:
                raise ValueError("capacities: the read-local plan (locality) cuts equal-cost shares; set locality = false")
            bad = [(r, v) for r, v in sorted(capacities.items()) if not (np.isfinite(v) and v > 0)]
            if bad:
                raise ValueError(f"capacities: rank {bad[0][0]} has speed {bad[0][1]}: each must be finite and > 0")
            capacities = {int(r): float(v) for r, v in sorted(capacities.items())}
        self._capacity_plan.set(self._boundary(epoch, step), capacities)
        self.capacities = capacities

    def _boundary(self, epoch: int, step: int) -> tuple[int, int]:
        """The first window start at or after ``(epoch, step)``; windows planned from it on are forgotten."""
        index = -(-step // self.window)
        boundary = (epoch, index * self.window) if index * self.window < self.steps_in(epoch) else (epoch + 1, 0)
        for key in [k for k in self._windows if (k[0], k[1] * self.window) >= boundary]:
            del self._windows[key]
        return boundary

    def _new_window(
        self, epoch: int, index: int, live_ranks: tuple[int, ...], model: CostModel | None = None,
        capacities: dict[int, float] | str | None = "planned",
    ) -> _Window:
        first = index * self.window
        model = model or self._models.at(epoch, first)
        if isinstance(capacities, str):
            capacities = self._capacity_plan.at(epoch, first)
        count = min(self.window, self.steps_in(epoch) - first)
        g = self.global_batch_size
        end = None if self.keep_partial and first + count == self.steps_in(epoch) else (first + count) * g
        samples = self.epoch_rows(epoch, end, first * g)[first * g : end]  # keep_partial: the last step takes the rest
        ranks = tuple(live_ranks)
        win = _Window(epoch, index, first, model, ranks, samples, self.costs(model, samples), [],
                      capacities=capacities)
        win.steps = [(ranks, part) for part in self._split(win, None, count, ranks)]
        return win

    def _replan(self, win: _Window, step: int, live_ranks: tuple[int, ...]) -> None:
        """Re-plan the steps from ``step`` to the window's end over ``live_ranks``."""
        k = step - win.first_step
        remaining = np.sort(np.concatenate([part.index for _, part in win.steps[k:]]))
        steps = self._split(win, remaining, len(win.steps) - k, live_ranks)
        win.steps[k:] = [(live_ranks, part) for part in steps]
        win.replans.append((step, live_ranks))

    def _split(self, win: _Window, positions: np.ndarray | None, steps: int, live_ranks: tuple[int, ...]) -> list[Parts]:
        """``positions`` into the window's samples (ascending: a canonical order; None: all of
        them) -> per step, per rank positions."""
        ranks = len(live_ranks)
        speeds = _speeds(win.capacities, live_ranks)
        if speeds is not None:
            return self._split_by_speed(win, positions, steps, speeds)
        costs = win.costs if positions is None else win.costs[positions]
        rows = win.samples if positions is None else win.samples[positions]
        if self.locality:
            owner = local_window_owner(
                np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(costs, dtype=np.float64),
                self.order.starts, ranks, steps,
            )
            parts = Parts.of_owner(owner, steps * ranks)
            chosen = [parts.select(np.arange(j * ranks, (j + 1) * ranks)) for j in range(steps)]
            return chosen if positions is None else [part.map(positions) for part in chosen]
        lengths = self.lengths[rows] if self.partitioner == "token_kk" else None
        if steps == 1:
            parts = partition(self.partitioner, costs, lengths, ranks, self.equal_count)
            return [parts if positions is None else parts.map(positions)]
        parts = partition(self.partitioner, costs, lengths, steps * ranks)
        by_weight = np.argsort(-parts.maxima(costs), kind="stable")
        chosen = [parts.select(by_weight[j * ranks : (j + 1) * ranks]) for j in range(steps)]
        return chosen if positions is None else [part.map(positions) for part in chosen]

    def _split_by_speed(self, win: _Window, positions: np.ndarray | None, steps: int, speeds: np.ndarray) -> list[Parts]:
        """``_split`` with the ranks' speeds: ``steps x ranks`` parts, part ``j * ranks + i`` planned for rank
        ``i``'s speed; each rank's parts ordered by their heaviest sample, step ``j`` takes the ``j``-th of
        every rank's (the heavy samples of a window still meet in the same steps)."""
        costs = win.costs if positions is None else win.costs[positions]
        ranks = speeds.size
        parts = partition(self.partitioner, costs, None, steps * ranks, self.equal_count, np.tile(speeds, steps))
        heaviest = parts.maxima(costs).reshape(steps, ranks)
        by_weight = np.argsort(-heaviest, axis=0, kind="stable") * ranks + np.arange(ranks)
        chosen = [parts.select(by_weight[j]) for j in range(steps)]
        return chosen if positions is None else [part.map(positions) for part in chosen]

    def planned_before(self, epoch: int, step: int) -> tuple[int, np.ndarray]:
        """The first step of the window holding ``(epoch, step)``, and the rows its steps before ``step``
        were planned (carry aside).  A window not planned yet has had no step consumed: ``(step, [])``."""
        win = self._windows.get((epoch, step // self.window))
        if win is None:
            if step % self.window:
                raise ValueError(f"epoch {epoch}, step {step}: the window of a step past its first was never planned")
            return step, np.zeros(0, dtype=np.int64)
        done = [part.index for _, part in win.steps[: step - win.first_step]]
        return win.first_step, win.samples[np.concatenate(done)] if done else np.zeros(0, dtype=np.int64)

    # ----- state ------------------------------------------------------------------------------
    def forget_planned(self) -> None:
        """Keep no window nor epoch order planned (made again, the same, when asked: a benchmark's second epoch)."""
        self._windows.clear()
        self.order.forget()

    def window_state(self, epoch: int, step: int) -> dict[str, object]:
        """How the window holding ``(epoch, step)`` was planned: its first live ranks and
        every re-plan; empty when it has not been planned (it will be planned afresh)."""
        win = self._windows.get((epoch, step // self.window))
        if win is None:
            return {}
        return {
            "epoch": win.epoch, "index": win.index, "initial_ranks": list(win.initial_ranks),
            "replans": [[s, list(r)] for s, r in win.replans],
            "model": [win.model.quadratic, win.model.linear, win.model.constant],
            **({"capacities": [[r, v] for r, v in sorted(win.capacities.items())]} if win.capacities else {}),
        }

    def load_window_state(self, state: dict[str, object]) -> None:
        """Rebuild a window exactly as it was planned before a restart."""
        self._windows.clear()
        if not state:
            return
        epoch, index = int(state["epoch"]), int(state["index"])  # type: ignore[call-overload]
        replans = [(int(s), tuple(int(x) for x in r)) for s, r in state["replans"]]  # type: ignore[attr-defined]
        initial = tuple(int(x) for x in state["initial_ranks"])  # type: ignore[attr-defined]
        model = CostModel(*state["model"]) if "model" in state else self.cost_model  # type: ignore[misc]
        saved = state.get("capacities")
        capacities = {int(r): float(v) for r, v in saved} if saved else None  # type: ignore[attr-defined]
        win = self._new_window(epoch, index, initial, model, capacities)
        for step, ranks in replans:
            self._replan(win, step, ranks)
        self._remember(win)


def _speeds(capacities: dict[int, float] | None, live_ranks: tuple[int, ...]) -> np.ndarray | None:
    """The live ranks' speeds in their order (a rank not named: 1.0); None when all are alike (the plan is then
    the one without capacities, bit for bit)."""
    if not capacities:
        return None
    speeds = np.array([capacities.get(r, 1.0) for r in live_ranks], dtype=np.float64)
    return None if np.all(speeds == speeds[0]) else speeds
