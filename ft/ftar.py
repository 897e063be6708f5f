"""Fault-tolerant all-reduce (FTAR) of dense gradients across replica groups.

Rank position ``r`` of every participating group forms one gloo process group
per quorum (rendezvous through the lighthouse's TCPStore under the prefix
``freescale/ftar/q<quorum id>/p<r>``, so a new quorum never reads an old
quorum's keys), ranked by the quorum's sorted participant order.

Averaging is by samples, not by participants: each replica sends
``[sum_i w * g_i, w]`` where ``w`` is the number of samples its gradients
average over, and everyone divides the summed gradients by the summed weights.
With unequal batches (balanced loader, a group that lost ranks, a recovering
group contributing ``w = 0``) this is the exact mean over all the samples of
the step; torchft's division by the participant count is not.  Gloo's ring
all-reduce hands every rank the same reduced bytes and the division is local
and identical, so replicas stay bit-identical.

``ReplicaSync.reduce_and_commit`` is one step's exchange: reduce in the
current quorum; on any collective failure (a peer died: connection reset; or
hung: timeout) report the quorum broken; then vote.  Only a unanimous vote
commits; otherwise ask for the next quorum (the dead group is out) and reduce
again **with the gradients this replica still holds** (inputs are never
reduced in place), so the step commits with the survivors: no step is
discarded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from freescale.ft.client import LighthouseClient, Quorum


class FTARGroup:
    """The gloo process group of one rank position for the current quorum."""

    def __init__(self, replica_id: str, position: int, timeout_s: float) -> None:
        self.replica_id, self.position, self.timeout_s = replica_id, position, timeout_s
        self._stores: dict[tuple[str, int], dist.TCPStore] = {}
        self._group: dist.ProcessGroup | None = None
        self._quorum_id = -1

    def for_quorum(self, quorum: Quorum) -> dist.ProcessGroup:
        if self._group is None or quorum.quorum_id != self._quorum_id:
            key = (quorum.store_host, quorum.store_port)
            if key not in self._stores:
                self._stores[key] = dist.TCPStore(quorum.store_host, quorum.store_port, is_master=False,
                                                  timeout=timedelta(seconds=max(self.timeout_s, 10)))
            store = dist.PrefixStore(f"freescale/ftar/q{quorum.quorum_id}/p{self.position}", self._stores[key])
            self._group = dist.ProcessGroupGloo(store, quorum.index_of(self.replica_id), len(quorum.participants),
                                                timedelta(seconds=self.timeout_s))
            self._quorum_id = quorum.quorum_id
        return self._group

    def drop(self) -> None:
        """Forget the current group (after a failure its peers may be gone)."""
        self._group, self._quorum_id = None, -1


def weighted_all_reduce(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], weight: float) -> list[torch.Tensor]:
    """``sum_r w_r t_r / sum_r w_r`` over the group; inputs are left untouched."""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) * weight for t in tensors]
                     + [torch.tensor([float(weight)])])
    group.allreduce([flat]).wait()
    total = float(flat[-1])
    if total <= 0:
        raise RuntimeError("weighted all-reduce: every participant has weight 0")
    out, offset = [], 0
    for t in tensors:
        out.append((flat[offset:offset + t.numel()] / total).view(t.shape).to(t.dtype))
        offset += t.numel()
    return out


@dataclass
class StepResult:
    tensors: list[torch.Tensor]
    quorum: Quorum
    attempts: int
    """1 when the first quorum committed; more when the step was redone with survivors."""
    seconds: float


class ReplicaSync:
    """One rank position's side of FT-HSDP's gradient exchange (see module docstring)."""

    def __init__(self, client: LighthouseClient, position: int = 0, timeout_s: float = 5.0) -> None:
        self.client = client
        self.group = FTARGroup(client.replica_id, position, timeout_s)
        self._pending: Future[Quorum] | None = None
        self.quorum: Quorum | None = None

    def start_step(self, step: int) -> None:
        """Ask for the step's quorum now; the answer is read in ``reduce_and_commit``."""
        self._pending = self.client.quorum_async(step)

    def reduce_and_commit(self, step: int, tensors: Sequence[torch.Tensor], weight: float) -> StepResult:
        start = time.perf_counter()
        quorum = self._pending.result() if self._pending is not None else self.client.quorum(step)
        self._pending = None
        attempts = 0
        while True:
            attempts += 1
            if quorum.max_step > step:
                raise RuntimeError(
                    f"replica '{self.client.replica_id}' is at step {step} but quorum {quorum.quorum_id} is at step "
                    f"{quorum.max_step}: it would need to catch up from a peer first, which is not built yet"
                )
            reduced: list[torch.Tensor] | None = None
            try:
                reduced = weighted_all_reduce(self.group.for_quorum(quorum), tensors, weight)
            except (RuntimeError, dist.DistError):
                self.group.drop()
                self.client.report_failure(quorum.quorum_id)
            if self.client.commit(quorum.quorum_id, step, reduced is not None) and reduced is not None:
                self.quorum = quorum
                return StepResult(reduced, quorum, attempts, time.perf_counter() - start)
            self.group.drop()
            quorum = self.client.quorum(step)
