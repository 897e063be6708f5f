"""Each rank's speed, measured online from the step's own timing; fail-slow ranks found and planned around.

A rank's **speed** is the planned cost it trained per second of its own work: the loader's cost of its
share (``StepInfo.rank_cost``) over the step's busy time: the training thread's CPU time
(``StepOutcome.busy_s``, where time blocked in a collective is not in it) plus its wait for the step's
batch (``StepInfo.wait_s``: a rank whose data loading falls behind is slow too, and a smaller share
reads faster).  On CUDA the busy time would have to come from events: not built, so on CUDA the check
is off.  One step's speed is noisy (a cache miss, a page
fault, the first step's lazy set-up); the estimate is the **median** over the last ``speed_window`` steps,
so one noisy step does not move it.

Every ``check_every`` steps the ranks exchange their estimates (one all-gather of a few numbers and the
host name) and each computes the same verdict from the same numbers.  The all-gather is asked after one
step's commit and read at the next one's (``ask``, ``answer``: asynchronous, on a gloo group beside the
training's that the saves' busy poll shares, ``freescale.distributed.side_group``), so the training thread
never waits for it: asked and read at the same step, it waited for the slowest rank to reach it and for a
round trip, about 12% of that step on the 2-core CPU machine this project is measured on.  The verdict is a
step later for it, which changes nothing it is for (a rank slow over ``speed_window`` steps):

- **scores**, in the terms of NVIDIA's resiliency extension (so its users read them the same way): each
  rank's speed relative to the fastest rank (``relative``), and to its own best estimate so far
  (``individual``);
- **fail-slow**: a rank whose estimate is below ``slow_threshold`` of the median healthy rank's is flagged
  (one console line and one ``fail_slow`` log event naming its host, rank, speed and the step); it recovers
  (``fail_slow_recovered``) once back above half-way between the threshold and the median;
- **policy** (``slow_policy``): ``rebalance`` plans a fail-slow rank at a **capacity** below 1 from the next
  planning window on (``BalancedLoader.set_capacities``: its share of each step's cost shrinks in
  proportion), starting at its measured share of the median speed and then corrected at every check by
  the ratio of the healthy ranks' median busy time to its own, so the ranks' busy times meet: a step's
  time holds a part that does not shrink with the share (the rank's fixed work per step), which a speed
  ratio alone would miss, and a speed measured on a smaller share reads lower by it (planning by that
  would starve the rank step after step).  Every change is a trial against the fastest plan measured
  since the flag (at first, letting the slow rank set the pace): when its steps are slower than that
  plan's (the busy time is the training thread's: other threads' work, the loader's and the
  communication's, is not in it), that plan comes back and the capacities stay.  It recovers when its
  capacity is back near 1.  ``evict`` (replica groups only) hands the group holding a fail-slow rank to
  restart as a crash would (``FailSlowEvicted``): it catches up from a peer and is judged anew.
  ``report`` only says so; ``off`` measures nothing.  Healthy ranks stay at 1.0, so their noise never
  changes a plan.

With replica groups every group must plan the same steps alike: each group gathers its ranks' rows (asked
after one commit, read after the next), tells the others in the header of the step after that one's
cross-group reduction, and every group judges the whole job's table at that step's commit
(``freescale.speed_share``): a slow group is a group of slow ranks, planned at a smaller share of the global
batch.
"""

from __future__ import annotations

import platform
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from freescale.config import require

SLOW_POLICIES = ("rebalance", "evict", "report", "off")
HOST_BYTES = 32
_SCORED_RANKS = 16
"""Step records carry every rank's speed scores up to this many ranks; past it, the slowest ranks' only."""
_DEAD_BAND = 0.05
"""A capacity correction smaller than this share is not worth a replan (each drops the prefetched batches)."""
_NOISE = 0.03
"""A capacity change whose steps are slower than before it by more than this share is undone."""
_MIN_CAPACITY = 0.02
"""A fail-slow rank is never planned below this share of a healthy rank's cost (it still joins every step)."""


@dataclass
class BalanceConfig:
    slow_policy: str = "report"
    """``rebalance``: plan a fail-slow rank at its measured speed; ``evict`` (replica groups): restart its group
    as a crash would; ``report``: only say so; ``off``: no check."""
    slow_threshold: float = 0.7
    """A rank whose speed is below this share of the others' median, at two checks in a row, is fail-slow.  0.7:
    on the 2-core VM this project is measured on, a healthy rank's estimate dipped to 0.73 of the other's
    over 1,000 steps (``benchmarks/bench_stragglers.py``), and a rank 1.5 times slower reads about 0.6.  Where the
    ranks share cores with more busy processes than there are cores, lower it: two replica groups of one rank on
    those 2 cores beside three busy processes read as low as 0.62 of each other for two checks in a row (one process
    ran the same steps 1.6 times faster than the other for ~15 steps, as the shared cores' speed met each)."""
    speed_window: int = 10
    """Steps in each rank's speed estimate (their median)."""
    check_every: int = 5
    """Steps between two checks (each an all-gather of a few numbers), asked after steps 2, 7, 12, ... at 5
    (``RankSpeed.due``)."""

    def validate(self) -> None:
        require(self.slow_policy in SLOW_POLICIES, "slow_policy",
                f"must be one of {list(SLOW_POLICIES)}, got '{self.slow_policy}'")
        require(0.0 < self.slow_threshold < 1.0, "slow_threshold", f"must be in (0, 1), got {self.slow_threshold}")
        require(self.speed_window >= 3, "speed_window", f"must be >= 3, got {self.speed_window}")
        require(self.check_every >= 1, "check_every", f"must be >= 1, got {self.check_every}")


class FailSlowEvicted(RuntimeError):
    """This replica group holds a fail-slow rank and ``balance.slow_policy`` is ``evict``: it stops as a crash would
    (its launcher restarts it; it catches up from a peer)."""


@dataclass
class SpeedTable:
    """Every rank's measurement at one check, in rank order (NaN: not measured)."""

    speeds: np.ndarray
    bests: np.ndarray
    busies: np.ndarray
    walls: np.ndarray
    hosts: list[str]


@dataclass
class SpeedCheck:
    """One check's verdict (the same on every rank)."""

    step: int
    speeds: np.ndarray
    """Each rank's speed estimate (planned cost per busy second; NaN: too few steps measured yet)."""
    relative: np.ndarray
    """Each rank's speed over the fastest rank's (NVRx's relative score)."""
    individual: np.ndarray
    """Each rank's speed over its own best estimate so far (NVRx's individual score)."""
    hosts: list[str]
    shares: np.ndarray | None = None
    """Each rank's speed over the median healthy rank's (what fail-slow is judged on)."""
    flagged: list[int] = field(default_factory=list)
    """Ranks that turned fail-slow at this check."""
    recovered: list[int] = field(default_factory=list)
    replan: bool = False
    """With ``rebalance``: plan with ``capacities`` from the next window on (while any rank is fail-slow, at
    every check: its speed is measured anew)."""
    capacities: dict[int, float] | None = None
    """The fail-slow ranks' speeds, as shares of the median rank's (None: every rank alike)."""
    kept_groups: list[int] = field(default_factory=list)
    """``evict``: replica groups holding a flagged rank that were not evicted (no other group held valid state)."""

    def scores(self) -> dict[str, Any]:
        """The step record's speed fields: per rank (``speed``, ``speed_relative``, ``speed_individual``), or in
        a large group the ``_SCORED_RANKS`` slowest ranks' as ``[rank, speed, relative, individual]`` rows; and
        the capacities planned with, when this check changed them."""
        columns = (self.speeds, self.relative, self.individual)
        if self.speeds.size <= _SCORED_RANKS:
            out: dict[str, Any] = {name: [round(float(v), 4) for v in values]
                                   for name, values in zip(("speed", "speed_relative", "speed_individual"), columns)}
        else:
            slowest = np.argsort(np.nan_to_num(self.relative, nan=np.inf), kind="stable")[:_SCORED_RANKS]
            out = {"speed_slowest": [[int(r), *(round(float(values[r]), 4) for values in columns)] for r in slowest]}
        if self.replan:
            out["capacities"] = {str(r): round(c, 4) for r, c in (self.capacities or {}).items()}
        return out

    def announce(self, write: Callable[..., None], policy: str, group_size: int | None = None) -> list[str]:
        """Write a ``fail_slow`` / ``fail_slow_recovered`` event per rank that changed (``write(event, **fields)``);
        the console lines that say so.  ``group_size``: the table is the whole job's, rank ``r`` being rank
        ``r % group_size`` of replica group ``r // group_size``; without it, one group's (group 0)."""
        lines = []
        size = group_size or self.speeds.size
        for rank in self.flagged:
            share = float(self.shares[rank]) if self.shares is not None else float("nan")
            where = dict(rank=rank % size, group=rank // size, host=self.hosts[rank])
            write("fail_slow", step=self.step, **where, share=share, speed=float(self.speeds[rank]), policy=policy)
            lines.append(f"freescale: {_name(rank, group_size)} on {self.hosts[rank]} is fail-slow at step "
                         f"{self.step}: {share:.2f} of the median rank's speed; " + _POLICY_SAYS[policy])
        for group in self.kept_groups:
            write("fail_slow_kept", step=self.step, group=group)
            lines.append(f"freescale: replica group {group} is fail-slow but no other group holds the run's state: "
                         f"kept, not evicted (step {self.step})")
        for rank in self.recovered:
            write("fail_slow_recovered", step=self.step, rank=rank % size, group=rank // size, host=self.hosts[rank],
                  speed=float(self.speeds[rank]))
            lines.append(f"freescale: {_name(rank, group_size)} on {self.hosts[rank]} is back to speed at step "
                         f"{self.step}")
        return lines


_POLICY_SAYS = {"rebalance": "planned at a smaller share from the next window",
                "evict": "its replica group is restarted (balance.slow_policy = 'evict')",
                "report": "reported only (balance.slow_policy = 'report')"}


def _name(rank: int, group_size: int | None) -> str:
    return f"replica group {rank // group_size}, rank {rank % group_size}" if group_size else f"rank {rank}"


class RankSpeed:
    """This rank's speed estimate and the group's fail-slow verdicts (module docstring)."""

    def __init__(self, cfg: BalanceConfig, plan_lag: int = 0, group: dist.ProcessGroup | None = None) -> None:
        self.cfg, self.plan_lag = cfg, plan_lag
        """``plan_lag``: steps already planned when capacities change (the pipeline's read-ahead and the
        planning window): they are trained on the old plan, and not measured as the new one's."""
        self.group = group
        """The process group's side group the rows are gathered on (None: this rank alone)."""
        self._asked: tuple[int, _Gathering] | None = None
        self.rebalance, self.evict = cfg.slow_policy == "rebalance", cfg.slow_policy == "evict"
        self._from_step = 0
        """Steps before this one were planned with other capacities: not in the estimate."""
        self._below: dict[int, int] = {}
        """Consecutive checks each healthy rank was below the threshold (two flag it: one noisy window does not)."""
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=cfg.speed_window)
        """(planned cost, busy seconds, wall seconds) of this rank's last trained steps."""
        self._best = 0.0
        self.slow: dict[int, tuple[int, float]] = {}
        """Fail-slow ranks: rank -> (the step it was flagged at, its capacity: 1.0 unless rebalanced)."""
        self._baseline: tuple[dict[int, float], float] | None = None
        """The capacities whose steps were the fastest since a rank's state last changed, and their step time (at a
        flag: the slow rank setting the pace).  A plan slower than it is replaced by it: corrections that each
        look no worse than the last never add up to a slower job."""
        self._settled = False
        """A change made steps slower and was undone: the capacities stay until a rank's state changes."""
        host = platform.node().encode()[:HOST_BYTES]
        self._host = torch.zeros(HOST_BYTES, dtype=torch.float64)
        """This host's name as a row's last numbers (made once: every check sends it)."""
        self._host[:len(host)] = torch.tensor(list(host), dtype=torch.float64)

    def add(self, step: int, cost: float, busy_s: float, wall_s: float) -> None:
        """One trained step of this rank: its planned cost, its busy seconds and the step's wall seconds."""
        if busy_s > 0.0 and cost > 0.0 and step >= self._from_step:
            self._steps.append((cost, busy_s, wall_s))

    def due(self, done: int) -> bool:
        """A check is asked after ``done`` steps: half a period past each multiple of ``check_every``, where the
        periodic saves, validations and log records of a run fall: where their periods are multiples of
        ``check_every`` (5 and 10, 100, 1,000 ...), no step pays for two (the ask costs its step ~5% on the 2-core
        CPU machine: the gloo op's launch and its thread beside the training's)."""
        return done % self.cfg.check_every == self.cfg.check_every // 2

    def estimate(self) -> tuple[float, float, float]:
        """(median speed, busy seconds, wall seconds) of the window; NaN until half the window is measured."""
        if len(self._steps) < max(3, self.cfg.speed_window // 2):
            return float("nan"), float("nan"), float("nan")
        steps = np.array(self._steps, dtype=np.float64)
        return float(np.median(steps[:, 0] / steps[:, 1])), float(np.median(steps[:, 1])), float(np.median(steps[:, 2]))

    def row(self) -> tuple[float, float, float, float]:
        """This rank's (speed, best speed so far, busy seconds, wall seconds) for a check (NaN: too few steps)."""
        speed, busy, wall = self.estimate()
        if speed == speed and not self.slow:
            self._best = max(self._best, speed)
        return speed, self._best, busy, wall

    def ask(self, done: int) -> None:
        """Collective over the process group's ranks (on its side group), every rank at the same step (``due``):
        this rank's row to every rank, asynchronously; ``answer`` reads the table (module docstring)."""
        self._asked = (done, _Gathering(*self.row(), self._host, self.group))

    def answer(self) -> tuple[int, SpeedTable] | None:
        """The table asked for by the last ``ask`` and the ``done`` it was asked at, or None if nothing is asked
        (waits for the all-gather: asked a step before, it is in by now)."""
        asked, self._asked = self._asked, None
        return None if asked is None else (asked[0], asked[1].table())

    def judge(self, done: int, table: SpeedTable) -> SpeedCheck:
        """The verdict on every rank's measurement (the same on every rank that judges the same table)."""
        speeds, bests, busies, walls, hosts = table.speeds, table.bests, table.busies, table.walls, table.hosts
        known = np.isfinite(speeds) & (speeds > 0) & np.isfinite(busies)
        relative = np.full(speeds.size, np.nan)
        individual = np.full(speeds.size, np.nan)
        check = SpeedCheck(done, speeds, relative, individual, hosts)
        if not known.any():
            return check
        relative[known] = speeds[known] / speeds[known].max()
        measured_best = known & (bests > 0)  # a rank never measured healthy has no best of its own yet: NaN
        individual[measured_best] = speeds[measured_best] / np.maximum(bests[measured_best], speeds[measured_best])
        healthy = known & ~np.isin(np.arange(speeds.size), list(self.slow))
        reference = healthy if healthy.any() else known
        share = check.shares = _shares(speeds, known, reference)
        before = {rank: capacity for rank, (_, capacity) in self.slow.items()}
        self._judge(done, known, share, busies, float(np.median(busies[reference])), check)
        if self.rebalance:
            self._keep_or_undo(before, float(np.median(walls[known])), check)
        return check

    def _judge(self, done: int, known: np.ndarray, share: np.ndarray, busies: np.ndarray, pace: float,
               check: SpeedCheck) -> None:
        """Flag and recover ranks; with ``rebalance``, correct each slow rank's capacity by the ratio of the
        healthy ranks' median busy time (``pace``) to its own (the share that makes them meet)."""
        back = self.cfg.slow_threshold + (1.0 - self.cfg.slow_threshold) / 2
        for rank in np.flatnonzero(known).tolist():
            if rank not in self.slow:
                self._below[rank] = self._below.get(rank, 0) + 1 if share[rank] < self.cfg.slow_threshold else 0
                if self._below[rank] >= 2:
                    del self._below[rank]
                    check.flagged.append(rank)
                    if self.evict:
                        continue  # its group restarts: judged anew when it is back
                    capacity = max(float(share[rank]), _MIN_CAPACITY) if self.rebalance else 1.0
                    self.slow[rank] = (done, capacity)
                    self._settled = False
                continue
            since, capacity = self.slow[rank]
            if self.rebalance:
                corrected = float(np.clip(capacity * pace / busies[rank], _MIN_CAPACITY, 1.0))
                if not self._settled or corrected > capacity * 1.05:  # settled: only a rank that sped up moves
                    self._settled = self._settled and corrected <= capacity * 1.05
                    capacity = corrected
                    self.slow[rank] = (since, capacity)
            if (capacity if capacity < 1.0 else share[rank]) >= back:  # planned smaller: judged by its capacity
                del self.slow[rank]
                check.recovered.append(rank)

    def _keep_or_undo(self, before: dict[int, float], wall: float, check: SpeedCheck) -> None:
        """Replan when the capacities changed.  ``wall`` was measured on the steps planned with ``before``: the
        fastest plan since a rank's state last changed is the baseline (at a flag, letting the slow rank set the
        pace), and a plan slower than it by more than ``_NOISE`` is replaced by it; the capacities then stay
        (``_settled``).  So planning around a slow rank never makes the job slower than letting it set the pace
        (a step's time holds more than the busy time measured here: other threads, fixed work per step)."""
        if check.flagged or check.recovered:
            self._baseline = None
        if wall == wall:
            if self._baseline is None or wall < self._baseline[1]:
                self._baseline = (dict(before), wall)
            elif wall > self._baseline[1] * (1.0 + _NOISE) and before != self._baseline[0]:
                kept = self._baseline[0]
                self.slow = {rank: (since, kept.get(rank, 1.0)) for rank, (since, _) in self.slow.items()}
                self._settled = True
        after = {rank: capacity for rank, (_, capacity) in self.slow.items()}
        moved = any(abs(after.get(rank, 1.0) / before.get(rank, 1.0) - 1.0) > _DEAD_BAND for rank in after)
        if moved or check.flagged or check.recovered or set(after) != set(before):
            check.replan = True
            check.capacities = {rank: capacity for rank, capacity in sorted(after.items()) if capacity < 1.0} or None
            self._steps.clear()  # what comes next is measured on the new plan, from the first step planned with it
            self._from_step = check.step + 1 + self.plan_lag
        else:  # a correction too small to replan for: the plan stays as it is
            self.slow = {rank: (since, before.get(rank, capacity)) for rank, (since, capacity) in self.slow.items()}

    def forget(self, rank: int) -> None:
        """``rank`` is judged anew: no check below the threshold counts against it, and it is not fail-slow."""
        self._below.pop(rank, None)
        self.slow.pop(rank, None)

    def state_dict(self) -> dict[str, Any]:
        """The verdicts' state (JSON): what every rank that judges the same tables holds alike (a replica group that
        catches up loads it from a peer's snapshot).  This rank's own measurements are not in it."""
        base = None if self._baseline is None else [[[r, c] for r, c in self._baseline[0].items()], self._baseline[1]]
        return {"slow": [[rank, since, capacity] for rank, (since, capacity) in self.slow.items()],
                "below": [[rank, n] for rank, n in self._below.items()], "baseline": base, "settled": self._settled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.answer()  # a check asked before the state was replaced (every rank of the group asked it): dropped
        self.slow = {int(rank): (int(since), float(capacity)) for rank, since, capacity in state["slow"]}
        self._below = {int(rank): int(n) for rank, n in state["below"]}
        base = state["baseline"]
        self._baseline = None if base is None else ({int(r): float(c) for r, c in base[0]}, float(base[1]))
        self._settled = bool(state["settled"])
        self._steps.clear()


def _shares(speeds: np.ndarray, known: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Each rank's speed over the median of the reference ranks' speeds, the rank itself left out (in a group
    of two the other rank is the reference; past 64 ranks one rank moves the median by nothing that matters)."""
    if speeds.size > 64:
        return np.where(known, speeds / float(np.median(speeds[reference])), 1.0)
    shares = np.ones(speeds.size)
    for rank in np.flatnonzero(known).tolist():
        others = reference.copy()
        others[rank] = False
        if not others.any():
            others = known.copy()
            others[rank] = False
        if others.any():
            shares[rank] = speeds[rank] / float(np.median(speeds[others]))
    return shares


class _Gathering:
    """One asynchronous all-gather of every rank's (speed, best, busy, wall, host) on ``group`` (None: this rank
    alone), read in rank order by ``table``."""

    def __init__(self, speed: float, best: float, busy: float, wall: float, host: torch.Tensor,
                 group: dist.ProcessGroup | None) -> None:
        row = torch.cat([torch.tensor([speed, best, busy, wall], dtype=torch.float64), host])
        self.rows, self.work = [row], None
        if group is not None:
            self.rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
            self.work = dist.all_gather(self.rows, row, group=group, async_op=True)

    def table(self) -> SpeedTable:
        if self.work is not None:
            self.work.wait()
        table = torch.stack(self.rows).numpy()
        hosts = [bytes(int(b) for b in r[4:] if b).decode(errors="replace") for r in table]
        return SpeedTable(table[:, 0], table[:, 1], table[:, 2], table[:, 3], hosts)


__all__ = ["BalanceConfig", "FailSlowEvicted", "RankSpeed", "SpeedCheck", "SpeedTable"]
