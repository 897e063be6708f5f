"""Test instrumentation, reached from the training path through one object: ``StepHooks``.

The training code calls ``hooks.at(point, step)`` at a few named points and
asks ``hooks.audit`` whether step records should carry an audit; everything
else (parsing, signals) lives here.  A production run gets ``StepHooks()``:
every call is a no-op.  Two environment variables turn it on, for tests,
benchmarks and demos (the same in every process of a run):

``FREESCALE_FAULTS``: comma-separated ``<group>:<rank>:<step>:<point>[:<ms>][@<incarnation>]``.
    Each SIGKILLs (a real signal) that rank of that replica group, in that
    incarnation of the group (default 0), at ``point``:

    - ``forward``: after the forward of the first step at or after ``step`` it
      trains, before backward;
    - ``reduce``: ``ms`` milliseconds into step ``step``'s gradient exchange;
    - ``vote``: after step ``step``'s exchange completed, before this rank votes
      (the others built the update while waiting for the vote, which fails:
      they put it back and redo the step with the survivors);
    - ``catchup``: at the first step at or after ``step`` the group sits out
      while catching up (its snapshot download under way);
    - ``serve``: while its snapshot server streams a snapshot of step ``step``
      or later to a recovering peer (the source dies mid-transfer);
    - ``slow`` is no fault: from ``step`` on, every incarnation sleeps ``ms``
      after backward (longer "compute": survivors are still training when a
      restarted group is back);
    - ``compute`` is no fault: from ``step`` on, every incarnation's compute takes ``<ms>`` times as long
      (the 5th field is a factor here, e.g. ``0:1:20:compute:2``): after backward the rank spins for
      ``factor - 1`` times the CPU time its step has taken so far, so the extra time grows with its
      work (a smaller share is slowed less), as on a throttled device, and is the rank's own busy time;
    - ``device`` is no fault either: as ``compute``, but the rank waits instead of spinning, and the wait counts
      as its busy time (``StepHooks.stretched``): a throttled accelerator, whose busy time CUDA events would
      measure, while the host's cores stay free for the other ranks (on a machine whose ranks share cores,
      a spinning slow rank slows the healthy ones too);
    - ``data`` is no fault either: from ``step`` on, every incarnation's data loading takes ``<ms>`` times as
      long (a factor, as for ``compute``): after the loader makes a batch, its thread waits ``factor - 1``
      times what making it took (slow storage or a starved host: the training thread waits for its batch);
    - ``write`` is no fault either: every save of a step at or after ``step`` waits ``ms`` on the writer's
      thread before its files are written (slow storage: the loop goes on; the next save finds it busy);
    - ``away`` is no fault either: from ``step`` on, while the last committed step
      had fewer ready replica groups than the run has, every incarnation sleeps
      ``ms`` after backward.  Survivors train slowly only while a group restarts
      and catches up, then at full speed: a test's remaining steps outlast a
      restart however loaded the machine, without slowing the steps around it.

    ``*`` as group or rank matches every one.  Before dying, the rank writes
    ``<dir>/rank<R>.killed`` (the time), ``dir`` being its group's log directory.
``FREESCALE_AUDIT=1``: every step record carries ``digest`` (SHA-256 of the
    group's whole state: parameters, both optimizers) and ``rows`` (the row ids
    the whole step trained, every group's): tests compare replicas step by
    step and count every sample.  Costs a hash and a gather per step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import NamedTuple

FAULTS_ENV = "FREESCALE_FAULTS"
AUDIT_ENV = "FREESCALE_AUDIT"
POINTS = ("forward", "reduce", "vote", "catchup", "serve", "slow", "away", "compute", "device", "data", "write")
_AT_OR_AFTER = ("forward", "catchup", "slow", "serve", "away", "compute", "device", "data", "write")
_EVERY_INCARNATION = ("slow", "away", "compute", "device", "data", "write")
_FACTORS = ("compute", "device", "data")


class StepHooks:
    """The training path's one hook (no-ops): see the module docstring."""

    audit = False

    def at(self, point: str, step: int) -> None:
        """Called at ``point`` of ``step``."""

    def wants(self, point: str) -> bool:
        """Whether ``at(point, ...)`` can ever act (lets callers skip setting a point up)."""
        return False

    def stretch(self, step: int, busy_s: float) -> None:
        """After a step's backward, ``busy_s`` CPU seconds into it (the ``compute`` fault)."""

    def stretch_data(self, step: int, made_s: float) -> None:
        """After the loader made step ``step``'s batch in ``made_s`` seconds, on its thread (the ``data`` fault)."""

    def stretched(self) -> float:
        """Seconds the ``device`` fault waited in this step so far, counted as busy (then 0 until it waits again)."""
        return 0.0


class Fault(NamedTuple):
    """One item of ``FREESCALE_FAULTS``: where (group, rank: None matches every one; the incarnation: None, every
    one), when (``step``), what (``point``) and its number (``value``: seconds, or a factor)."""

    group: int | None
    rank: int | None
    step: int
    point: str
    value: float
    incarnation: int | None


def parse_faults(spec: str) -> list[Fault]:
    """``FREESCALE_FAULTS`` read whole, or ``ConfigError`` in one line naming the item (the launcher asks before
    any rank starts; each rank reads it again)."""
    from freescale.config import ConfigError

    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, at_incarnation, wanted = item.partition("@")
        parts = where.split(":")
        shape = (f"{FAULTS_ENV}: '{item}' is not <group>:<rank>:<step>:<point>[:<ms>][@<incarnation>] with <point> "
                 f"one of {', '.join(POINTS)}")
        if len(parts) not in (4, 5) or parts[3] not in POINTS or (
                at_incarnation and not (wanted.isascii() and wanted.isdecimal())):
            raise ConfigError(shape)
        try:
            group, rank = (None if p == "*" else int(p) for p in parts[:2])
            step, value = int(parts[2]), float(parts[4]) if len(parts) > 4 else 0.0
        except ValueError:
            raise ConfigError(shape) from None
        point = parts[3]
        if point in _FACTORS and not value >= 1.0:
            raise ConfigError(f"{FAULTS_ENV}: '{item}': a {point} fault's factor must be >= 1")
        incarnation = int(wanted) if wanted else (None if point in _EVERY_INCARNATION else 0)
        faults.append(Fault(group, rank, step, point, value if point in _FACTORS else value / 1000, incarnation))
    return faults


class FaultHooks(StepHooks):
    """``FREESCALE_FAULTS`` and ``FREESCALE_AUDIT`` for one rank (module docstring)."""

    def __init__(self, spec: str, group: int, rank: int, incarnation: int, out_dir: Path, audit: bool) -> None:
        self.rank, self.out_dir, self.audit = rank, out_dir, audit
        self._device_s = 0.0
        self.faults: list[tuple[int, str, float]] = [
            (f.step, f.point, f.value) for f in parse_faults(spec)
            if f.group in (None, group) and f.rank in (None, rank) and f.incarnation in (None, incarnation)]

    def wants(self, point: str) -> bool:
        return any(kind == point for _, kind, _ in self.faults)

    def at(self, point: str, step: int) -> None:
        for at, kind, delay in self.faults:
            if kind != point or not (step == at or (point in _AT_OR_AFTER and step >= at)):
                continue
            if point in _EVERY_INCARNATION:
                time.sleep(delay)
            elif point == "reduce":
                threading.Timer(delay, self.die).start()
            else:
                self.die()

    def stretch(self, step: int, busy_s: float) -> None:
        for at, kind, factor in self.faults:
            if kind == "compute" and step >= at and factor > 1.0:
                until = time.thread_time() + (factor - 1.0) * busy_s
                spun = 0
                while time.thread_time() < until:  # real work, on this rank's own CPU time
                    spun += 1
            elif kind == "device" and step >= at and factor > 1.0:
                wait = (factor - 1.0) * busy_s
                time.sleep(wait)
                self._device_s += wait

    def stretched(self) -> float:
        waited, self._device_s = self._device_s, 0.0
        return waited

    def stretch_data(self, step: int, made_s: float) -> None:
        for at, kind, factor in self.faults:
            if kind == "data" and step >= at and factor > 1.0:
                time.sleep((factor - 1.0) * made_s)

    def die(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.rank}.killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def hooks_from_env(group: int, rank: int, incarnation: int, out_dir: Path) -> StepHooks:
    """``FaultHooks`` when either variable is set, else the no-op ``StepHooks``."""
    spec, audit = os.environ.get(FAULTS_ENV, ""), os.environ.get(AUDIT_ENV, "") not in ("", "0")
    if not spec and not audit:
        return StepHooks()
    return FaultHooks(spec, group, rank, incarnation, out_dir, audit)
