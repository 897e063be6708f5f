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
- backward: dense gradients go through ``DenseGradReducer`` instead of DDP:
  their own process group, so they never queue ahead of the embedding-gradient
  all-to-all (the fused embedding update waits on it), cut into chunks with a
  bounded number in flight, issued as backward produces them;
- on CUDA torchrec's data-dist stream runs at high priority; ``comm =
  "copy_engine"`` selects the SM-free path, which is not wired in yet
  (``freescale.kernels.copy_engine`` holds the primitive; the option says so).

On CPU with gloo the overlap is real too: gloo runs collectives on its own
threads, and every wait is on an async work handle.
"""

from __future__ import annotations

import abc

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from freescale.comm_trace import CommTracer, phase
from freescale.config import require
from freescale.dataloader.batch import Batch
from freescale.dense_reducer import DenseGradReducer
from freescale.parallelize import dense_named_parameters

PIPELINES = ("plain", "torchrec", "prioritized")
COMMS = ("nccl", "copy_engine")

StepOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(loss, logits, labels) of the batch the step trained."""


@dataclass
class PipelineConfig:
    kind: str = "plain"
    """``plain`` | ``torchrec`` | ``prioritized`` (see ``freescale.pipeline``)."""
    comm: str = "nccl"
    """GPU transport for the embedding exchange: ``nccl`` or ``copy_engine`` (SM-free, CUDA only)."""
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
    def uses_ddp(self) -> bool:
        return self.kind != "prioritized"


class StepPipeline(abc.ABC):
    """``progress(batches)`` trains one batch; the pipeline may read further batches ahead.

    The caller hands an iterator that ends where the pipeline must be empty
    (checkpoint, end of training): every batch it yields is trained by some
    ``progress`` call, in order.  ``detach()`` returns the model usable on its
    own (for evaluation).
    """

    @abc.abstractmethod
    def progress(self, batches: Iterator[Batch]) -> StepOutput: ...

    @abc.abstractmethod
    def detach(self) -> nn.Module: ...


class PlainPipeline(StepPipeline):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device

    def progress(self, batches: Iterator[Batch]) -> StepOutput:
        batch = next(batches).to(self.device, non_blocking=True)
        self.optimizer.zero_grad()
        with phase("forward"):
            loss, (_, logits, labels) = self.model(batch)
        with phase("backward"):
            loss.backward()
        self.optimizer.step()
        return loss.detach(), logits, labels

    def detach(self) -> nn.Module:
        return self.model


class _TorchrecPipeline(StepPipeline):
    """Adapter over torchrec's ``TrainPipelineSparseDist`` (and our subclass of it)."""

    def __init__(self, pipeline: TrainPipelineSparseDist[Batch, Any]) -> None:
        self.pipeline = pipeline

    def progress(self, batches: Iterator[Batch]) -> StepOutput:
        loss, logits, labels = self.pipeline.progress(batches)
        return loss, logits, labels

    def detach(self) -> nn.Module:
        return self.pipeline.detach()


class _PrioritizedSparseDist(TrainPipelineSparseDist[Batch, Any]):
    """torchrec's three-stage pipeline with our backward: dense gradients at low priority."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, reducer: DenseGradReducer
    ) -> None:
        def forward(batch: Batch | None) -> Any:
            with phase("forward"):
                return model(batch)

        super().__init__(model, optimizer, device, custom_model_fwd=forward)
        self.reducer = reducer

    def _backward(self, losses: torch.Tensor) -> None:
        with phase("backward"):
            self.reducer.begin()
            losses.backward()
            self.reducer.finish()


class _TracedTorchrecSparseDist(TrainPipelineSparseDist[Batch, Any]):
    """Unchanged torchrec pipeline; only labels forward/backward for the comm tracer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        def forward(batch: Batch | None) -> Any:
            with phase("forward"):
                return model(batch)

        super().__init__(model, optimizer, device, custom_model_fwd=forward)

    def _backward(self, losses: torch.Tensor) -> None:
        with phase("backward"):
            super()._backward(losses)


def build_pipeline(
    cfg: PipelineConfig,
    dmp: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    tracer: CommTracer | None = None,
) -> StepPipeline:
    """The configured pipeline over an already sharded model (``shard_model(data_parallel=cfg.uses_ddp)``)."""
    if cfg.comm == "copy_engine":
        if device.type != "cuda":
            raise RuntimeError(
                "pipeline.comm = 'copy_engine' moves bytes with CUDA copy engines and needs a GPU; "
                "on CPU use 'nccl' (gloo carries it)"
            )
        raise NotImplementedError(
            "pipeline.comm = 'copy_engine': the SM-free all-to-all exists (freescale.kernels.copy_engine) but is "
            "not yet wired into torchrec's output dist, and has not run on a GPU; use 'nccl'"
        )
    if cfg.kind == "plain":
        return PlainPipeline(dmp, optimizer, device)
    if cfg.kind == "torchrec":
        return _TorchrecPipeline(_TracedTorchrecSparseDist(dmp, optimizer, device))
    group = dist.new_group(backend=dist.get_backend())
    if tracer is not None:
        tracer.label(group, "dense")
    reducer = DenseGradReducer(list(dense_named_parameters(dmp).values()), group, chunk_bytes=cfg.chunk_kb * 1024,
                               max_inflight=cfg.max_inflight)
    return _TorchrecPipeline(_PrioritizedSparseDist(dmp, optimizer, device, reducer))
