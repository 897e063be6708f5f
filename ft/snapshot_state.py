"""What a snapshot holds beyond the model and the optimizers, and how tensors travel in it.

A snapshot (``FaultTolerance.snapshot``, streamed by ``freescale.ft.catchup``) is a flat dict of named
tensors, raw bytes on the wire (no pickle): the model's and the optimizers' state by path
(``named_tensors``; sharded tensors as this rank's local shards), and ``meta.json``, a JSON document of
the rest: the data side's state, a user's LR scheduler, the states a loop registered, and the RNGs.
Tensors inside those (a sampler's permutation, torch's RNG state) are moved out beside it by path
(``to_json``) and put back on load (``from_json``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from freescale.digest import local_tensors

SHARD_MARK = "@"
"""Between a sharded tensor's path and its shard's offsets in a snapshot name."""


def is_shard(name: str) -> bool:
    """Whether a snapshot tensor is a shard of a sharded tensor (a table's rows or their optimizer state)."""
    return SHARD_MARK in name.rsplit("/", 1)[-1]


def named_tensors(value: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor in a (nested) state dict, by path; sharded tensors as their local shards, each named by its
    offsets in the whole tensor (``@row,col``: the same name on whichever rank holds it, one of several shards
    of a table or its only one: a group on fewer ranks holds a lost rank's shards, ``freescale.shrunk_plan``;
    ``is_shard``); any other tensor ``#0``."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from named_tensors(value[key], f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from named_tensors(item, f"{prefix}/{i}")
    elif isinstance(value, torch.Tensor):
        if hasattr(value, "local_shards"):  # ShardedTensor
            for shard in value.local_shards():
                yield f"{prefix}{SHARD_MARK}{','.join(str(int(o)) for o in shard.metadata.shard_offsets)}", shard.tensor
        else:
            for i, t in enumerate(local_tensors(value)):
                yield f"{prefix}#{i}", t


def to_json(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with every tensor moved into ``tensors`` (by path) and a ``{"tensor": path}`` left in its place."""
    if isinstance(value, torch.Tensor):  # a copy: the snapshot is copied out after the caller goes on
        tensors[prefix] = value.detach().to("cpu", copy=True).contiguous()
        return {"tensor": prefix}
    if isinstance(value, dict):
        return {str(k): to_json(v, f"{prefix}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{prefix}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def from_json(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"tensor"} and isinstance(value["tensor"], str) and value["tensor"] in tensors:
            return tensors[value["tensor"]].clone()
        return {k: from_json(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v, tensors) for v in value]
    return value


def rng_state(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Python's, numpy's and torch's (CPU, and CUDA when in use) random states: torch's as tensors."""
    tensors["/rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["/rng/cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    return {"python": [version, list(internal), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}


def set_rng_state(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["/rng/torch"])
    if "/rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["/rng/cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def load_torch_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> set[str]:
    """A plain torch optimizer's per-parameter state from snapshot names ``/optim/state/<i>/<key>#0``;
    the tensors are adopted, not copied (a fetched snapshot's tensors are each its own, or already
    this optimizer's own: landed in place).  Returns the names it loaded."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    names = set()
    for name, t in tensors.items():
        if name.startswith("/optim/state/"):
            index, key = name[len("/optim/state/"):].rsplit("#", 1)[0].split("/", 1)
            state.setdefault(int(index), {})[key] = t
            names.add(name)
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
    return names
