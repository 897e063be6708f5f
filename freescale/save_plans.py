"""A background writer's DCP save plans, made at its first save and reused by the ones after it.

DCP plans every save afresh: each rank lists its items (``create_local_plan``), rank 0 gathers every rank's
list, pickled, merges and checks them (``create_global_plan``) and scatters each rank its part.  A training's
saves have the same structure every time (the same tables, the same host buffers), so that work is the same
every time, and it is Python holding the GIL on the writer's thread while the training's steps run beside it:
on two busy cores the steps while a save's writer started were ~19 ms slower in all (the median over 21 saves,
a probe of the tiny DLRM's 136 MB saves), against ~10 ms with the plans reused (22 saves).

DCP keeps reusable plans itself (``DefaultSavePlanner(enable_plan_caching=True)``): a rank whose plan did not
change sends an empty one, and rank 0 answers from the plans it kept.  It keeps them in class-wide tables under
a key (the planner's class name by default); ``PlanCache`` gives each writer a key of its own, so two writers
of one process (a second training in a test, a writer over another group) never take each other's plans, and
forgets them when a save fails: a rank that kept its plan while rank 0 lost its own would otherwise send an
empty plan that rank 0 reads as "nothing to write" (``CachingSavePlanner`` refuses that save instead; every rank
sees the failure, forgets, and the next save plans afresh).
"""

from __future__ import annotations

import itertools
from typing import Any

from torch.distributed.checkpoint.planner import SavePlanner

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
        return CachingSavePlanner(pacer, self.key) if self.enabled else PacedSavePlanner(pacer)

    def forget(self) -> None:
        """Drop the plans kept under this writer's key; the next save plans afresh, under a new key."""
        for table in _TABLES:
            getattr(SavePlanner, table, {}).pop(self.key, None)
        self.key = f"freescale-writer-{next(_KEYS)}"


class CachingSavePlanner(PacedSavePlanner):
    """The writer's paced planner (``write_pacing``) with DCP's plan reuse under ``key``."""

    def __init__(self, pacer: Pacer, key: str) -> None:
        super().__init__(pacer, enable_plan_caching=True)
        self._cached_plans_key = key

    def create_global_plan(self, all_plans: Any) -> Any:
        """Rank 0: refuse a save where a rank reused its plan and rank 0 kept none under this key (its items
        would be missing from the checkpoint); DCP raises it on every rank."""
        kept = self._cached_plans_key in SavePlanner._cached_all_plans
        if not kept and any(not plan.usable for plan in all_plans):
            raise ValueError("a rank reused a save plan that rank 0 no longer keeps: the save is refused, "
                             "the next one plans afresh")
        return super().create_global_plan(all_plans)
