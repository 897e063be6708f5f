"""Process-group set-up for one replica group: gloo on CPU, NCCL on CUDA, same code.

Under torchrun the usual environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) describe the group.  Without them the process runs as
a group of one over an in-memory store, so the Python API and tests work in a
plain interpreter too.  ``shutdown`` ends with a barrier and
``destroy_process_group``: a gloo process that exits without them aborts
("terminate called without an active exception") more often than not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from freescale.config import require


@dataclass
class DistConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: NCCL when CUDA is available, else gloo."""
    timeout_s: float = 300.0

    def validate(self) -> None:
        require(self.timeout_s > 0, "timeout_s", f"must be positive, got {self.timeout_s}")


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    owns_group: bool
    """True when ``init_distributed`` created the process group (and must destroy it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: DistConfig) -> DistContext:
    """Join (or create) the default process group and pick this rank's device."""
    use_cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("dist.backend = 'nccl' needs CUDA, and none is available; use 'gloo' or 'auto'")
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(
                backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
            )
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        owns = True
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=device,
        backend=dist.get_backend(),
        owns_group=owns,
    )


def init_process_group(backend: Literal["auto", "gloo", "nccl"] = "auto", timeout_s: float = 300.0) -> DistContext:
    """``dist.init_process_group`` for a rank under torchrun or ``freescale launch`` (``freescale.ft.init_process_group``),
    safe across the agent's restarts under either (a store prefix per incarnation), and this rank's device.
    Plain ``dist.init_process_group`` also works under ``freescale launch``, which gives every incarnation a
    fresh store; under bare torchrun it does not."""
    cfg = DistConfig(backend=backend, timeout_s=timeout_s)
    cfg.validate()
    return init_distributed(cfg)


def side_group(ctx: DistContext) -> dist.ProcessGroup | None:
    """A gloo group for the training thread's small asynchronous collectives (the speed check's all-gather,
    ``freescale.rank_speed``; the saves' busy poll, ``freescale.training_saves``): each asked after one step's
    commit and read at the next (or, a save nobody asked about ahead, at once), in the same order on every rank,
    beside the training's collectives rather than queued among them (and a CPU backend for their CPU tensors
    under NCCL).  None for one rank.  Collective: every rank of the process group creates it at the same
    point."""
    return dist.new_group(backend="gloo") if dist.is_initialized() and ctx.world_size > 1 else None


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The rendezvous store for this (re)start of the group.

    Under torchrun's elastic agent the ranks share the agent's TCPStore, and it is
    the *same* store after a restart: the previous attempt's keys (each rank's gloo
    address) are still there.  A restarted rank that reads a peer's key before the
    peer rewrites it gets the dead process's address, and the group's creation
    then fails ("Connection refused") or hangs; seen here in about 1 of 3
    restarts.  A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps each
    attempt's keys apart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
        is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ["RANK"] == "0",
        timeout=timeout,
    )
    return dist.PrefixStore(f"/freescale/attempt_{attempt}", base)


def shutdown(ctx: DistContext, clean: bool = True) -> None:
    """Destroy the group if we created it; after a barrier when every rank ends together
    (``clean``), without one when leaving on an error (a barrier could wait for a dead peer)."""
    if ctx.owns_group and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def spans_ranks(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the world) has more than this process: collectives are needed."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s collectives take: this process's current CUDA
    device when the group's backend includes NCCL, else the CPU (gloo)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def summed_counts(ctx: DistContext, counts: dict[str, int]) -> dict[str, int]:
    """``counts`` summed over the group's ranks, keyed by the union of their keys (collective).  JSON over
    two all-gathers (lengths, then padded bytes): no pickle.  For reports, not for steps."""
    import json

    if ctx.world_size == 1:
        return dict(counts)
    device = collective_device()  # NCCL's default group has no CPU backend
    mine = torch.tensor(list(json.dumps(counts).encode()), dtype=torch.uint8, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(ctx.world_size)]
    dist.all_gather(lengths, torch.tensor([len(mine)], dtype=torch.int64, device=device))
    longest = int(max(int(n) for n in lengths))
    padded = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(ctx.world_size)]
    dist.all_gather(padded, torch.nn.functional.pad(mine, (0, longest - len(mine))))
    total: dict[str, int] = {}
    for length, data in zip(lengths, padded):
        for key, value in json.loads(bytes(data[:int(length)].cpu().tolist())).items():
            total[key] = total.get(key, 0) + int(value)
    return total

