"""Fail-slow across replica groups: every group judges the whole job's speeds at the same committed step.

``freescale.rank_speed`` measures each rank and judges one process group's table.  Under fault tolerance
every replica group plans every step over every ready group's ranks (``freescale.step_feed``), so a
verdict that changes a plan must be the same in every group, at the same step, and a group that is
catching up must reach it too.  The table travels with the steps themselves:

1. at a check (after commit ``c``: ``done = c + 1`` is due, ``RankSpeed.due``) each group asks
   for its ranks' rows in the group (``rank_speed``'s asynchronous all-gather, ``RankSpeed.ask``), and
   after the next commit ``c + 1`` reads them (``collect``: in by then, so no step waits for them);
2. the next step's cross-group reduction carries them: ``header`` is this group's table as
   non-negative integers (float32 bit patterns, host names as bytes), a *side header* beside the
   sample weight (``freescale.ft.ftar.ReplicaSync.side_header``), so no collective of its own.  It
   holds the ``TOLD_RANKS`` slowest ranks' rows and the median row of the others, so its size does
   not grow with the group's (in a group that small or smaller, every rank's row);
3. when that step ``c + 2`` commits, every group reads every participant's header (``on_commit``:
   the fault-tolerance layer calls it after the data side's commit, for replayed steps too) and judges
   the same table: ranks of groups that did not gather for ``c + 2`` (catching up, gone) are unknown.
   With ``rebalance`` the loader plans the new capacities from the first window after its position,
   which is the same in every group at the same commit (the step feed plans a fixed depth ahead of
   each commit).

A replica group that catches up loads the verdicts' state and the capacities in force from its
source's snapshot (``state_dict``) and replays the commits after it, verdicts included, so it plans
exactly what the others plan.  With ``evict`` the group holding a flagged rank stops at that commit
(``evicted``: the trainer raises it once the step is logged; every group reaches the same verdict, only
that one stops), unless no other group holds valid state (then it is kept, and said so).
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
_ROW = 1 + _NUMBERS + _HOST_WORDS
"""A reported rank's words: its rank in the group, its numbers, its host."""
TOLD_RANKS = 16
"""A group tells its this many slowest ranks' rows (all of them in a group this small or smaller) and the median
of the others: the header stays the same size whatever the group's (the slow ranks are what is judged)."""
NOTED = 64
"""The lighthouse's status shows at most this many fail-slow ranks (the slowest): a heartbeat stays small."""


def _words(values: np.ndarray) -> np.ndarray:
    """float values -> their float32 bit patterns as non-negative int64 (NaN stays NaN through the trip)."""
    return values.astype(np.float32).view(np.uint32).astype(np.int64)


def _floats(words: np.ndarray) -> np.ndarray:
    return words.astype(np.uint32).view(np.float32).astype(np.float64)


class SpeedShare:
    """One rank's side of the job-wide speed check under fault tolerance (module docstring)."""

    name = "rank_speeds"

    def __init__(self, speed: RankSpeed, loader: BalancedLoader, group: int, group_size: int) -> None:
        self.speed, self.loader, self.group, self.group_size = speed, loader, group, group_size
        self._pending: tuple[int, SpeedTable] | None = None
        """The group's table asked at a check (its ``done``, table), read after the next commit, for the next
        header."""
        self.checks: list[SpeedCheck] = []
        """Verdicts reached since the trainer last took them (a catch-up's replay can reach several)."""
        self.evicted: FailSlowEvicted | None = None
        """Set at the commit whose verdict evicts this group: the trainer raises it once the step is logged."""
        self._flagged: dict[int, dict[str, Any]] = {}
        """The job's fail-slow ranks (global rank -> what the lighthouse's status shows of it)."""

    @property
    def told(self) -> int:
        """Ranks whose rows a header carries."""
        return min(self.group_size, TOLD_RANKS)

    @property
    def size(self) -> int:
        """The side header's length (the same on every participant): the commit that judges it plus one, the
        others' median row, the told ranks' rows."""
        return 1 + _NUMBERS + self.told * _ROW

    def collect(self) -> None:
        """After every committed step, on every rank of the group: the rows asked a step before (``RankSpeed.ask``
        at a check's ``done``; waits for that all-gather), if any, for the next header."""
        answered = self.speed.answer()
        if answered is not None:
            self._pending = answered

    def header(self) -> torch.Tensor:
        """This step's side header: ``done + 2`` of the table asked at ``done``, the median row of the ranks not
        told, and the slowest ranks' rows (rank in the group, numbers, host); zeros when nothing was gathered."""
        out = np.zeros(self.size, dtype=np.int64)
        if self._pending is None:
            return torch.from_numpy(out)
        done, table = self._pending
        self._pending = None
        numbers = np.stack([table.speeds, table.bests, table.busies, table.walls], axis=1)
        order = np.argsort(np.nan_to_num(table.speeds, nan=-np.inf), kind="stable")  # unmeasured first, then slowest
        told, others = order[:self.told], order[self.told:]
        if told.size < self.told:  # a group on fewer ranks than its own: its last told row repeats (same values)
            told = np.concatenate([told, np.full(self.told - told.size, told[-1])])
        out[0] = done + 2  # the commit that judges it, plus one (never 0: a header with nothing told)
        out[1:1 + _NUMBERS] = _words(np.median(numbers[others], axis=0) if others.size else np.full(_NUMBERS, np.nan))
        rows = out[1 + _NUMBERS:].reshape(self.told, _ROW)
        rows[:, 0] = told
        rows[:, 1:1 + _NUMBERS] = _words(numbers[told])
        for row, rank in zip(rows, told):
            raw = np.zeros(HOST_BYTES, dtype=np.uint8)
            host = table.hosts[rank].encode()[:HOST_BYTES]
            raw[:len(host)] = np.frombuffer(host, dtype=np.uint8)
            row[1 + _NUMBERS:] = raw.view(np.uint32).astype(np.int64)
        return torch.from_numpy(out)

    def on_commit(self, commit: Commit, headers: dict[int, torch.Tensor]) -> None:
        """``commit.step`` committed (or was replayed) with every participant's side header (group index ->
        header): at a check's step, judge the job's table; plan with new capacities; evict this group."""
        step = commit.step
        if step < 1 or not self.speed.due(step - 1):  # (asked at ``done = step - 1``)
            return
        check = self.speed.judge(step, self._table(step, headers))
        if check.replan:
            self.loader.set_capacities(check.capacities)
        self.checks.append(check)
        self._note(check)
        if self.speed.evict:
            self._evict(check, commit)

    def _evict(self, check: SpeedCheck, commit: Commit) -> None:
        """``evict``: the groups holding a flagged rank stop, unless that would leave no group holding valid state
        (then they are kept, and said so: ``kept``).  Every group decides alike from the same verdict."""
        slow_groups = sorted({rank // self.group_size for rank in check.flagged})
        kept = bool(slow_groups) and not set(commit.ready) - set(slow_groups)
        check.kept_groups = slow_groups if kept else []
        for group in slow_groups:
            for rank in range(group * self.group_size, (group + 1) * self.group_size):
                if kept and rank in check.flagged:
                    self.speed.slow[rank] = (check.step, 1.0)  # reported, as with 'report': said once
                elif not kept:
                    self.speed.forget(rank)  # judged anew when back: no earlier check counts against it
        if self.group in slow_groups and not kept:
            self.evicted = FailSlowEvicted(
                f"replica group {self.group} evicted as fail-slow at step {check.step} (balance.slow_policy = 'evict'): "
                "it stops as a crash would, and restarts while --max-restarts allows")

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
        """``fail_slow``: the job's fail-slow ranks (the ``NOTED`` slowest), for the lighthouse's status."""
        slowest = sorted(self._flagged, key=lambda rank: (self._flagged[rank]["share"], rank))[:NOTED]
        return {"fail_slow": [self._flagged[rank] for rank in sorted(slowest)]}

    def _table(self, step: int, headers: dict[int, torch.Tensor]) -> SpeedTable:
        """The job's table (global rank = group x group size + rank) from the headers of groups that gathered
        for ``step``: the told ranks' rows, the group's median row for its other ranks; NaN rows for groups that
        did not gather (catching up, gone)."""
        groups = 1 + max([self.group, *headers])
        numbers = np.full((groups * self.group_size, _NUMBERS), np.nan)
        hosts = [""] * (groups * self.group_size)
        for group, header in sorted(headers.items()):
            values = header.numpy()
            if group < 0 or values.size != self.size or int(values[0]) != step + 1:
                continue
            first = group * self.group_size
            numbers[first:first + self.group_size] = _floats(values[1:1 + _NUMBERS])
            for row in values[1 + _NUMBERS:].reshape(self.told, _ROW):
                rank = first + int(row[0])
                numbers[rank] = _floats(row[1:1 + _NUMBERS])
                hosts[rank] = row[1 + _NUMBERS:].astype(np.uint32).tobytes().rstrip(b"\0").decode(errors="replace")
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
