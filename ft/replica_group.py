"""The replica-dimension process group of one quorum: gloo over host buffers, or NCCL over device ones.

FTAR (``freescale.ft.ftar``), its overlapped form (``freescale.ft.overlap``) and
the sparse exchange (``freescale.ft.sparse_sync``) run their cross-group
collectives through a ``ReplicaGroup``: the process group, the device its
buffers live on, and a wait that is bounded and turns a dead or hung peer into
an exception on the calling (CPU) thread, which ``ReplicaSync`` answers by
aborting the group and redoing the step with the survivors.

Backends (``[ft] replica_backend``):

- ``gloo`` (CPU runs; CUDA runs that ask for it): buffers on the host, device
  gradients take one copy each way.  ``work.wait()`` blocks the CPU and raises
  on a reset connection (a crashed peer) or at the group's timeout (a hung one).
- ``nccl`` (CUDA runs, the default there): buffers on the rank's GPU, no host
  copies.  Each quorum's group is a fresh ``ProcessGroupNCCL`` (rendezvous
  under the quorum's store prefix) with a *non-blocking* communicator
  (``config.blocking = 0``: its init and an abort never block forever) that is
  connected when the group is made, before backward, rather than lazily inside
  a gradient hook.  An NCCL ``work.wait()`` only makes the current stream wait,
  so ``wait`` passes a deadline (``work.wait(timeout)``): the CPU then polls the
  work and, at the deadline or on an NCCL error, aborts the communicator and
  raises ``DistBackendError`` here.  The watchdog's own timeout is set well past
  that deadline and its error handling off for these groups
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` while one is made: with the default
  the watchdog would end the process, and a dead peer group must not take the
  survivors down).  A peer that dies over NVLink or shared memory may raise no
  NCCL error at all; the deadline (``[ft] timeout_s``) then finds it, so on
  GPUs keep it short.  NCCL refuses two ranks on one GPU, so this needs at
  least two GPUs; **it has not run yet** (no GPU was available where it was
  written: reviewed against the PyTorch and NCCL documentation only).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(requested: str, device: torch.device) -> str:
    """``auto`` -> ``nccl`` for a CUDA rank where torch has NCCL, else ``gloo``; errors name ``[ft] replica_backend``."""
    if requested not in BACKENDS:
        raise ValueError(f"ft.replica_backend: must be one of {', '.join(BACKENDS)}, got '{requested}'")
    nccl_ok = device.type == "cuda" and dist.is_nccl_available()
    if requested == "auto":
        return "nccl" if nccl_ok else "gloo"
    if requested == "nccl" and not nccl_ok:
        why = "this torch has no NCCL" if device.type == "cuda" else f"this rank trains on {device}, not a GPU"
        raise ValueError(f"ft.replica_backend: 'nccl' needs a CUDA rank and a torch built with NCCL ({why}); "
                         "use 'gloo' or 'auto'")
    return requested


@contextmanager
def _env(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class ReplicaGroup:
    """One quorum's process group at one rank position, and where its buffers live."""

    pg: Any
    """A ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` backend (``allreduce``, ``allgather``, ``abort``)."""
    backend: str
    device: torch.device
    """Where FTAR's buffers must be for this group: the host for gloo, the rank's GPU for NCCL."""
    timeout_s: float

    @staticmethod
    def of(group: ReplicaGroup | Any, timeout_s: float = 30.0) -> ReplicaGroup:
        """A bare process group (tests, tools) is taken as a gloo group over host buffers."""
        return group if isinstance(group, ReplicaGroup) else ReplicaGroup(group, "gloo", torch.device("cpu"), timeout_s)

    @staticmethod
    def create(backend: str, store: Any, rank: int, size: int, timeout_s: float, device: torch.device,
               name: str) -> ReplicaGroup:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
            return ReplicaGroup(pg, "gloo", torch.device("cpu"), timeout_s)
        if backend != "nccl":
            raise ValueError(f"replica group: unknown backend '{backend}'")
        torch.cuda.set_device(device)
        # Integer seconds, read once per process: bounds a non-blocking communicator's init and abort.
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(timeout_s * 2))))
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.blocking = 0
        opts._timeout = timedelta(seconds=4 * timeout_s + 60)  # the watchdog must never fire before ``wait``
        opts.group_name = name
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"):
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        pg.eager_connect_single_device(device)
        return ReplicaGroup(pg, "nccl", device, timeout_s)

    def allreduce(self, tensor: torch.Tensor) -> Any:
        """Start a sum all-reduce of ``tensor`` (on ``device``) in place; returns the work."""
        return self.pg.allreduce([tensor])

    def allgather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> Any:
        return self.pg.allgather([out], [tensor])

    def wait(self, work: Any) -> None:
        """Block the CPU until ``work`` is done; raise (a ``RuntimeError``/``DistError``) when a peer failed.

        gloo raises by itself (reset connection, or the group's timeout).  NCCL: a bounded wait
        (see the module docstring) that aborts the communicator and raises at the deadline."""
        if self.backend == "nccl":
            work.wait(timedelta(seconds=self.timeout_s))
        else:
            work.wait()

    def abort(self) -> None:
        """Close the group's connections now: a peer blocked in one of its collectives fails at once."""
        try:
            self.pg.abort()
        except (RuntimeError, AttributeError):
            pass  # a backend without abort: its connections close when it is collected
