"""The data side of the step engine: which rows each step trains, planned ahead, accounted at commit.

Stages 1-2 of a step (plan, read) run here, ahead of the step, and the
accounting of stage 9 closes them.  Every rank of every replica group keeps
the same *plans*; each reads only its own share.

- **Plans ahead, by a fixed depth.**  A pipeline holds ``depth`` batches
  beyond the one it trains (``plain``: 0; torchrec's: 2).  After step ``t``
  commits, step ``t + 1 + depth`` is planned (``BalancedLoader`` plans and
  reads it on its prefetch thread), over the ranks of the groups *ready* at
  that commit, so every group, whatever it trains, plans the same steps over
  the same ranks at the same points: the plans stay identical without any
  exchange.  ``batches()`` is the iterator the pipeline pulls from; it ends
  at the segment's end (a checkpoint, or the last step), so the pipeline
  holds no batch when the data position is saved.
- **Accounting at commit.**  A step's plan is kept until it commits; then
  the rows planned for groups that contributed nothing (dead, hung, catching
  up) are requeued into the next step to be planned: every sample is trained
  exactly once, and no step is discarded.  Steps already in flight keep
  their plans: a group that died leaves its share of them to the requeue, and
  a group that rejoins sits them out and trains from the first step planned
  with it.
- **State** (``state_dict``): the loader's position and carry plus the plans
  in flight: what a checkpoint saves (at a segment end, none in flight) and
  what a recovering group loads from a peer's snapshot.

Without fault tolerance the same code runs with one group, always ready.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist

from freescale.step_types import Accounted, Commit

if TYPE_CHECKING:
    from freescale.dataloader.batch import Batch
    from freescale.dataloader.loader import BalancedLoader, StepInfo
    from freescale.dataloader.partition import Parts


@dataclass
class PlannedStep:
    step: int
    live_ranks: tuple[int, ...]
    plan_rows: Parts
    info: StepInfo | None = None
    """Set when this rank reads a share of the step (its group is planned in)."""
    when: tuple[int, int] | None = None
    """The loader's (epoch, step) the step was planned at (what ``read_in_flight`` reads it as)."""

    def samples_of(self, ranks: range) -> int:
        live = np.asarray(self.live_ranks)
        return int(self.plan_rows.sizes[(live >= ranks.start) & (live < ranks.stop)].sum())


class StepFeed:
    """Plans, reads and accounts the steps of one rank (module docstring)."""

    def __init__(self, loader: BalancedLoader, group: int, group_size: int, groups: int, depth: int,
                 segment_end: Callable[[int], int]) -> None:
        self.loader, self.group, self.group_size, self.groups, self.depth = loader, group, group_size, groups, depth
        self.segment_end = segment_end
        self.ready: frozenset[int] = frozenset(range(groups))
        """Groups the next step is planned over: every group at the start, then those ready at each commit."""
        self.sizes: dict[int, int] = {}
        """Ranks a group runs on where fewer than ``group_size`` (it lost ranks: ``Commit.sizes``): it is planned
        its first that many rank slots, a share in proportion to its ranks."""
        self._plans: deque[PlannedStep] = deque()
        self._batches: deque[Batch] = deque()
        self._next = 0
        """The next step to plan."""
        self._iter: Iterator[Batch] = iter(())

    # ------------------------------------------------------------------ groups and ranks
    def ranks_of(self, group: int) -> range:
        """The group's rank slots (global ranks ``group x group_size ..``); it may run on fewer (``sizes``)."""
        return range(group * self.group_size, (group + 1) * self.group_size)

    def _live_ranks(self) -> list[int]:
        return [r for g in sorted(self.ready) for r in self.ranks_of(g)[:self.sizes.get(g, self.group_size)]]

    # ------------------------------------------------------------------ planning
    def start(self, step: int, ready: frozenset[int]) -> None:
        """Plan from ``step`` on over ``ready`` (a run's first step, a resume, a segment start)."""
        self.ready = ready
        self._plans.clear()
        self._batches.clear()
        self._next = step
        self._top_up(step)

    def _top_up(self, step: int) -> None:
        """Plan every step up to ``step + depth`` within ``step``'s segment."""
        last = min(step + self.depth, self.segment_end(step) - 1)
        fresh_segment = not self._plans
        while self._next <= last:
            if self.group in self.ready:
                self.loader.set_live_ranks(self._live_ranks())
                batch = self.loader.next_batch()
                info = self.loader.last
                assert info is not None
                self._plans.append(PlannedStep(self._next, info.live_ranks, info.plan_rows, info, (info.epoch, info.step)))
                self._batches.append(batch)  # on the host: the pipeline copies it (torchrec: on its own stream)
            else:
                plan = self.loader.skip_step(self._live_ranks())
                self._plans.append(PlannedStep(self._next, plan.live_ranks, plan.rows, when=(plan.epoch, plan.step)))
            self._next += 1
        if fresh_segment:
            self._iter = self._pull()  # a new object: torchrec's pipelines reset "exhausted" on it

    def _pull(self) -> Iterator[Batch]:
        while self._batches:
            yield self._batches.popleft()

    def batches(self) -> Iterator[Batch]:
        """The pipeline's iterator: this rank's batches of the planned steps, in order; it ends
        where the segment ends (the pipeline must then hold nothing)."""
        return self._iter

    def read_in_flight(self) -> None:
        """After a waiting join (``[ft] join = "wait"``) loaded a peer's position: read this rank's share of the
        steps in flight planned with its group (the commit before the step it joined planned it in,
        ``Commit.joining``), as the peers read theirs: the step it joined (``depth`` 0), or a later one (torchrec's
        pipelines: the steps between were planned before it was named; it sits them out, as a group does that
        rejoins by recording, and its pipeline starts at its first batch).  Only the last steps in flight, back to
        back, are read: a pipeline pulls its batches in step order, one a step, so a step planned with the group
        before a gap (one planned while it was still in, before it died) is sat out, its share requeued at its
        commit.  So is a step planned over another number of the group's ranks than it runs on (it re-formed
        smaller or larger since, and no vote named it: it asked in while the others redid a step)."""
        running = dist.get_world_size() if dist.is_initialized() else self.group_size
        mine = self.ranks_of(self.group)
        trailing: list[PlannedStep] = []
        for planned in reversed(self._plans):
            slots = sum(1 for r in planned.live_ranks if r in mine)
            if planned.info is not None or planned.when is None or slots != running or \
                    self.loader.rank not in planned.live_ranks:
                break
            trailing.append(planned)
        for planned in reversed(trailing):
            assert planned.when is not None
            planned.info, batch = self.loader.read_planned(*planned.when, planned.live_ranks, planned.plan_rows)
            self._batches.append(batch)
        self._iter = self._pull()

    def discard_batches(self) -> None:
        """Forget batches read for the pipeline (it was reset: this replica must catch up)."""
        self._batches.clear()
        self._iter = self._pull()

    # ------------------------------------------------------------------ the step about to run
    def head(self, step: int) -> PlannedStep:
        if not self._plans:  # a segment's first step: the pipeline holds nothing, the position is ``step``
            if self._next != step:
                raise RuntimeError(f"step feed: step {step} is running but the data position is at step {self._next}")
            self.start(step, self.ready)
        head = self._plans[0]
        if head.step != step:
            raise RuntimeError(f"step feed: step {step} is running but step {head.step} is planned next")
        return head

    def trains(self, step: int) -> bool:
        """This group's ranks have a share of ``step``."""
        return self.head(step).info is not None

    def weight(self, step: int) -> float:
        """Samples of this group in ``step``: its gradients' weight across groups."""
        return float(self.head(step).samples_of(self.ranks_of(self.group)))

    def rank_samples(self, step: int) -> int:
        """Samples of this rank in ``step``."""
        return self.head(step).samples_of(range(self.loader.rank, self.loader.rank + 1))

    def bind(self, group: int, replicas: int, rank: int, ranks: int) -> None:
        """The fault-tolerance layer's view of this rank's place must be the one the plans were made for."""
        mine = (self.group, self.groups, self.loader.rank - self.group * self.group_size, self.group_size)
        if (group, replicas, rank, ranks) != mine:
            raise ValueError(f"step feed: planned for group {mine[0]} of {mine[1]}, rank {mine[2]} of {mine[3]}; "
                             f"the fault-tolerance layer runs group {group} of {replicas}, rank {rank} of {ranks}")

    # ------------------------------------------------------------------ accounting
    def commit(self, commit: Commit) -> Accounted:
        """After ``commit.step`` committed (or was replayed): requeue the rows of groups that did not
        train it, plan the next step over the ready groups.  Returns the rows the step trained (every
        group's) and this group's samples in it."""
        planned = self.head(commit.step)
        self._plans.popleft()
        groups = np.asarray(planned.live_ranks, dtype=np.int64) // self.group_size
        in_trained = np.isin(groups, np.fromiter(commit.trained, dtype=np.int64, count=len(commit.trained)))
        if not in_trained.all():
            self.loader.requeue(planned.plan_rows.select(np.flatnonzero(~in_trained)).index)
        self.ready = commit.ready | commit.joining  # (a waiting joiner trains the next step planned)
        self.sizes.update(commit.sizes)
        self.sizes = {g: n for g, n in self.sizes.items() if n != self.group_size}
        accounted = Accounted(planned.plan_rows.select(np.flatnonzero(in_trained)).index,
                              planned.samples_of(self.ranks_of(self.group)) if self.group in commit.trained else 0)
        nxt = commit.step + 1
        if self.segment_end(commit.step) > nxt:
            self._top_up(nxt)  # within the segment; the next segment is planned when it starts
        return accounted

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able: the loader's position (= the next step to plan) and the plans in flight."""
        return {"loader": self.loader.state_dict(), "next": self._next, "ready": sorted(self.ready),
                "sizes": [[g, n] for g, n in sorted(self.sizes.items())],
                "plans": [{"step": p.step, "live_ranks": list(p.live_ranks), "rows": [r.tolist() for r in p.plan_rows],
                           **({"when": list(p.when)} if p.when is not None else {})} for p in self._plans]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's (or a checkpoint's) data position.  Batches of in-flight steps are not read:
        this rank sits those steps out (weight 0; ``trains`` is False for them), and every group
        requeues whatever share of them a non-training group had, at their commits; after a waiting
        join, ``read_in_flight`` reads the shares of those its group is planned into."""
        from freescale.dataloader.partition import Parts

        self.loader.load_state_dict(state["loader"])
        self._next = int(state["next"])
        self.ready = frozenset(int(g) for g in state["ready"])
        self.sizes = {int(g): int(n) for g, n in state.get("sizes", [])}  # (absent: saved before groups could shrink)
        self._plans = deque(PlannedStep(int(p["step"]), tuple(p["live_ranks"]),
                                        Parts.of_list([np.asarray(r, dtype=np.int64) for r in p["rows"]]),
                                        when=(int(p["when"][0]), int(p["when"][1])) if "when" in p else None)
                            for p in state["plans"])
        self._batches.clear()
        self._iter = self._pull()
