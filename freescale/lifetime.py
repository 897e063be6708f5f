"""No process of a job outlives the launcher that started it.

``freescale launch`` starts a tree: the launcher (torch's elastic agent in-process, or with replica groups
a lighthouse thread and one agent process per group), each agent's rank clients (``forkserver``'s), and the
ranks the fork server forks for them.  A scheduler or a terminal that kills the launcher with SIGKILL, or
its process group, reaches none of the rest: the agents start ranks in sessions of their own.  Orphaned
ranks trained on for minutes, writing checkpoints into a run directory a new launch was already using.

So every process the launcher (or an agent) starts asks the kernel for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``; the parent names itself in ``FREESCALE_PARENT_PID``, and a child whose parent
is already gone when it asks kills itself at once): launcher -> group agents -> rank clients; a forked
rank dies with its client (``forkserver._watch_client``), the fork server with the launcher (its stdin
closes).  Each link takes effect at once, so the whole tree is gone within a second or two.

A deliberate stop (SIGTERM, SIGINT, SIGHUP) is not a death: the launcher passes it down, waits for the
ranks, and says so in one line (``launch``).  ``alive`` / ``process_state``: whether a pid runs, is stopped or is
gone, from ``/proc`` (the fork server's wait for its ranks, a rank naming the peer that failed).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

PARENT_ENV = "FREESCALE_PARENT_PID"
"""The pid of the process that started this one, when that process wants its children gone with it."""
_PR_SET_PDEATHSIG = 1


def children_die_with_me(env: dict[str, str] | None = None) -> None:
    """Name this process as the parent whose death ends the children it starts next (``env``, else this
    process's environment, which they inherit)."""
    (os.environ if env is None else env)[PARENT_ENV] = str(os.getpid())


def die_with_parent() -> None:
    """If started by a parent that asked for it (``PARENT_ENV``): SIGKILL this process when the parent dies.
    Linux only (elsewhere nothing changes).  The variable is consumed: this process's own children are
    tied to it only if it says so itself."""
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected or expected == str(os.getpid()) or not sys.platform.startswith("linux"):
        return  # (its own pid: left by a launch that ran in this very process)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the parent's other means (stdin, the client watch) remain
    if os.getppid() != int(expected):  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) turned into an exception in the main thread, as ^C is: the
    code it interrupts unwinds (a save in flight abandoned, ``CheckpointWriter.abandon``) instead of dying
    mid-write."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_FINALIZERS = ("_weakrefset.py", "weakref.py")
"""Where the collector's callbacks run (``stops_raise`` does not raise inside them)."""
_stopping: list[int] = []


def stopping() -> bool:
    """A stop signal reached this process (``stops_raise``): a peer's failure seen now is the same stop
    reaching the peer first, not a fault to report."""
    return bool(_stopping)


class stops_raise:
    """Within the block, a stop signal raises ``Stopped`` in the main thread.  For processes the CLI owns
    (the launcher, a rank of ``freescale train``): a library leaves its host's signal handlers alone."""

    def __enter__(self) -> None:
        def stop(signum: int, frame: Any) -> None:
            if frame is not None and frame.f_code.co_filename.endswith(_FINALIZERS):
                # A weakref callback the collector runs: an exception there is printed and dropped ("Exception
                # ignored in ..."), the stop lost.  The same signal again in a moment, outside it.
                threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
                return
            _stopping.append(signum)
            raise Stopped(signum)

        self.previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    return process_state(pid) not in ("Z", "X")


def process_state(pid: int) -> str:
    """``pid``'s state letter in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie ...); ``X`` for no such
    process (or no ``/proc``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


__all__ = ["PARENT_ENV", "STOP_SIGNALS", "Stopped", "alive", "children_die_with_me", "die_with_parent", "process_state",
           "stopping", "stops_raise"]
