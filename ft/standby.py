"""A warm standby for a one-rank replica group: a second process that has imported everything and built
its model before the group fails, and takes over the moment the active process dies.

Both hold (or wait for) one lock file per rank: ``flock`` on it, which the kernel releases when its
holder dies however it dies (SIGKILL included), so no heartbeat or launcher is in the way.  The lock
file holds the holder's incarnation; a standby that takes over registers with the lighthouse as the
next one, then catches up from the other groups like any restarted group.  It skips the restart's
floor on one machine: the interpreter, torch's import and the model's construction (6.5 of the 10.9 s
from a kill to the first contributing commit at 51M parameters on a busy 2-core machine:
``benchmarks/bench_ft.py --standby``).

Not for groups of several ranks yet: a rank's process group must be set up before its model is sharded,
and a standby cannot join the active group's.  An active process that ends normally hands the lock
over too: the standby then joins a finished run, and the lighthouse tells it so (it ends at its first
quorum).  Start the standby once the active process holds the lock.
"""

from __future__ import annotations

import fcntl
import os

STANDBY_ENV = "FREESCALE_STANDBY_LOCK"
"""A path (``{replica}``, the group's replica id, is filled in) on a local file system (``flock`` is not
reliable over NFS): hold this lock while active; wait for it as a standby."""


_ENDED = "ended"


def hand_back(fd: int, finished: bool) -> None:
    """The active process lets go of the lock (its end; the kernel does the same when it dies): where the run
    finished, it says so in the lock file first, and a standby that takes the lock then ends at once, status 0,
    instead of starting as the next incarnation only to hear the run is over."""
    if finished:
        os.pwrite(fd, f"{_ENDED:<20s}".encode("ascii"), 0)
    os.close(fd)


def take_over(path: str, incarnation: int) -> tuple[int, int]:
    """Block until this process holds the lock at ``path`` (at once when nobody holds it); then it is the
    active one for its life.  Returns (the lock's file descriptor, kept open; the incarnation to run as:
    ``incarnation``, or one past the last holder's when that is higher).  Where the last holder finished the
    run (``hand_back``), ``SystemExit(0)``: this process has nothing to do."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    previous = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    if previous == _ENDED:  # the active one finished the run: nothing to take over
        os.close(fd)
        raise SystemExit(0)
    if previous.isdigit():
        incarnation = max(incarnation, int(previous) + 1)
    os.pwrite(fd, f"{incarnation:<20d}".encode("ascii"), 0)  # one fixed-width write: never a torn or empty file
    os.fsync(fd)
    return fd, incarnation
