"""Discrete-event ETTR simulation of one policy over one failure trace.

What is modelled (per replica group, each ``1/R`` of the GPUs):

- **global stalls**: a FIFO of ``(reason, seconds)`` during which no replica commits (a
  detection and quorum rebuild, a whole-job restart, a heal whose source blocks the
  all-reduce).  A failure that arrives during one is queued, ignored or restarts it, by the
  policy's ``recovery`` accounting;
- **replica states**: contributing, restarting (until ``down_until``), catching up (until
  ``catch_until``, non-blocking), and slow episodes (speed, detected at, until);
- **training progress** between events at a constant rate: the contributing replicas'
  share, at the pace the policy allows (everyone at the slowest replica's speed, or a slow
  replica at its own reduced share once detected), less the steady-state overhead, and none
  while a checkpoint is saved (every ``checkpoint_interval_s`` of training time);
- **the in-flight step** (a fractional step counter): discarded on every replica
  (``torchft``), only the dead replica's share of it (``freescale``), or everything since
  the last completed checkpoint (``sync``, or any policy that loses every replica).

Every second of every GPU lands in exactly one bucket (useful, or one reason for loss), so the
breakdown adds up to the wall time; ETTR is the useful bucket's share.  The work of a step is
counted as it is done and taken back when the step is discarded or rolled back.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from freescale.sim.params import Cluster, Policy
from freescale.sim.trace import Failure

_EPS = 1e-9
HEAL = "heal (source blocks)"
_BULK_CYCLES = 2  # quiet spans of at least this many checkpoint cycles are accounted at once


@dataclass
class Outcome:
    """What one policy made of one trace."""

    policy: str
    ettr: float
    wall_s: float
    failures: int
    """Crash and hang events (slow episodes are counted in ``slow_episodes``)."""
    slow_episodes: int
    stalls_s: list[float]
    """Per crash/hang of a contributing replica: the survivors' time lost to it: how much later
    their next committed step comes than it would have without the failure (the discarded part
    of a step included), plus, under ``torchft``, the heal that blocks them when the failed group
    comes back (charged to the failure that took it down)."""
    steps_committed: float
    steps_discarded: int
    mean_contributing: float
    """Replica groups contributing, averaged over the wall time (0 in a global stall)."""
    participating_per_step: float
    """Replica groups contributing, averaged over the steps attempted (a published run's per-step
    figure: stalls, in which no step is taken, do not count)."""
    replicas: int
    breakdown: dict[str, float]
    """Share of GPUs x wall time per bucket (``useful`` included); adds up to 1."""
    series_t_s: list[float] = field(default_factory=list)
    series_rate: list[float] = field(default_factory=list)
    """Throughput over time: work done per bin as a share of the whole cluster's (before rollbacks)."""

    def stall_stats(self) -> dict[str, float]:
        if not self.stalls_s:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0}
        a = np.asarray(self.stalls_s)
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}

    @property
    def committed_fraction(self) -> float:
        """Committed steps over step attempts (committed + discarded)."""
        total = self.steps_committed + self.steps_discarded
        return self.steps_committed / total if total else 1.0

    @property
    def step_efficiency(self) -> float:
        """Per step, as a published run counts it: steps committed over attempted, times the
        replica groups participating in a step over all groups."""
        return self.committed_fraction * self.participating_per_step / self.replicas


@dataclass
class _Rates:
    useful: float  # per second, share of the cluster
    losses: dict[str, float]
    contributing: int
    step_s: float
    eff: np.ndarray  # each replica's effective speed (0 when not contributing)


class _Run:
    """One policy's pass over the trace (``simulate`` is the entry point)."""

    def __init__(self, cluster: Cluster, policy: Policy, horizon_s: float, bins: int) -> None:
        self.c, self.p, self.horizon = cluster, policy, horizon_s
        self.R = cluster.replicas
        self.t = 0.0
        self.stall: deque[list] = deque()  # [reason, seconds left]
        self.down_until = np.full(self.R, -math.inf)
        self.catch_until = np.full(self.R, -math.inf)
        self.restarting = np.zeros(self.R, dtype=bool)
        self.catching = np.zeros(self.R, dtype=bool)
        self.slow: list[tuple[int, float, float, float]] = []  # (replica, speed, detected at, until)
        self.phase = 0.0  # steps since the current step sequence began (fraction: the in-flight step)
        self.cycle = 0.0  # training time into the current checkpoint cycle
        self.since_ckpt_work = 0.0
        self.since_ckpt_steps = 0.0
        self.useful = 0.0
        self.lost: dict[str, float] = defaultdict(float)
        self.contrib_time = 0.0
        self.contrib_steps = 0.0  # sum over step attempts of the groups contributing to them
        self.attempted = 0.0
        self.steps = 0.0
        self.discarded = 0
        self.failures = 0
        self.slow_episodes = 0
        self.stalls: list[float] = []
        self.cause = np.full(self.R, -1)  # the failure (index into stalls) each restarting group is out for
        self.capacity = np.ones(self.R)  # a shrunk group's share of its GPUs still training
        self.gpus_lost = np.zeros(self.R, dtype=int)
        self.caught = np.zeros(self.R, dtype=bool)  # a shrink's outage includes its catch-up: none after it
        self.repairs: list[tuple[float, int]] = []  # (time a lost GPU's slot is back, replica)
        self.bin_s = horizon_s / bins
        self.series = np.zeros(bins)

    # ----- rates ---------------------------------------------------------------------------
    def rates(self) -> _Rates:
        p, R, t = self.p, self.R, self.t
        up = ~self.restarting & ~self.catching
        speed = np.ones(R)
        wait = 1.0  # pace every contributing replica is held to
        for j, v, detected, until in self.slow:
            if until > t and up[j]:
                if p.kind == "freescale" and detected <= t:
                    speed[j] = min(speed[j], v)  # kept at a reduced share; what planning does not win back
                    wait = min(wait, 1.0 - (1.0 - v) * (1.0 - p.slow_recovered))  # still held back, everyone
                else:
                    wait = min(wait, v)
        paced = np.where(up, np.minimum(speed, wait), 0.0)
        eff = paced * self.capacity
        n_up = int(up.sum())
        rate = float(eff.sum()) / R
        losses = {"replica restarting": float(self.restarting.sum()) / R,
                  "replica catching up": float(self.catching.sum()) / R,
                  "slow replicas": (n_up - float(paced.sum())) / R}
        if (self.capacity < 1).any():
            losses["GPUs lost, groups shrunk"] = float((paced - eff).sum()) / R
        if p.kind == "freescale":
            step = self.c.step_s * R / max(float(eff.sum()), _EPS)  # the global batch over who is left
        else:
            step = self.c.step_s / max(wait, _EPS)  # each replica's batch; the slowest sets the pace
        if p.kind == "freescale" and self.catching.any() and p.catchup_slowdown > 1:
            slowed = rate / p.catchup_slowdown
            losses["catch-up slowdown"] = rate - slowed
            rate, step = slowed, step * p.catchup_slowdown
        losses["steady-state overhead"] = p.overhead * rate
        return _Rates((1 - p.overhead) * rate, losses, n_up, step, eff)

    # ----- time ----------------------------------------------------------------------------
    def advance(self, t1: float) -> None:
        """Account every second from ``self.t`` to ``t1`` (no event in between)."""
        while self.t < t1 - _EPS:
            if self.stall:
                entry = self.stall[0]
                dt = min(entry[1], t1 - self.t)
                self.lost[entry[0]] += dt
                entry[1] -= dt
                if entry[1] <= _EPS:
                    self.stall.popleft()
                    if not self.stall:
                        self.phase = 0.0  # training resumes with a fresh step
                self.t += dt
                continue
            self._train(t1)

    def _train(self, t1: float) -> None:
        p = self.p
        interval, cost = p.checkpoint_interval_s, p.checkpoint_cost_s
        if interval > 0 and self.cycle >= interval + cost - _EPS:
            self._checkpoint_done()
        if interval > 0 and self.cycle <= _EPS:  # whole checkpoint cycles before t1: all at once
            cycles = int((t1 - self.t) / (interval + cost))
            if cycles >= _BULK_CYCLES:
                self._whole_cycles(cycles, interval, cost)
                return
        saving = interval > 0 and self.cycle >= interval - _EPS
        boundary = math.inf if interval <= 0 else (interval + cost if saving else interval) - self.cycle
        dt = min(t1 - self.t, max(boundary, 0.0))
        r = self.rates()
        for reason, per_s in r.losses.items():
            if reason != "steady-state overhead" or not saving:
                self.lost[reason] += per_s * dt
        if saving:
            self.lost["checkpoint saves"] += (r.useful + r.losses["steady-state overhead"]) * dt
        else:
            self.useful += r.useful * dt
            steps = dt / r.step_s if r.contributing else 0.0
            self.steps += steps
            self.attempted += steps
            self.contrib_steps += r.contributing * steps
            self.phase += steps
            if interval > 0:  # without checkpoints nothing is ever redone (the published idealisation)
                self.since_ckpt_work += r.useful * dt
                self.since_ckpt_steps += steps
            self._add_series(self.t, dt, r.useful)
        self.contrib_time += r.contributing * dt
        self.cycle += dt
        self.t += dt
        if interval > 0 and self.cycle >= interval + cost - _EPS:
            self._checkpoint_done()

    def _whole_cycles(self, n: int, interval: float, cost: float) -> None:
        """``n`` checkpoint cycles (train ``interval``, save ``cost``) at constant rates: what
        ``n`` passes of ``_train`` would account, in one (long quiet spans cost no time)."""
        r = self.rates()
        span = n * (interval + cost)
        for reason, per_s in r.losses.items():
            self.lost[reason] += per_s * (n * interval if reason == "steady-state overhead" else span)
        self.lost["checkpoint saves"] += (r.useful + r.losses["steady-state overhead"]) * n * cost
        self.useful += r.useful * n * interval
        steps = n * interval / r.step_s if r.contributing else 0.0
        self.steps += steps
        self.attempted += steps
        self.contrib_steps += r.contributing * steps
        self.phase += steps
        self.contrib_time += r.contributing * span
        # throughput series: training time in each bin, t -> floor(t/C)*I + min(t mod C, I) from the span's start
        first, size = int(self.t / self.bin_s), self.series.size
        if first < size:
            edges = np.clip(np.arange(first, min(int((self.t + span) / self.bin_s), size - 1) + 2) * self.bin_s,
                            self.t, self.t + span) - self.t
            cycle = interval + cost
            trained = np.floor(edges / cycle) * interval + np.minimum(np.mod(edges, cycle), interval)
            self.series[first:first + edges.size - 1] += r.useful * np.diff(trained)
        self.t += span
        self._checkpoint_done()

    def _checkpoint_done(self) -> None:
        self.cycle = self.since_ckpt_work = self.since_ckpt_steps = 0.0

    def _add_series(self, t0: float, dt: float, rate: float) -> None:
        end = t0 + dt
        while t0 < end - _EPS:
            i = min(int(t0 / self.bin_s), self.series.size - 1)
            edge = min(end, (i + 1) * self.bin_s)
            self.series[i] += rate * (edge - t0)
            t0 = edge if edge > t0 else end

    # ----- events --------------------------------------------------------------------------
    def next_internal(self) -> float:
        times = [math.inf]
        if self.restarting.any():
            times.append(float(self.down_until[self.restarting].min()))
        if self.catching.any():
            times.append(float(self.catch_until[self.catching].min()))
        for _, _, detected, until in self.slow:
            times += [x for x in (detected, until) if x > self.t + _EPS]
        times += [at for at, _ in self.repairs]
        return min(times)

    def transitions(self) -> None:
        """Restarts and catch-ups that end now; slow episodes that are over."""
        t, p = self.t, self.p
        self._repaired()
        for j in np.flatnonzero(self.restarting & (self.down_until <= t + _EPS)).tolist():
            self.restarting[j] = False
            if self.caught[j]:  # a shrink: its outage held the catch-up already
                self.caught[j] = False
            elif p.kind == "torchft":  # the heal: its source, and so every replica, waits for the transfer
                heal = p.catchup_s(self.c)
                if heal > 0:
                    self.stall.append([HEAL, heal])
                    if self.cause[j] >= 0:  # the survivors' loss to the failure that took this group down
                        self.stalls[self.cause[j]] += heal
            elif p.kind == "freescale":
                self.catching[j] = True
                self.catch_until[j] = t + p.catchup_s(self.c) + p.replay_s
            self.cause[j] = -1
        self.catching &= self.catch_until > t + _EPS
        self.slow = [s for s in self.slow if s[3] > t + _EPS]

    def _repaired(self) -> None:
        """Lost GPUs whose slot is back: a shrunk group with none lost any more grows back (a restart and a
        catch-up, as any restart)."""
        due = [(at, j) for at, j in self.repairs if at <= self.t + _EPS]
        self.repairs = [(at, j) for at, j in self.repairs if at > self.t + _EPS]
        for _, j in due:
            self.gpus_lost[j] -= 1
            if self.p.shrink and self.gpus_lost[j] == 0:
                self.capacity[j] = 1.0
                if not self.restarting[j]:
                    self.restarting[j], self.catching[j] = True, False
                    self.down_until[j] = self.t + self.p.restart_s

    def _down_for(self, f: Failure, j: int, detect: float) -> float:
        """How long replica ``j`` is out for a crash of one of its GPUs (``Cluster.repair_s``: a spare is not there
        at once): shrunk after ``shrink_s``, or waiting for the slot to come back, then restarting."""
        p, c = self.p, self.c
        if f.kind != "crash" or c.repair_s <= 0:
            return detect + p.restart_s
        self.gpus_lost[j] += 1
        self.repairs.append((self.t + c.repair_s, j))
        if not p.shrink:
            return detect + c.repair_s + p.restart_s
        self.capacity[j] = max(0.0, 1.0 - self.gpus_lost[j] / c.gpus_per_replica)
        self.caught[j] = True
        # The measured outage (a toy's: its catch-up moves kilobytes) plus, at this scale, the catch-up of the rank
        # standing in for the lost one: its own position's state and the lost position's.
        return detect + p.shrink_s + 2 * p.catchup_s(c)

    def fail(self, f: Failure) -> None:
        if f.kind == "slow":
            self.slow_episodes += 1
            self.slow.append((f.replicas[0], self.c.slow_speed, f.time + self.p.detect_s["slow"],
                              f.time + self.c.slow_duration_s))
            return
        if self.stall and self.p.recovery == "renewal":
            return  # renewal accounting: failures arrive only while training
        self.failures += 1
        detect = self.p.detect_s[f.kind]
        if self.p.kind == "sync":
            self._job_failure(detect, [["detection", detect], ["job restart", self.p.restart_s]])
        else:
            self._replica_failure(f, detect)

    def _push(self, items: list[list]) -> None:
        if self.stall and self.p.recovery == "restart":  # the recovery in progress starts again; other
            self.stall = deque(e for e in self.stall if e[0] == HEAL)  # groups' heals are not part of it
        self.stall.extend([list(i) for i in items if i[1] > 0])

    def _job_failure(self, detect: float, items: list[list]) -> None:
        """Every replica stops; the work since the last completed checkpoint is redone."""
        if not self.stall:
            self.useful -= self.since_ckpt_work
            self.lost["redone work (since checkpoint)"] += self.since_ckpt_work
            self.steps -= self.since_ckpt_steps
            self.discarded += math.ceil(self.since_ckpt_steps - _EPS)
            self.cycle = self.since_ckpt_work = self.since_ckpt_steps = 0.0
            self.phase = 0.0
        self._push(items)
        self.stalls.append(sum(i[1] for i in items))
        self.cause[self.restarting & (self.cause < 0)] = len(self.stalls) - 1

    def _replica_failure(self, f: Failure, detect: float) -> None:
        p, t = self.p, self.t
        before = self.rates()
        contributing = [j for j in f.replicas if before.eff[j] > 0]
        fresh = [j for j in f.replicas if not self.restarting[j]]
        for j in f.replicas:
            if self.restarting[j] and p.recovery == "queue":
                self.down_until[j] += p.restart_s  # queued: one more restart after this one
            else:  # restarts now (and a catch-up in progress is lost)
                self.down_until[j] = t + self._down_for(f, j, detect)
            self.restarting[j], self.catching[j] = True, False
        if not contributing:
            return  # a group that was out anyway: no one else notices
        if not (~self.restarting & ~self.catching).any():  # every replica lost: back to the checkpoint
            self._job_failure(detect, [["detection", detect]])
            return
        stall = detect + p.reconfigure_s
        if not self.stall and before.contributing:
            frac = self.phase % 1.0
            if p.kind == "torchft":  # the in-flight step is discarded on every replica
                work = frac * before.step_s * before.useful
                self.lost["discarded steps"] += work
                self.useful -= work
                self.steps -= frac
                self.discarded += 1
                self.phase = 0.0
                stall = max((1 - frac) * before.step_s, detect) + p.reconfigure_s
                self.stalls.append(frac * before.step_s + stall)  # the step done again, and the wait
            else:  # only the dead replicas' shares of the in-flight step (their rows are requeued)
                work = sum(frac * before.step_s * before.eff[j] * (1 - p.overhead) / self.R for j in contributing)
                self.lost["dead replica's share of the step"] += work
                self.useful -= work
                self.stalls.append(stall)
        else:
            self.stalls.append(stall)
        for j in fresh:  # a group already restarting stays charged to the failure that took it down
            self.cause[j] = len(self.stalls) - 1
        self._push([["failure stall (detect, rebuild)", stall]])


def simulate(cluster: Cluster, policy: Policy, trace: list[Failure], horizon_s: float, bins: int = 200) -> Outcome:
    """Run ``policy`` over ``trace`` for ``horizon_s`` seconds of wall time."""
    cluster.validate()
    policy.validate()
    run = _Run(cluster, policy, horizon_s, bins)
    events = iter(trace)
    upcoming = next(events, None)
    while True:
        t_next = min(upcoming.time if upcoming else math.inf, run.next_internal(), horizon_s)
        run.advance(t_next)
        if t_next >= horizon_s:
            break
        run.transitions()
        while upcoming is not None and upcoming.time <= run.t + _EPS:
            run.fail(upcoming)
            upcoming = next(events, None)
    wall = run.t
    breakdown = {"useful": float(run.useful / wall), **{k: float(v / wall) for k, v in sorted(run.lost.items()) if v}}
    return Outcome(
        policy=policy.name, ettr=float(run.useful / wall), wall_s=wall, failures=run.failures,
        slow_episodes=run.slow_episodes, stalls_s=run.stalls, steps_committed=float(run.steps),
        steps_discarded=run.discarded, mean_contributing=float(run.contrib_time / wall),
        participating_per_step=float(run.contrib_steps / run.attempted) if run.attempted else 0.0, replicas=run.R,
        breakdown=breakdown,
        series_t_s=[(i + 0.5) * run.bin_s for i in range(run.series.size)],
        series_rate=(run.series / run.bin_s).tolist())
