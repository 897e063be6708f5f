"""``freescale launch --standby``: each one-rank replica group as an active process and a warm standby.

A restarted group pays for a new interpreter, torch's and torchrec's imports and its model's construction
before it can even ask for a peer's state; a warm standby has paid for all of it while the group trained.
So the group's agent (``launch.launch_local``) runs two processes of the group's one rank instead of one
elastic launch, both given the group's lock (``FREESCALE_STANDBY_LOCK``, ``freescale.ft.standby``):
whichever takes the lock first trains; the other builds its model and waits for the lock in
``FaultTolerance(...)``.  The kernel releases the lock the moment its holder dies, however it dies
(SIGKILL included), and the standby goes on as the group's next incarnation, catching up from the other
groups like any restarted group.  The agent then starts another process in the dead one's place: the
next standby.  ``--max-restarts`` counts those starts.

Each process is a world of one rank over an in-memory store (both initialize a process group before the
lock is decided: no rendezvous port to share).  A process that ends with status 0 saw the run finish (the standby then
takes the lock, is told the run has finished at its first quorum, and ends too).  An error no restart
can fix (``launch``'s ``rank<N>.final.txt``) stops the other process at once; so does a stop signal.

Overlaps: the standby's start-up (imports, model) runs beside the active process's training, on the same
cores: it pays off where a restart's own start-up is long next to its catch-up (a large model, a slow
import, many groups restarting at once), and costs one idle process's memory.  Groups of several ranks
cannot have one (a standby cannot join the active ranks' process group; ``freescale.ft.standby``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from freescale.ft.standby import STANDBY_ENV
from freescale.lifetime import Stopped, stops_raise

STANDBY_PAIR_ENV = "FREESCALE_STANDBY_PAIR"
"""Set by ``launch_replicas`` for a group's agent: run the group's rank as an active process and a standby."""
STOP_GRACE_S = 30.0


def wanted() -> bool:
    return os.environ.get(STANDBY_PAIR_ENV, "") == "1" and bool(os.environ.get(STANDBY_ENV))


def run_pair(max_restarts: int, train_args: Sequence[str], command: Sequence[str], error_dir: str) -> int:
    """The group's rank as an active process and a warm standby (module docstring); an exit status as
    ``launch.launch_local``'s."""
    from freescale.launch import FINAL_SUFFIX, _user_errors, rank_argv, stopped_by

    argv = rank_argv(train_args, command)
    slots: list[subprocess.Popen[bytes] | None] = []
    started, failed, last_failure, finished = 0, 0, "", False
    try:
        with stops_raise():
            first = _start(argv, 0)
            slots.append(first)
            _wait_until_held(_lock_path(), first)  # the first is the active one (incarnation 0)
            slots.append(_start(argv, 1))
            started = 2
            while any(p is not None for p in slots):
                time.sleep(0.05)
                for i, proc in enumerate(slots):
                    if proc is None or proc.poll() is None:
                        continue
                    code, slots[i] = proc.returncode, None
                    if code == 0:  # the run finished (a standby then takes the lock and is told so)
                        finished = True
                        continue
                    if any(Path(error_dir).glob(f"rank*{FINAL_SUFFIX}.txt")):
                        _stop(slots, signal.SIGTERM)
                        _user_errors(error_dir, final_only=True)
                        return 2
                    failed += 1
                    last_failure = f"signal {-code}" if code < 0 else f"exit code {code}"
                    if failed <= max_restarts:
                        slots[i] = _start(argv, started)  # the next standby (the other one took the lock)
                        started += 1
    except Stopped as stopped:
        _stop(slots, stopped.signum)
        return stopped_by(stopped.signum)
    if failed > max_restarts and not finished:
        if _user_errors(error_dir):
            return 2
        print(f"freescale: error: rank 0 failed with {last_failure} ({failed} times, --max-restarts "
              f"{max_restarts}; its standby too); see its output above", file=sys.stderr)
        return 1
    return 0


def _lock_path() -> Path:
    from freescale.ft.config import REPLICA_INDEX_ENV

    return Path(os.environ[STANDBY_ENV].format(replica=f"replica{os.environ.get(REPLICA_INDEX_ENV, '0')}"))


def _wait_until_held(lock: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until ``proc`` holds the group's lock (its holder writes its incarnation into it) or has ended."""
    while proc.poll() is None:
        with contextlib.suppress(OSError):
            if lock.read_text().strip():
                return
        time.sleep(0.05)


_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _start(argv: list[str], index: int) -> subprocess.Popen[bytes]:
    """The group's ``index``-th process: a world of one over an in-memory store (no rendezvous:
    ``distributed.init_distributed``), the group's lock in its environment, ``index`` as its incarnation
    (the lock's holder count wins where higher: ``ft.standby.take_over``)."""
    env = {k: v for k, v in os.environ.items() if k not in _WORLD_ENV}
    env["TORCHELASTIC_RESTART_COUNT"] = str(index)
    return subprocess.Popen(argv, env=env)


def _stop(slots: list[subprocess.Popen[bytes] | None], signum: int) -> None:
    """Pass the stop to the running processes, wait for them (``STOP_GRACE_S``), kill the rest."""
    for proc in slots:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(p is not None and p.poll() is None for p in slots) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in slots:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
