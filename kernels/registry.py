"""Per-op implementation registry: the selector every kernel shares.

Each op (attention, fused norm) keeps one :class:`KernelRegistry`.  The torch
reference registers first and runs everywhere; a Triton implementation
registers itself when Triton imports and becomes the ``"auto"`` choice for CUDA
tensors.  Callers pass ``backend="auto" | "reference" | "triton" | ...``; an
unknown name is an error that lists what exists.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch

Impl = TypeVar("Impl")


class KernelRegistry(Generic[Impl]):
    def __init__(self, op: str, reference: Impl) -> None:
        self.op = op
        self._impls: dict[str, Impl] = {"reference": reference}
        self._cuda_preferred: list[str] = []

    def register(self, name: str, impl: Impl, preferred_on_cuda: bool = True) -> None:
        """Make ``impl`` selectable as ``backend=name``."""
        self._impls[name] = impl
        if preferred_on_cuda and name not in self._cuda_preferred:
            self._cuda_preferred.append(name)

    def names(self) -> list[str]:
        return sorted(self._impls)

    def select(self, backend: str, device: torch.device) -> str:
        """``auto``: the first registered CUDA kernel on CUDA tensors, else the reference."""
        if backend == "auto":
            if device.type == "cuda" and self._cuda_preferred:
                return self._cuda_preferred[0]
            return "reference"
        if backend not in self._impls:
            raise ValueError(f"{self.op} backend '{backend}' is not available (have: auto, {', '.join(self.names())})")
        return backend

    def get(self, backend: str, device: torch.device) -> Impl:
        return self._impls[self.select(backend, device)]
