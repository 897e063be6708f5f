"""A fingerprint of the whole training state, equal on two runs only if every bit is.

Each rank hashes what it holds (dense parameters, its embedding shards, both
optimizers' state; sorted keys, raw bytes) with SHA-256; the ranks' 32-byte
digests are all-gathered as a uint8 tensor (no pickling) and hashed again in
rank order.  Pipelines are compared with it in tests; fault-tolerant replicas
use it to prove they are identical.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist


def local_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors this rank holds in ``value`` (nested dicts/lists; sharded tensors as their local shards)."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "local_shards"):  # ShardedTensor
            return [shard.tensor for shard in value.local_shards()]
        if hasattr(value, "to_local"):  # DTensor
            return [value.to_local()]
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in local_tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in local_tensors(item)]
    return []


def local_digest(state: dict[str, Any], skip: frozenset[int] = frozenset()) -> bytes:
    """This rank's SHA-256 of ``state``; tensors whose storage is one of ``skip`` (``data_ptr``s) left out."""
    h = hashlib.sha256()
    for key in sorted(state, key=str):
        h.update(str(key).encode())
        for t in local_tensors(state[key]):
            if skip and t.untyped_storage().data_ptr() in skip:
                continue
            h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()


def state_digest(model: torch.nn.Module, optimizer: Any, skip: frozenset[int] = frozenset()) -> str:
    """Hex SHA-256 over all ranks' model and optimizer state (a collective: call on every rank); tensors
    whose storage is one of ``skip`` left out (tables averaged across groups less often than every step)."""
    return group_digest(local_digest({"model": model.state_dict(), "optim": optimizer.state_dict()}, skip))


def group_digest(local: bytes) -> str:
    """Hex SHA-256 over every rank's ``local`` digest, in rank order (a collective: call on every rank)."""
    mine = torch.frombuffer(bytearray(local), dtype=torch.uint8)
    if not dist.is_initialized():
        return hashlib.sha256(mine.numpy().tobytes()).hexdigest()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    gathered = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.to(device))
    return hashlib.sha256(b"".join(g.cpu().numpy().tobytes() for g in gathered)).hexdigest()
