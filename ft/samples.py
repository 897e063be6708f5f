"""``StepSamples``: which samples each replica group and rank trains at each step, for a user's own loop.

The data side of fault tolerance in the common case: a stream of sample ids
(step ``s`` brings ids ``s * per_step .. (s + 1) * per_step - 1``; with
``dataset_size``, ``indices`` maps them onto a dataset, reshuffled every epoch)
split over the replica groups that held valid state after the previous step
(and, with ``[ft] join = "wait"``, those the previous commit says join: ``Commit.joining``)
in proportion to the ranks each runs on (a group that lost ranks, ``[ft] on_rank_loss = "shrink"``, runs
on fewer: ``Commit.sizes``), and over each group's ranks.  When a step commits without a group's gradients
(it died, or hung and was left out), that group's share is requeued: it opens
the next step's list, so every id is trained exactly once.

It is a ``freescale.ft.DataState`` (``freescale.step_types``), and ``FaultTolerance`` drives it:

- ``bind`` once, at construction (this group, this rank, their counts);
- ``mine(step)``, ``weight(step)``, ``rank_samples(step)`` after ``begin_step(step)``:
  the plan of a step is made from the state the previous commit left, so every
  group plans every step alike without talking;
- ``commit(commit)`` once per committed step, in step order, on every rank
  (also for the steps a recovering group replays after its snapshot);
- ``state_dict`` / ``load_state_dict``: the carry and the ready groups, in the
  snapshot a recovering group loads (JSON: ids and group indices).

A loop with another need (a streaming reader, weighted samples) implements the
same methods (``freescale.step_types.DataState`` documents each one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from freescale.step_types import Accounted, Commit


class StepSamples:
    """Global sample ids per step, split over the ready replica groups and their ranks (module docstring)."""

    def __init__(self, per_step: int = 0, *, per_rank: int = 0, dataset_size: int | None = None, seed: int = 0) -> None:
        """``per_step`` ids a step, or ``per_rank`` per rank slot of the job (``bind`` makes it ``per_rank x replicas x
        ranks``, the whole groups' ranks: a group that lost ranks plans the same steps as the others)."""
        if (per_step > 0) == (per_rank > 0) or per_step < 0 or per_rank < 0:
            raise ValueError(f"StepSamples: give one of per_step and per_rank, >= 1 (got per_step={per_step}, "
                             f"per_rank={per_rank})")
        if dataset_size is not None and dataset_size < 1:
            raise ValueError(f"StepSamples: dataset_size must be >= 1, got {dataset_size}")
        self.per_step, self.per_rank, self.dataset_size, self.seed = per_step, per_rank, dataset_size, seed
        self.group, self.replicas, self.rank, self.ranks = 0, 1, 0, 1
        self.running = 1
        """The ranks this group runs on now (``bind``: fewer than ``ranks`` after it lost some)."""
        self.ready: list[int] = [0]
        self.sizes: dict[int, int] = {}
        """Ranks a group runs on where fewer than ``ranks`` (the last commit's ``sizes``)."""
        self.carry: list[int] = []
        """Ids of groups left out of the last committed step: they open the next step's list."""
        self.last_trained: list[int] = []
        """The ids the last committed step trained (every group's), sorted."""
        self._plans: dict[int, dict[int, list[int]]] = {}
        self._epoch: tuple[int, np.ndarray] | None = None

    def bind(self, group: int, replicas: int, rank: int, ranks: int) -> None:
        """This rank's place (``FaultTolerance`` calls it once; ``ranks``: a whole group's): every group is ready at
        step 0."""
        if self.per_rank:
            self.per_step = self.per_rank * replicas * ranks
        if self.per_step < replicas * ranks:
            raise ValueError(f"StepSamples: per_step={self.per_step} is fewer than the {replicas} x {ranks} ranks "
                             "of the run: every rank needs a sample each step")
        self.group, self.replicas, self.rank, self.ranks = group, replicas, rank, ranks
        self.running = torch.distributed.get_world_size() if torch.distributed.is_initialized() else ranks
        self.ready = list(range(replicas))

    def _ranks_of(self, group: int) -> int:
        return self.sizes.get(group, self.ranks)

    def plan(self, step: int) -> dict[int, list[int]]:
        """Group index -> its ids of ``step`` (the carried ids first, then the step's own): id ``k`` of the list
        goes to rank slot ``k % slots`` of the ready groups' ranks (rank-major), so each group's share follows its
        ranks and its rank ``r`` takes every ``ranks``-th of the group's ids from the ``r``-th."""
        if step not in self._plans:
            ids = np.asarray(self.carry + list(range(step * self.per_step, (step + 1) * self.per_step)), dtype=np.int64)
            ready = self.ready or list(range(self.replicas))  # (no group ready: nothing commits; keep the ids)
            # Rank-major (every group's rank 0, then every group's rank 1, ...): with whole groups, group i of the
            # ready ones takes ids i, i + R, ... and its rank r every G-th of those from the r-th.
            slots = np.asarray([g for r in range(max(self._ranks_of(g) for g in ready)) for g in ready
                                if r < self._ranks_of(g)], dtype=np.int64)
            owner = slots[np.arange(ids.size) % slots.size]
            self._plans[step] = {g: ids[owner == g].tolist() for g in ready}
        return self._plans[step]

    def mine(self, step: int) -> torch.Tensor:
        """This rank's ids of ``step`` (int64; empty when its group is not planned in, or sits the step out)."""
        return torch.tensor(self._share(step)[self.rank::self._ranks_of(self.group)], dtype=torch.int64)

    def _share(self, step: int) -> list[int]:
        """This group's ids of ``step``; none when the step was planned over another number of its ranks than it runs
        on (it re-formed smaller or larger, and asked in while the others redid a step, so no vote named it at its
        new size; or a state saved at another size): every rank of the group sits the step out alike, its weight 0,
        and its share is requeued at the commit, as that of any group that contributes nothing."""
        ids = self.plan(step).get(self.group, [])
        return ids if self._ranks_of(self.group) == self.running else []

    def indices(self, ids: torch.Tensor) -> torch.Tensor:
        """Dataset positions of ``ids`` (needs ``dataset_size``): epoch ``id // size`` visits the dataset in an
        order of its own, seeded by ``seed`` and the epoch."""
        if self.dataset_size is None:
            raise ValueError("StepSamples.indices: pass dataset_size= to map ids onto a dataset")
        out = torch.empty_like(ids)
        for epoch in torch.unique(ids // self.dataset_size).tolist():
            mask = ids // self.dataset_size == epoch
            out[mask] = torch.from_numpy(self._order(int(epoch))[(ids[mask] % self.dataset_size).numpy()])
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size or 0))
        return self._epoch[1]

    def weight(self, step: int) -> float:
        """Samples this group trains at ``step`` (the weight of its gradients across groups)."""
        return float(len(self._share(step)))

    def rank_samples(self, step: int) -> int:
        """Samples this rank trains at ``step`` (the layer scales a per-rank mean loss by it)."""
        return len(self._share(step)[self.rank::self._ranks_of(self.group)])

    def commit(self, commit: Commit) -> Accounted:
        """``commit.step`` is committed: its ids of groups that trained are done, the others carried.  Returns
        the ids the step trained (every group's) and this group's count of them."""
        plan = self.plan(commit.step)
        for step in [s for s in self._plans if s <= commit.step]:
            del self._plans[step]
        self.last_trained = sorted(i for g, ids in plan.items() if g in commit.trained for i in ids)
        self.carry = sorted(i for g, ids in plan.items() if g not in commit.trained for i in ids)
        self.ready = sorted(commit.ready | commit.joining)  # a waiting joiner trains the next step
        self.sizes = {g: n for g, n in {**self.sizes, **commit.sizes}.items() if n != self.ranks}
        return Accounted(np.asarray(self.last_trained, dtype=np.int64),
                         len(plan.get(self.group, [])) if self.group in commit.trained else 0)

    def state_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "carry": self.carry, "sizes": [[g, n] for g, n in sorted(self.sizes.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ready, self.carry, self._plans = list(state["ready"]), list(state["carry"]), {}
        self.sizes = {int(g): int(n) for g, n in state.get("sizes", [])}
