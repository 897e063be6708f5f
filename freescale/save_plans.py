"""A background writer's DCP save plans, made at its first save and reused by the ones after it.

DCP plans every save afresh: each rank lists its items (``create_local_plan``), rank 0 gathers every rank's
list, pickled, merges and checks them (``create_global_plan``) and scatters each rank its part.  A training's
saves have the same structure every time (the same tables, the same host buffers), so that work is the same
every time, on the writer's thread while the training's steps run beside it.  Reused, the writer's start (until
its files begin to be written) took 4.3-5.0 ms of its CPU against 6.0-6.9 ms, and the steps beside it lost 13.0-21.6
ms against 16.7-21.9 ms (medians over ~30 saves a run, three runs of ``benchmarks/bench_saves.py --plans both``,
136 MB of tables, 2 ranks on 2 busy cores).

DCP keeps reusable plans itself (``DefaultSavePlanner(enable_plan_caching=True)``): a rank whose plan did not
change sends an empty one, and rank 0 answers from the plans it kept.  It keeps them in class-wide tables under
a key (the planner's class name by default); ``PlanCache`` gives each writer a key of its own, so two writers
of one process (a second training in a test, a writer over another group) never take each other's plans, and
forgets them when a save fails, on every rank that saw it fail.  Plans out of step fail a save loudly rather than
write a wrong checkpoint: a rank that sends an empty plan to a rank 0 that keeps none under the key is refused by
rank 0 (its items would be missing), a rank told to reuse a plan it no longer keeps refuses on its side; every
rank then sees the failure, forgets, and the next save plans afresh.  DCP's comparison of a plan with the kept one
looks at each item's name, shape and chunks, not its dtype: ``CachingSavePlanner`` sends the whole plan when a
dtype changed too, or ``.metadata`` would keep the old one.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch.distributed.checkpoint.planner import SavePlanner, WriteItemType

from freescale.write_pacing import PacedSavePlanner, Pacer

_KEYS = itertools.count()
_TABLES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
           "_cached_metadata")
"""DCP's class-wide tables of kept plans (``SavePlanner``), each by key."""


class PlanCache:
    """One writer's kept save plans (module docstring): ``planner`` for each save, ``forget`` after a failed
    one (and when the writer is done with them).  ``enabled`` False: every save plans afresh
    (``checkpoint.reuse_plans``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.key = f"freescale-writer-{next(_KEYS)}"

    def planner(self, pacer: Pacer) -> PacedSavePlanner:
        """The planner of one save: reusing this writer's kept plans under its key of the moment."""
        return CachingSavePlanner(pacer, self.key) if self.enabled else PacedSavePlanner(pacer)

    def forget(self, planner: PacedSavePlanner | None = None) -> None:
        """Drop the plans kept under the key ``planner`` used (default: this writer's current key); the next save
        plans afresh, under a new key where the current one was dropped (a late save of an abandoned writer
        refills only its old key).  A planner that kept none (``enabled`` False) leaves everything as it is."""
        if planner is not None and not isinstance(planner, CachingSavePlanner):
            return
        key = self.key if planner is None else planner.key
        for table in _TABLES:
            getattr(SavePlanner, table, {}).pop(key, None)
        if key == self.key:
            self.key = f"freescale-writer-{next(_KEYS)}"


class CachingSavePlanner(PacedSavePlanner):
    """The writer's paced planner (``write_pacing``) with DCP's plan reuse under ``key``."""

    def __init__(self, pacer: Pacer, key: str) -> None:
        super().__init__(pacer, enable_plan_caching=True)
        self.key = self._cached_plans_key = key

    def create_local_plan(self) -> Any:
        """DCP's, but the whole plan sent where an item's dtype (or other tensor property) changed since the kept
        plan, which DCP's comparison does not look at."""
        plan = super().create_local_plan()
        kept = SavePlanner._cached_save_plan.get(self._cached_plans_key)
        if plan.usable or kept is None or _properties(self.plan) == _properties(kept):
            return plan
        SavePlanner._cached_save_plan.pop(self._cached_plans_key, None)
        self._pending_local_plan = self.plan  # (kept once the save's plan is made, as DCP does)
        return self.plan

    def create_global_plan(self, all_plans: Any) -> Any:
        """Rank 0: refuse a save where a rank reused its plan and rank 0 kept none under this key (its items
        would be missing from the checkpoint); DCP raises it on every rank."""
        kept = self._cached_plans_key in SavePlanner._cached_all_plans
        if not kept and any(not plan.usable for plan in all_plans):
            raise ValueError("a rank reused a save plan that rank 0 no longer keeps: the save is refused, "
                             "the next one plans afresh")
        return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan: Any) -> Any:
        """Refuse (on this rank; DCP raises it on every rank) where rank 0 says "as before" and no plan is kept."""
        if not new_plan.usable and self._cached_plans_key not in SavePlanner._cached_final_save_plan:
            raise ValueError("rank 0 reused a save plan this rank no longer keeps: the save is refused, "
                             "the next one plans afresh")
        return super().finish_plan(new_plan)


def _properties(plan: Any) -> list[tuple[str, Any]]:
    """Each tensor item's name and tensor properties (dtype, layout, ...), in the plan's order."""
    return [(item.index.fqn, item.tensor_data.properties) for item in plan.items
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None]
