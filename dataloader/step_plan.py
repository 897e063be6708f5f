"""``StepPlan``: what the planner decides for one step (``planner.py``), and how balanced that is.

Every rank's ``BatchPlanner`` answers the same ``StepPlan`` for a step; the loader reads this rank's part of it
(``step_reader.py``) and logs its balance (``imbalance``, ``bound``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freescale.dataloader import balance_kernels
from freescale.dataloader.cost import CostModel
from freescale.dataloader.partition import Parts, load_time_imbalance, time_lower_bound


@dataclass
class StepPlan:
    """One step: global row ids and per-sample costs for each live rank (``Parts``: one
    part per entry of ``live_ranks``, in that order).

    ``rows``/``costs`` include the step's carried (requeued) rows; ``carried`` counts
    them over all ranks.  Within a rank, rows are in the partitioner's order (ascending
    when the step carries rows); the source reads them in ascending order.
    """

    epoch: int
    step: int
    live_ranks: tuple[int, ...]
    rows: Parts
    costs: Parts
    model: CostModel
    carried: int = 0
    capacities: np.ndarray | None = None
    """Each live rank's speed the step was planned with (None: all alike)."""

    @property
    def global_size(self) -> int:
        return int(self.rows.index.size)

    def loads(self) -> np.ndarray:
        return self.costs.totals()

    def imbalance(self) -> float:
        """The slowest rank's time over a split in proportion to the ranks' speeds (their costs, all alike)."""
        return self.balance()[0]

    def bound(self) -> float:
        """No split of this step's samples over its ranks does better than this imbalance."""
        return self.balance()[1]

    def balance(self) -> tuple[float, float]:
        """``(imbalance(), bound())``, in one pass when the ranks are alike."""
        if self.capacities is None:
            return balance_kernels.part_balance(np.ascontiguousarray(self.costs.index, dtype=np.float64),
                                                self.costs.offsets)
        return (load_time_imbalance(self.loads(), self.capacities),
                time_lower_bound(self.costs.index, len(self.live_ranks), self.capacities))


__all__ = ["StepPlan"]
