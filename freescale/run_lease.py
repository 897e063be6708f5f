"""One writer per run directory: a lease taken at the start of a job, and a fence checked before every write.

Two jobs writing one run directory corrupt it without a sound: each prunes the other's checkpoints, and a
resume picks whichever wrote last.  So a job holds a **lease** on its run directory (``train.output_dir``,
and the checkpoint directory when it lies elsewhere) for its whole life:

- ``acquire`` takes an exclusive ``flock`` on ``.freescale-lease`` in each directory (released by the
  kernel when the holder dies, however it dies) and writes a fresh **token** into it, with who holds it.
  A directory whose lease is held (its writers are alive) is refused in one line naming the holder.
  ``freescale launch`` acquires it before any rank starts and hands the token to every rank
  (``FREESCALE_LEASE_TOKEN``); ``freescale train`` run without the launcher (torchrun, one process)
  acquires it in its rank 0.
- ``fence`` (rank 0, before a checkpoint's commit and the pruning of old ones, ``checkpoint._commit``)
  reads the token back: if another job took the directory over (this one's launcher died, and a new
  launch took the lease), the writer stops in one line without writing.

The flock needs a file system that honours it (local disks, and NFS v4 and Lustre with flock enabled);
the token fence works on any shared file system, with the window between its read and the commit's
rename (milliseconds) left open.  Replica groups share one lease, the launcher's: which group writes a
step's checkpoint is the lighthouse's decision (one group per step).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from freescale.checkpoint_integrity import CheckpointError

LEASE_FILE = ".freescale-lease"
TOKEN_ENV = "FREESCALE_LEASE_TOKEN"


class RunDirectoryBusy(CheckpointError):
    """The run directory is leased by a job whose writers are alive, or was taken over by another job."""


@dataclass
class RunLease:
    """A held lease: the directories, the token, the locked files (closing them releases it)."""

    directories: list[Path]
    token: str
    _files: list[IO[str]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fh in self._files:
            fh.close()  # the flock goes with the file description
        self._files.clear()

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lease_directories(output_dir: str | Path, checkpoint_dir: str | Path) -> list[Path]:
    """The directories one job writes: its output directory, and its checkpoint directory if outside it."""
    out, ckpt = Path(output_dir).resolve(), Path(checkpoint_dir).resolve()
    return [out] if ckpt == out or out in ckpt.parents else [out, ckpt]


def acquire(directories: list[Path]) -> RunLease:
    """Lease every directory (created if missing), or raise ``RunDirectoryBusy`` naming the holder."""
    lease = RunLease(directories=list(directories), token=uuid.uuid4().hex)
    holder = {"token": lease.token, "pid": os.getpid(), "host": platform.node(),
              "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        for directory in directories:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fh = (directory / LEASE_FILE).open("a+")
            except OSError as exc:  # a file where the directory should be, no permission, a read-only mount
                why = "a file, not a directory" if directory.is_file() else exc.strerror or type(exc).__name__
                raise CheckpointError(f"{directory}: this run cannot write there ({why}); give it another "
                                      "train.output_dir (or checkpoint.dir)") from None
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                raise RunDirectoryBusy(f"{directory}: in use by a run that is still writing to it "
                                       f"({_describe(_read(directory))}); stop it first, or give this run "
                                       "another train.output_dir") from None
            except OSError as exc:  # a file system without flock (Lustre without -o flock, some NFS mounts)
                print(f"freescale: warning: {directory}: the file system refuses a lock ({exc.strerror}); only the "
                      "token checked before each checkpoint keeps a second job from writing there", file=sys.stderr)
            lease._files.append(fh)
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps(holder))
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        lease.release()
        raise
    return lease


@contextlib.contextmanager
def held(directories: list[Path], stale: Path | None = None) -> Iterator[RunLease]:
    """The lease for the block, its token in this process's environment (``TOKEN_ENV``: the ranks this
    process starts, and its own checkpoint writer, fence with it); ``stale``: a checkpoint directory whose
    leftovers of killed saves are removed once the lease is held (``checkpoint.remove_stale``)."""
    with acquire(directories) as lease:
        if stale is not None:
            from freescale.checkpoint import remove_stale

            remove_stale(stale)
        previous = os.environ.get(TOKEN_ENV)
        os.environ[TOKEN_ENV] = lease.token
        try:
            yield lease
        finally:
            if previous is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = previous


def fence(directories: list[Path], token: str) -> None:
    """Raise ``RunDirectoryBusy`` unless every directory's lease still holds ``token``."""
    for directory in directories:
        holder = _read(directory)
        if holder.get("token") != token:
            raise RunDirectoryBusy(f"{directory}: another run took this directory over ({_describe(holder)}); "
                                   "this one stops without writing")


def fence_from_env(directories: list[Path]) -> Callable[[], None] | None:
    """The fence for the token the launcher handed this rank, or None (no launcher)."""
    token = os.environ.get(TOKEN_ENV)
    return None if not token else lambda: fence(directories, token)


def _read(directory: Path) -> dict[str, Any]:
    try:
        found = json.loads((directory / LEASE_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"


__all__ = ["LEASE_FILE", "TOKEN_ENV", "RunDirectoryBusy", "RunLease", "acquire", "fence", "fence_from_env",
           "held", "lease_directories"]
