"""Fail-slow across replica groups: every group judges the whole job's speeds at the same committed step.

``freescale.rank_speed`` measures each rank and judges one process group's table.  Under fault tolerance
every replica group plans every step over every ready group's ranks (``freescale.step_feed``), so a
verdict that changes a plan must be the same in every group, at the same step, and a group that is
catching up must reach it too.  The table travels with the steps themselves:

1. at a check (``gather``, after commit ``c``: ``done = c + 1`` is a multiple of ``check_every``) each
   group all-gathers its ranks' rows in the group (``rank_speed``'s all-gather);
2. the next step's cross-group reduction carries them: ``header`` is this group's table as
   non-negative integers (float32 bit patterns, host names as bytes), a *side header* beside the
   sample weight (``freescale.ft.ftar.ReplicaSync.side_header``), so no collective of its own;
3. when that step ``c + 1`` commits, every group reads every participant's header (``on_commit``:
   the fault-tolerance layer calls it after the data side's commit, for replayed steps too) and judges
   the same table: ranks of groups that did not gather at ``c + 1`` (catching up, gone) are unknown.
   With ``rebalance`` the loader plans the new capacities from the first window after its position,
   which is the same in every group at the same commit (the step feed plans a fixed depth ahead of
   each commit).

A replica group that catches up loads the verdicts' state and the capacities in force from its
source's snapshot (``state_dict``) and replays the commits after it, verdicts included, so it plans
exactly what the others plan.  With ``evict`` the group holding a flagged rank stops at that commit
(``evicted``: the trainer raises it once the step is logged; every group reaches the same verdict, only
that one stops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from freescale.rank_speed import HOST_BYTES, FailSlowEvicted, RankSpeed, SpeedCheck, SpeedTable

if TYPE_CHECKING:
    from freescale.dataloader.loader import BalancedLoader
    from freescale.step_types import Commit

_NUMBERS = 4
"""Speed, best speed, busy seconds, wall seconds: each rank's row, as float32 bit patterns."""
_HOST_WORDS = HOST_BYTES // 4
"""A host name's bytes, four to an integer (the header carries integers below 2**40)."""


class SpeedShare:
    """One rank's side of the job-wide speed check under fault tolerance (module docstring)."""

    name = "rank_speeds"

    def __init__(self, speed: RankSpeed, loader: BalancedLoader, group: int, group_size: int) -> None:
        self.speed, self.loader, self.group, self.group_size = speed, loader, group, group_size
        self._pending: tuple[int, SpeedTable] | None = None
        """The group's table gathered after the last committed step (``done``, table), for the next header."""
        self.checks: list[SpeedCheck] = []
        """Verdicts reached since the trainer last took them (a catch-up's replay can reach several)."""
        self.evicted: FailSlowEvicted | None = None
        """Set at the commit whose verdict evicts this group: the trainer raises it once the step is logged."""
        self._flagged: dict[int, dict[str, Any]] = {}
        """The job's fail-slow ranks (global rank -> what the lighthouse's status shows of it)."""

    @property
    def size(self) -> int:
        """The side header's length (the same on every participant: every group has ``group_size`` ranks)."""
        return 1 + self.group_size * (_NUMBERS + _HOST_WORDS)

    def gather(self, done: int) -> None:
        """Collective over this group (at ``speed.due(done)``, every rank): its ranks' rows, for the next header."""
        self._pending = (done, self.speed.gather())

    def header(self) -> torch.Tensor:
        """This step's side header: ``done + 1`` of the table gathered for it and the table, or zeros."""
        out = torch.zeros(self.size, dtype=torch.int64)
        if self._pending is None:
            return out
        done, table = self._pending
        self._pending = None
        numbers = np.stack([table.speeds, table.bests, table.busies, table.walls], axis=1).astype(np.float32)
        hosts = np.zeros((self.group_size, HOST_BYTES), dtype=np.uint8)
        for r, host in enumerate(table.hosts):
            raw = host.encode()[:HOST_BYTES]
            hosts[r, :len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        words = np.concatenate([numbers.view(np.uint32), hosts.view(np.uint32)], axis=1).astype(np.int64)
        out[0] = done + 1
        out[1:] = torch.from_numpy(words.reshape(-1))
        return out

    def on_commit(self, commit: Commit, headers: dict[int, torch.Tensor]) -> None:
        """``commit.step`` committed (or was replayed) with every participant's side header (group index ->
        header): at a check's step, judge the job's table; plan with new capacities; evict this group."""
        step = commit.step
        if step == 0 or step % self.speed.cfg.check_every:
            return
        check = self.speed.judge(step, self._table(step, headers))
        if check.replan:
            self.loader.set_capacities(check.capacities)
        self.checks.append(check)
        self._note(check)
        mine = range(self.group * self.group_size, (self.group + 1) * self.group_size)
        if self.speed.evict and any(rank in mine for rank in check.flagged):
            self.evicted = FailSlowEvicted(
                f"replica group {self.group} evicted as fail-slow at step {step} (balance.slow_policy = 'evict'): it "
                "stops as a crash would, and restarts while --max-restarts allows")

    def _note(self, check: SpeedCheck) -> None:
        """Keep the fail-slow ranks for the lighthouse: flagged ones in, recovered ones out (evicted ones stay
        until the next check: their group is gone, then judged anew)."""
        for rank in [*check.recovered, *(r for r in self._flagged if r not in self.speed.slow)]:
            self._flagged.pop(rank, None)
        for rank in check.flagged:
            share = float(check.shares[rank]) if check.shares is not None else float("nan")
            self._flagged[rank] = {"group": rank // self.group_size, "rank": rank % self.group_size, "step": check.step,
                                   "share": round(share, 4) if share == share else 0.0, "host": check.hosts[rank]}

    def notes(self) -> dict[str, Any]:
        """``fail_slow``: the job's fail-slow ranks, for the lighthouse's status."""
        return {"fail_slow": [self._flagged[rank] for rank in sorted(self._flagged)]}

    def _table(self, step: int, headers: dict[int, torch.Tensor]) -> SpeedTable:
        """The job's table (global rank = group x group size + rank) from the headers of groups that gathered
        for ``step``; NaN rows for the others."""
        groups = 1 + max([self.group, *headers])
        numbers = np.full((groups * self.group_size, _NUMBERS), np.nan)
        hosts = [""] * (groups * self.group_size)
        for group, header in sorted(headers.items()):
            values = header.numpy()
            if group < 0 or values.size != self.size or int(values[0]) != step + 1:
                continue
            words = values[1:].reshape(self.group_size, _NUMBERS + _HOST_WORDS).astype(np.uint32)
            rows = slice(group * self.group_size, (group + 1) * self.group_size)
            numbers[rows] = words[:, :_NUMBERS].view(np.float32).astype(np.float64)
            for r, raw in enumerate(words[:, _NUMBERS:]):
                hosts[rows.start + r] = raw.tobytes().rstrip(b"\0").decode(errors="replace")
        return SpeedTable(numbers[:, 0], numbers[:, 1], numbers[:, 2], numbers[:, 3], hosts)

    def take(self) -> list[SpeedCheck]:
        """The verdicts reached since the last call (the trainer logs and says them)."""
        checks, self.checks = self.checks, []
        return checks

    def state_dict(self) -> dict[str, Any]:
        """The verdicts' state and the capacities in force (a catching-up group plans from them)."""
        capacities = self.loader.planner.capacities
        return {"verdicts": self.speed.state_dict(), "flagged": [[r, e] for r, e in sorted(self._flagged.items())],
                "capacities": None if capacities is None else [[r, c] for r, c in sorted(capacities.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the data side's state (the loader at the snapshot's position): the same verdicts and plans."""
        self.speed.load_state_dict(state["verdicts"])
        capacities = state["capacities"]
        self.loader.set_capacities(None if capacities is None else {int(r): float(c) for r, c in capacities})
        self._pending, self.checks = None, []
        self._flagged = {int(rank): dict(entry) for rank, entry in state["flagged"]}


__all__ = ["SpeedShare"]
