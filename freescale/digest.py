"""A fingerprint of the whole training state, equal on two runs only if every bit is.

Each rank hashes what it holds (dense parameters, its embedding shards, both
optimizers' state; sorted keys, raw bytes) with SHA-256; the ranks' 32-byte
digests are all-gathered as a uint8 tensor (no pickling) and hashed again in
rank order.  Pipelines are compared with it in tests; fault-tolerant replicas
use it to prove they are identical.

``logical_digest`` fingerprints the same values however they are sharded: every element is mixed with
its place in the logical tensor (row and column, from the shard's offsets) and the mixes are summed
modulo 2**64, on each rank and then across the ranks; a replicated tensor counts once (rank 0's).  Two
runs whose tables are sharded differently (another plan, another world size) compare with it.
``audit_digest`` is the fault-tolerance audit's: the logical digest of a group's model and optimizer state
(replica groups of different sizes compare), with a check that the group's ranks agree on what they replicate.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
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


_ROW_MIX, _COL_MIX = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_LANES = (np.uint64(0), np.uint64(0xD6E8FEB86659FD93))
"""Two independent sums (the second with every element's mix seeded differently): a 128-bit fingerprint."""


def _key_seed(key: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def _mixed_sums(values: torch.Tensor, row0: int, col0: int, seed: np.uint64) -> list[int]:
    """Per lane, the sum (mod 2**64) of a splitmix64 of each element's bits, its logical place (``row0``,
    ``col0``: the shard's offsets; a 1-D tensor is one column) and its entry (``seed``)."""
    v = values.detach().float().cpu().contiguous().numpy()
    table = v.reshape(v.shape[0], -1) if v.ndim else v.reshape(1, 1)
    out = []
    with np.errstate(over="ignore"):
        rows = (np.arange(table.shape[0], dtype=np.uint64) + np.uint64(row0))[:, None]
        cols = (np.arange(table.shape[1], dtype=np.uint64) + np.uint64(col0))[None, :]
        placed = table.view(np.uint32).astype(np.uint64) ^ (rows * _ROW_MIX) ^ (cols * _COL_MIX) ^ seed
        for lane in _LANES:
            x = placed ^ lane
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
            out.append(int(x.sum(dtype=np.uint64)))
    return out


def _local_sums(key: str, value: Any, first: bool) -> list[int]:
    """This rank's mixed sums of one state entry: a ShardedTensor's local shards at their offsets; a plain
    tensor (replicated on every rank) on the group's first rank only."""
    seed, total = _key_seed(key), [0] * len(_LANES)
    if hasattr(value, "local_shards"):  # ShardedTensor
        parts = [(shard.tensor, [*shard.metadata.shard_offsets, 0, 0]) for shard in value.local_shards()]
    elif isinstance(value, torch.Tensor) and first:
        parts = [(value.to_local() if hasattr(value, "to_local") else value, [0, 0])]
    else:
        parts = []
    for tensor, offsets in parts:
        total = [(a + b) % 2**64 for a, b in zip(total, _mixed_sums(tensor, offsets[0], offsets[1], seed))]
    return total


def logical_digest(state: dict[str, Any], group: Any = None) -> str:
    """Hex SHA-256 of ``state``'s (a flat ``state_dict``) elements, each mixed with its entry's name and its place
    in the logical tensor, summed over the entries and the ranks (module docstring; a collective over ``group``
    when distributed).  One fixed-size all-reduce: ranks may hold different entries (a rank without a shard of
    a table may list no optimizer state for it)."""
    distributed = dist.is_initialized()
    first = not distributed or dist.get_rank(group) == 0
    total = [0] * len(_LANES)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            total = [(a + b) % 2**64 for a, b in zip(total, _local_sums(str(key), value, first))]
    sums = torch.tensor(total, dtype=torch.uint64).view(torch.int64)
    if distributed:
        dist.all_reduce(sums, group=group)  # int64 addition wraps as the uint64 sums do
    return hashlib.sha256(sums.view(torch.uint64).numpy().tobytes()).hexdigest()


def flat_tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state (dicts, lists; an optimizer's ``state_dict``) by dotted path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    return {path: t for key, item in items for path, t in flat_tensors(item, f"{prefix}.{key}" if prefix else str(key)).items()}


def _stored_in(value: torch.Tensor, skip: frozenset[int]) -> bool:
    return any(t.untyped_storage().data_ptr() in skip for t in local_tensors(value))


def audit_digest(model: torch.nn.Module, optimizer: Any, skip: frozenset[int] = frozenset(),
                 group: Any = None) -> str:
    """The audit's fingerprint of a group's committed state (a collective over ``group``): ``logical_digest`` of
    its model and optimizer state, equal between groups that hold the same values however many ranks they run
    on and however their tables are sharded; tensors stored in ``skip`` left out (``state_digest``).  The ranks'
    SHA-256s of what they each hold whole (dense parameters, replicated tables, their optimizer state) are
    compared too: ``:ranks-differ`` is appended when they are not all equal (a replica would then count one
    rank's copy only)."""
    flat = {k: v for k, v in flat_tensors({"model": model.state_dict(), "optim": optimizer.state_dict()}).items()
            if not (skip and _stored_in(v, skip))}
    logical = logical_digest(flat, group)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return logical
    whole = local_digest({k: v for k, v in flat.items() if not hasattr(v, "local_shards")})
    mine = torch.frombuffer(bytearray(whole), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return logical if all(torch.equal(g, mine) for g in gathered) else f"{logical}:ranks-differ"
