"""``Batch``: what one rank feeds its model for one step.

Shapes (legend: B samples on this rank, D dense width, T jagged values):
    sparse  KeyedJaggedTensor, keys as the model asks (for example
            ``history_item_ids`` with lengths_B and values_T, ``candidate_item_id``
            with one id per sample)
    dense   float32 [B, D]
    labels  float32 [B]
    costs   float32 [B], the planner's cost of each sample (for logs and calibration)
    history_timestamps  int64 [T] seconds, aligned with ``history_item_ids``' values, and
    candidate_timestamps  int64 [B]: only for a model that reads them (``reads_timestamps``)
    loss_scale  the factor on the *sum* of per-sample losses that makes DDP's mean over
            ranks equal the mean over the step's samples: live ranks / samples in the step
            (ranks may hold different numbers of samples)

It implements torchrec's ``Pipelineable`` (``to``, ``record_stream``,
``pin_memory``) so torchrec's train pipelines can move it between streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    costs: torch.Tensor | None = None
    loss_scale: float | None = None
    history_timestamps: torch.Tensor | None = None
    candidate_timestamps: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            costs=self.costs,
            loss_scale=self.loss_scale,
            history_timestamps=_to(self.history_timestamps, device, non_blocking),
            candidate_timestamps=_to(self.candidate_timestamps, device, non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse.record_stream(stream)
        self.dense.record_stream(stream)
        self.labels.record_stream(stream)
        for t in (self.history_timestamps, self.candidate_timestamps):
            if t is not None:
                t.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(
            sparse=self.sparse.pin_memory(), dense=self.dense.pin_memory(), labels=self.labels.pin_memory(),
            costs=self.costs, loss_scale=self.loss_scale,
            history_timestamps=None if self.history_timestamps is None else self.history_timestamps.pin_memory(),
            candidate_timestamps=None if self.candidate_timestamps is None else self.candidate_timestamps.pin_memory(),
        )


def _to(t: torch.Tensor | None, device: torch.device, non_blocking: bool) -> torch.Tensor | None:
    return None if t is None else t.to(device=device, non_blocking=non_blocking)
