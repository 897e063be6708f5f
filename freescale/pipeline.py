"""Train pipelines: how one step's communication overlaps compute.

``train.pipeline`` picks one; all three compute exactly the same thing (same
losses and parameters, bit for bit: tested), they differ only in what waits
for what.  Legend: H2D = host-to-device copy, input dist = ids all-to-all to
the embedding shards, output dist = embeddings all-to-all back.

``plain``: one batch in flight::

    step i:  H2D(i) -> input dist(i) -> lookup -> output dist(i) -> dense fwd -> bwd (DDP) -> opt

``torchrec``: torchrec's ``TrainPipelineSparseDist``, three batches in flight::

    step i:  [H2D(i+2) on the memcpy stream] [input dist(i+1) on the data-dist stream]
             lookup(i) -> output dist(i) -> dense fwd -> bwd (DDP) -> opt

``prioritized`` (FreeScale techniques 2 and 3): the torchrec pipeline's
batches in flight and streams, plus priority inside the step:

- forward: the models call their embedding modules in priority order: what
  the first dense layers need (the HSTU item sequence; DLRM's tables ahead of
  its bottom MLP) is issued first, side features (HSTU's user embedding)
  next; torchrec awaits each output dist lazily, at first use, so compute
  starts when its own inputs land and side features travel behind it;
- backward: dense gradients go through ``BucketedGrads`` instead of DDP
  (``freescale.grad_buckets``): their own process group, so they never queue
  ahead of the embedding-gradient all-to-all (the fused embedding update
  waits on it), cut into chunks with a bounded number in flight, issued as
  backward produces them;
- ``comm = "copy_engine"`` gives torchrec's sharded modules the SM-free
  backend's process group (``freescale.kernels.sm_free_backend``): every
  embedding all-to-all then moves through it, in the order issued, most
  urgent first where several are in flight.  On CPU its transport is shared
  memory between the host's ranks; on CUDA, CUDA IPC between the GPUs of one
  node, the bytes moved by copy engines (not yet run on a GPU; a group across
  nodes is refused: ``check_comm``).

No pipeline reduces gradients or steps an optimizer itself: at the points
where torchrec's pipelines call ``optimizer.zero_grad()``, ``backward`` and
``optimizer.step()`` they call the step engine (``StepCalls``:
``freescale.step_engine``), which hands them to the step's sync: the local
one, or fault tolerance across replica groups (``freescale.ft.FaultTolerance``).
So every pipeline composes with fault tolerance, and the sync decides when an
update is committed.

On CPU with gloo the overlap is real too: gloo runs collectives on its own
threads, and every wait is on an async work handle.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from freescale.comm_trace import phase
from freescale.config import require
from freescale.dataloader.batch import Batch

PIPELINES = ("plain", "torchrec", "prioritized")
COMMS = ("nccl", "copy_engine")

StepOutput = tuple[torch.Tensor, ...]
"""(loss, *outputs) of the batch the step trained: the model's output (``freescale.tasks``)."""


class StepCalls(Protocol):
    """What a pipeline calls where an optimizer's and a loss's methods would be (the step engine)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...


class SyncedOptimizer:
    """What a torchrec pipeline sees as its optimizer: ``zero_grad`` and ``step`` go to the engine."""

    def __init__(self, calls: StepCalls) -> None:
        self.calls = calls

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        self.calls.step()


@dataclass
class PipelineConfig:
    kind: str = "plain"
    """``plain`` | ``torchrec`` | ``prioritized`` (see ``freescale.pipeline``)."""
    comm: str = "nccl"
    """Transport of the embedding all-to-alls: ``nccl`` (the group's backend: NCCL on CUDA, gloo on CPU) or
    ``copy_engine`` (SM-free: torchrec's sharded modules get a ``freescale_sm_free`` process group,
    ``freescale.kernels.sm_free_backend``; on CPU shared memory between the host's ranks; on CUDA, CUDA IPC between the
    GPUs of one node, not yet run on a GPU)."""
    chunk_kb: int = 256
    """prioritized: dense gradients are all-reduced in chunks of at most this size."""
    max_inflight: int = 2
    """prioritized: at most this many dense chunks outstanding at once."""

    def validate(self) -> None:
        require(self.kind in PIPELINES, "kind", f"must be one of {list(PIPELINES)}, got '{self.kind}'")
        require(self.comm in COMMS, "comm", f"must be one of {list(COMMS)}, got '{self.comm}'")
        require(self.chunk_kb > 0, "chunk_kb", f"must be positive, got {self.chunk_kb}")
        require(self.max_inflight > 0, "max_inflight", f"must be positive, got {self.max_inflight}")

    @property
    def read_ahead(self) -> int:
        """Batches the pipeline holds beyond the one it trains (torchrec's: the next two)."""
        return 0 if self.kind == "plain" else 2

    def uses_ddp(self, fault_tolerant: bool) -> bool:
        """DDP reduces the dense gradients (else ``BucketedGrads``: prioritized, or fault tolerance)."""
        return self.kind != "prioritized" and not fault_tolerant


class StepPipeline(abc.ABC):
    """``progress(batches)`` trains one batch; the pipeline may read further batches ahead.

    The caller hands an iterator that ends where the pipeline must be empty
    (checkpoint, end of training): every batch it yields is trained by some
    ``progress`` call, in order.  ``reset()`` drops batches in flight (a replica
    that must catch up); ``detach()`` returns the model usable on its own (for
    evaluation).
    """

    read_ahead = 0

    @abc.abstractmethod
    def progress(self, batches: Iterator[Batch]) -> StepOutput: ...

    def reset(self) -> None:  # noqa: B027 - optional hook: a pipeline without batches in flight has none to forget
        """Forget batches in flight."""

    @abc.abstractmethod
    def detach(self) -> nn.Module: ...


class PlainPipeline(StepPipeline):
    def __init__(self, model: nn.Module, calls: StepCalls, device: torch.device) -> None:
        self.model, self.calls, self.device = model, calls, device

    def progress(self, batches: Iterator[Batch]) -> StepOutput:
        batch = next(batches).to(self.device, non_blocking=True)
        self.calls.zero_grad()
        with phase("forward"):
            loss, output = self.model(batch)
        with phase("backward"):
            self.calls.backward(loss)
        self.calls.step()
        return tuple(output)

    def detach(self) -> nn.Module:
        return self.model


class _SyncedSparseDist(TrainPipelineSparseDist[Batch, Any]):
    """torchrec's three-stage pipeline whose backward and optimizer step go to the step engine (and on to the
    step's sync)."""

    def __init__(self, model: nn.Module, calls: StepCalls, device: torch.device) -> None:
        def forward(batch: Batch | None) -> Any:
            with phase("forward"):
                return model(batch)

        super().__init__(model, SyncedOptimizer(calls), device, custom_model_fwd=forward)
        self.calls = calls

    def _backward(self, losses: torch.Tensor) -> None:
        with phase("backward"):
            self.calls.backward(torch.sum(losses, dim=0))


class TorchrecPipeline(StepPipeline):
    """``torchrec`` and ``prioritized``: torchrec's batches in flight (they differ in the sync's
    in-group reduction: DDP, or ``BucketedGrads`` on a group of its own)."""

    read_ahead = 2

    def __init__(self, model: nn.Module, calls: StepCalls, device: torch.device) -> None:
        self.pipeline = _SyncedSparseDist(model, calls, device)

    def progress(self, batches: Iterator[Batch]) -> StepOutput:
        return tuple(self.pipeline.progress(batches))

    def reset(self) -> None:
        self.pipeline.reset()

    def detach(self) -> nn.Module:
        return self.pipeline.detach()


def check_comm(cfg: PipelineConfig, device: torch.device, world_size: int, local_world_size: int) -> None:
    """Refuse, in one line, an embedding transport the group cannot have: ``copy_engine`` on CUDA joins the GPUs of
    one node (CUDA IPC and host shared memory), so a group across nodes is refused before it is built."""
    if cfg.comm == "copy_engine" and device.type == "cuda" and local_world_size != world_size:
        raise NotImplementedError(
            f"pipeline.comm = 'copy_engine' on CUDA across nodes ({world_size} ranks, {local_world_size} per node): "
            "the SM-free backend's CUDA transport joins the GPUs of one node only (CUDA IPC); use 'nccl'"
        )


def build_pipeline(cfg: PipelineConfig, dmp: nn.Module, calls: StepCalls, device: torch.device) -> StepPipeline:
    """The configured pipeline over an already sharded model (DDP around its dense part exactly
    when ``cfg.uses_ddp(...)``), calling the step engine where an optimizer would be."""
    pipeline = PlainPipeline(dmp, calls, device) if cfg.kind == "plain" else TorchrecPipeline(dmp, calls, device)
    assert pipeline.read_ahead == cfg.read_ahead
    return pipeline
