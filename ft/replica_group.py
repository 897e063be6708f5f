"""The replica-dimension process group of one quorum: gloo over host buffers, or NCCL over device ones.

FTAR (``freescale.ft.weighted_reduce``: during backward and after it) and
the sparse exchange (``freescale.ft.sparse_sync``) run their cross-group
collectives through a ``ReplicaGroup``: the process group, the device its
buffers live on, and a wait that is bounded and turns a dead or hung peer into
an exception on the calling (CPU) thread, which ``ReplicaSync`` answers by
aborting the group and redoing the step with the survivors.

Every wait also stops early when the lighthouse says the quorum is lost
(``LighthouseClient.quorum_lost``: a failure was reported, a participant's
heartbeat timed out or it restarted, or a newer quorum formed without this
rank): a hung peer then stalls the survivors for the heartbeat timeout, not
the collective timeout, and on NCCL a peer whose death raises no transport
error at all is found the same way.

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
  so ``wait`` polls the work from the CPU (every 0.2 ms) and, at the deadline,
  on an NCCL error or when the quorum is lost, aborts the communicator (which
  ends the kernels still waiting on the dead peer) and raises here.  The watchdog's own timeout is set well past
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
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from freescale.ft.client import Quorum
from freescale.ft.config import BACKENDS

SHARED_GPUS_ENV = "FREESCALE_GROUPS_SHARE_GPUS"
"""Set to 1 by ``freescale launch`` when replica groups share GPUs (too few for one per rank): NCCL
refuses two ranks on one GPU, so ``auto`` then means gloo."""


def resolve_backend(requested: str, device: torch.device) -> str:
    """``auto`` -> ``nccl`` for a CUDA rank with a GPU of its own where torch has NCCL, else ``gloo``.
    Errors name ``ft.replica_backend``."""
    if requested not in BACKENDS:
        raise ValueError(f"ft.replica_backend: must be one of {', '.join(BACKENDS)}, got '{requested}'")
    shared = os.environ.get(SHARED_GPUS_ENV) == "1"
    nccl_ok = device.type == "cuda" and dist.is_nccl_available() and not shared
    if requested == "auto":
        return "nccl" if nccl_ok else "gloo"
    if requested == "nccl" and not nccl_ok:
        why = (f"this rank trains on {device}, not a GPU" if device.type != "cuda" else
               "this torch has no NCCL" if not dist.is_nccl_available() else
               f"replica groups share GPUs here ({SHARED_GPUS_ENV}=1) and NCCL refuses two ranks on one GPU")
        raise ValueError(f"ft.replica_backend: 'nccl' needs a GPU of its own per rank and a torch built with NCCL "
                         f"({why}); use 'gloo' or 'auto'")
    return requested


_ENV_LOCK = threading.Lock()
"""Groups are made on rendezvous threads: the environment is changed under this lock only."""


@contextmanager
def _env(**values: str) -> Iterator[None]:
    with _ENV_LOCK:
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


def _let_go(remains: list[Any], pending: list[Any], until: float) -> None:
    while time.monotonic() < until and not all(_done(w) for w in pending):
        time.sleep(0.05)
    pending.clear()
    remains.clear()  # the destructors run here, on this thread, however long they block


def _done(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except (RuntimeError, dist.DistError):
        return True  # completed with an error


@dataclass
class ReplicaGroup:
    """One quorum's process group at one rank position, and where its buffers live."""

    pg: Any
    """A ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` backend (``allreduce``, ``allgather``, ``abort``)."""
    backend: str
    device: torch.device
    """Where FTAR's buffers must be for this group: the host for gloo, the rank's GPU for NCCL."""
    timeout_s: float
    lost: Callable[[], bool] = lambda: False
    """True once the lighthouse says this group's quorum cannot complete a collective."""
    _aborted: bool = False
    _pending: list[Any] = field(default_factory=list)
    """Work started and not yet waited for to the end (see ``retire``)."""

    @staticmethod
    def of(group: ReplicaGroup | Any, timeout_s: float = 30.0) -> ReplicaGroup:
        """A bare process group (tests, tools) is taken as a gloo group over host buffers."""
        return group if isinstance(group, ReplicaGroup) else ReplicaGroup(group, "gloo", torch.device("cpu"), timeout_s)

    @staticmethod
    def create(backend: str, store: Any, rank: int, size: int, timeout_s: float, device: torch.device,
               name: str, lost: Callable[[], bool] = lambda: False) -> ReplicaGroup:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
            return ReplicaGroup(pg, "gloo", torch.device("cpu"), timeout_s, lost)
        if backend != "nccl":
            raise ValueError(f"replica group: unknown backend '{backend}'")
        torch.cuda.set_device(device)
        # Integer seconds, read once per process: bounds a non-blocking communicator's init and abort.
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(timeout_s * 2))))
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.blocking = 0
        opts._timeout = timedelta(seconds=4 * timeout_s + 60)  # the watchdog must never fire before ``wait``
        opts.group_name = name  # type: ignore[assignment]  # torch's stub says GroupName, a str
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"):
            nccl = dist.ProcessGroupNCCL(store, rank, size, opts)
        nccl.eager_connect_single_device(device)
        group = ReplicaGroup(nccl, "nccl", device, timeout_s, lost)
        # A non-blocking communicator may still be connecting in the background: one tiny all-reduce,
        # waited for here (bounded, and given up when the quorum is lost), so that the first gradient
        # bucket's collective, started inside backward, finds it ready.
        group.wait(group.allreduce(torch.zeros(1, device=device)))
        return group

    def allreduce(self, tensor: torch.Tensor) -> Any:
        """Start a sum all-reduce of ``tensor`` (on ``device``) in place; returns the work."""
        if self._aborted:
            raise RuntimeError("replica group: used after it was retired (its quorum failed)")
        work = self.pg.allreduce([tensor])
        self._pending.append(work)
        return work

    def allgather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> Any:
        if self._aborted:
            raise RuntimeError("replica group: used after it was retired (its quorum failed)")
        work = self.pg.allgather([out], [tensor])
        self._pending.append(work)
        return work

    SLICE_S = 0.05
    """gloo: the wait blocks in slices this long, checking between them whether the quorum is lost."""

    def wait(self, work: Any) -> None:
        """Block the CPU until ``work`` is done; raise (a ``RuntimeError``/``DistError``) when a peer
        failed, at the group's timeout, or once the quorum is lost (see the module docstring)."""
        deadline = time.monotonic() + self.timeout_s
        if self.backend == "nccl":
            while not work.is_completed():  # raises the communicator's error, if it has one
                if self.lost() or time.monotonic() > deadline:
                    self._give_up("NCCL")
                time.sleep(0.0002)
            work.wait()  # the current stream waits for the collective (the CPU does not)
            self._forget(work)
            return
        while True:
            try:
                work.wait(timedelta(seconds=self.SLICE_S))  # returns at once when it completes
                break
            except (RuntimeError, dist.DistError):
                if work.is_completed():  # it ended (maybe just after the slice ran out): its own outcome
                    work.wait()  # returns, or raises the real error (a peer reset the connection, the timeout)
                    break
            if self.lost():  # still running: a slice ran out
                self._give_up("gloo")
        self._forget(work)

    def _forget(self, work: Any) -> None:
        for i, pending in enumerate(self._pending):
            if pending is work:
                del self._pending[i]
                return

    def _give_up(self, backend: str) -> None:
        lost = self.lost()
        self.retire()
        raise RuntimeError(f"{backend} replica group: "
                           + ("the lighthouse reports its quorum lost (a participant failed, hung past the "
                              "heartbeat timeout or restarted)" if lost else
                              f"collective not done after {self.timeout_s:.1f} s (a peer hung)") + "; aborted")

    def retire(self) -> None:
        """Abort the group and let it go: NCCL's abort ends its kernels; a gloo group's connections
        close once it is destroyed, and a peer blocked in one of its collectives then fails (a hung
        peer's survivors learn it from the lighthouse: ``lost``).

        Destroyed at once (by the caller dropping its references) when none of its work is still
        running.  Otherwise on a thread of its own, once that work has ended or after
        ``timeout_s + 5``: a gloo group's destructor joins its worker threads, one of them still
        blocked on the hung peer; on this thread that would block training until the peer wakes or
        the collective's own timeout fires, which is exactly the wait giving up early avoids."""
        if self._aborted:
            return
        self._aborted = True
        try:
            self.pg.abort()
        except (RuntimeError, AttributeError):
            pass  # a backend without abort: its connections close when it is collected
        pending = [w for w in self._pending if not _done(w)]
        if pending:
            threading.Thread(target=_let_go, args=([self.pg], pending, time.monotonic() + self.timeout_s + 5.0),
                             name="freescale-retired-group", daemon=True).start()
        self.pg, self._pending = None, []


class FanOutGroup(ReplicaGroup):
    """The process groups of every rank position one rank serves (a group that lost ranks: ``positions_served``),
    used as one: each collective runs in every one of them with the same input, the first's result kept (the
    others' are the same bytes, on copies).  Their participants are the same groups in the same order, so the
    quorum index and the weights are the same in each.  It delegates to those groups (their own ``wait`` and
    ``retire`` keep their bounded waits and their release off this thread); ``pg`` and ``device`` are the first's."""

    def __init__(self, groups: list[ReplicaGroup], positions: list[int]) -> None:
        first = groups[0]
        super().__init__(first.pg, first.backend, first.device, first.timeout_s, first.lost)
        self.groups, self.positions = groups, positions
        """``groups[i]`` is rank position ``positions[i]``'s (an exchange whose payload differs by position, the
        union update's table shards, runs in each itself: ``freescale.ft.table_blocks.served_groups``)."""

    def allreduce(self, tensor: torch.Tensor) -> Any:
        copies = [tensor.clone() for _ in self.groups[1:]]  # before the first's in-place reduction starts
        return [self.groups[0].allreduce(tensor), *(g.allreduce(c) for g, c in zip(self.groups[1:], copies))]

    def allgather(self, out: list[torch.Tensor], tensor: torch.Tensor) -> Any:
        return [self.groups[0].allgather(out, tensor),
                *(g.allgather([torch.empty_like(o) for o in out], tensor) for g in self.groups[1:])]

    def wait(self, work: Any) -> None:
        for group, part in zip(self.groups, work):
            group.wait(part)

    def retire(self) -> None:
        for group in self.groups:
            group.retire()


def positions_served(rank: int, ranks: int, group_ranks: int) -> range:
    """The rank positions of the exchange across groups that rank ``rank`` of a group running on ``ranks`` of its
    ``group_ranks`` ranks serves: its own and, when the group lost ranks, every ``ranks``-th one after it (rank
    ``p % ranks`` serves position ``p``)."""
    return range(rank, group_ranks, ranks)


def serving_member(position: int, ranks: int) -> int:
    """The member of a group running on ``ranks`` ranks that serves rank position ``position``."""
    return position % ranks


class ServedPositions:
    """``FTARGroup`` of each rank position this rank serves (``positions_served``), for one quorum at a time: the
    one group when it serves its own position only (a whole group), else a ``FanOutGroup`` over them."""

    def __init__(self, groups: list[FTARGroup]) -> None:
        self.groups = groups
        self._made: tuple[tuple[int, ...], ReplicaGroup] | None = None

    def for_quorum(self, quorum: Quorum) -> ReplicaGroup:
        parts = [g.for_quorum(quorum) for g in self.groups]
        if len(parts) == 1:
            return parts[0]
        key = tuple(id(p) for p in parts)
        if self._made is None or self._made[0] != key:
            self._made = (key, FanOutGroup(parts, [g.position for g in self.groups]))
        return self._made[1]

    def drop(self) -> None:
        self._made = None
        for group in self.groups:
            group.drop()


class RendezvousStore:
    """The ``TCPStore`` that quorums' process groups meet on, hosted by member 0 of each group.

    The lighthouse names the first participant's store in every quorum; every participant's
    rank at each position connects to it under the prefix ``freescale/ftar/q<id>/p<r>``.  Kept
    in the groups, not the lighthouse, so the lighthouse needs no torch and restarts in a
    fraction of a second, and a restart does not move the store of a running quorum."""

    def __init__(self, host: str) -> None:
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"


class FTARGroup:
    """The replica-dimension process group of one rank position for the current quorum."""

    def __init__(self, replica_id: str, position: int, timeout_s: float, backend: str = "gloo",
                 device: torch.device | None = None, quorum_lost: Callable[[int], bool] | None = None) -> None:
        self.replica_id, self.position, self.timeout_s = replica_id, position, timeout_s
        self.quorum_lost = quorum_lost or (lambda quorum_id: False)
        self.device = device or torch.device("cpu")
        self.backend = resolve_backend(backend, self.device)
        self._stores: dict[tuple[str, int], dist.TCPStore] = {}
        self._group: ReplicaGroup | None = None
        self._quorum_id = -1

    def for_quorum(self, quorum: Quorum) -> ReplicaGroup:
        """This quorum's group (made on the first call: every participant's rank at this position
        meets under the quorum's store prefix).  A participant that dies before it arrives would
        hold the others in the rendezvous until the store's timeout: the wait stops as soon as
        the lighthouse says the quorum is lost (``RuntimeError``: the step is redone without it)."""
        if self._group is None or quorum.quorum_id != self._quorum_id:
            if self._group is not None:
                self._group.retire()  # the previous quorum's: nobody uses it any more
                self._group = None
            qid = quorum.quorum_id
            if self.quorum_lost(qid):
                raise RuntimeError(f"quorum {qid}: the lighthouse already reports it lost (a participant failed)")
            if not quorum.store_host:
                raise RuntimeError(f"quorum {qid}: no participant announced a rendezvous store (member 0 of each "
                                   "group hosts one: freescale.ft.replica_group.RendezvousStore)")
            key = (quorum.store_host, quorum.store_port)
            if key not in self._stores:
                self._stores[key] = dist.TCPStore(quorum.store_host, quorum.store_port, is_master=False,
                                                  timeout=timedelta(seconds=max(self.timeout_s, 10)))
            prefix = f"freescale/ftar/q{qid}/p{self.position}"
            # On a thread of its own, so this one can stop waiting (an abandoned one ends at the store's timeout).
            made: Future[ReplicaGroup] = Future()
            threading.Thread(target=_run_into, name="freescale-ftar-rendezvous", daemon=True, args=(
                made, ReplicaGroup.create, self.backend, dist.PrefixStore(prefix, self._stores[key]),
                quorum.index_of(self.replica_id), len(quorum.participants), self.timeout_s, self.device, prefix,
                lambda: self.quorum_lost(qid))).start()
            while True:
                try:
                    self._group = made.result(timeout=0.05)
                    break
                except FutureTimeout:
                    if self.quorum_lost(qid):
                        made.add_done_callback(_retire_late)
                        raise RuntimeError(f"quorum {qid}: the lighthouse reports it lost while its process group "
                                           "was being set up (a participant failed); set-up abandoned") from None
            self._quorum_id = qid
        return self._group

    def drop(self) -> None:
        """Abort and forget the current group after a failure.

        Aborting closes its connections at once, so a peer still blocked in a collective
        on it (waiting for data this rank will never relay) fails now instead of at the
        collective timeout; the survivors then meet in the next quorum's group.
        """
        if self._group is not None:
            self._group.retire()
        self._group, self._quorum_id = None, -1
        self._stores.clear()  # the store's host may have died with its group: connect afresh


def _run_into(future: Future[Any], fn: Callable[..., Any], *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)


def _retire_late(made: Future[ReplicaGroup]) -> None:
    """An abandoned rendezvous that completed after all: let its group go."""
    if made.exception() is None:
        made.result().retire()
