"""Embedding tables initialized the same whatever the plan put where.

torchrec draws each local shard's initial rows from the process's random generator, in the order its plan
put shards on the rank: a table's first values depend on which other tables share its rank, so a group of 1
rank and one of 2 (or 64) start from different models, and a run cannot be compared with a reference run at
another size.  Here every table is drawn by blocks of ``BLOCK_ROWS`` rows, each block from its own generator
seeded by (seed, table, block), with torchrec's bounds (its config's uniform ``init_fn``: ``weight_init_min``
/ ``max``, by default +-sqrt(1/rows)), and each rank copies into its shards their rows and columns of the blocks they
overlap: table-, row-, column-wise or replicated, on any number of ranks, the values are the same (on one device
type: a CUDA generator's stream is not a CPU one's).  Rows are generated on the shard's device, a block at a
time, so a rank draws at most one block more than it holds at each shard edge.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import torch
from torch import nn

from freescale.reshard import sharded_tensor_calls

EMBEDDING_MODULES = ("embedding_bags", "embeddings")
"""Where torchrec's collections keep their tables (``...embedding_bags.<table>.weight``)."""
BLOCK_ROWS = 4096
"""Rows drawn from one generator: small enough that a shard's edges cost little, large enough that a table of
10^8 rows needs ~24k generators."""


def table_bounds(model: nn.Module) -> dict[str, tuple[float, float]]:
    """(low, high) of every embedding table of the unsharded ``model`` that torchrec initializes uniformly (its
    config's default ``init_fn``), by table name; a table with an ``init_fn`` of its own keeps torchrec's init."""
    bounds: dict[str, tuple[float, float]] = {}
    for module in model.modules():
        configs = getattr(module, "embedding_bag_configs", None) or getattr(module, "embedding_configs", None)
        if not callable(configs):
            continue
        for config in configs():
            init = config.init_fn
            if init is None:
                default = math.sqrt(1.0 / config.num_embeddings)
                bounds[config.name] = (-default, default)
            elif isinstance(init, functools.partial) and init.func is nn.init.uniform_ and not init.args:
                bounds[config.name] = (float(init.keywords.get("a", 0.0)), float(init.keywords.get("b", 1.0)))
    return bounds


@sharded_tensor_calls
def init_tables(state: dict[str, Any], bounds: dict[str, tuple[float, float]], seed: int) -> None:
    """Overwrite every table weight in ``state`` (a sharded model's ``state_dict``: its local shards are views of
    the tables) with the plan-independent values of the module docstring."""
    for key, value in state.items():
        parts = key.split(".")
        if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in bounds or parts[-3] not in EMBEDDING_MODULES:
            continue
        table = parts[-2]
        shards = [(s.tensor, *s.metadata.shard_offsets) for s in value.local_shards()] \
            if hasattr(value, "local_shards") else [(value, 0, 0)]
        rows = value.size(0)
        width = value.size(1)
        for tensor, row0, col0 in shards:
            _fill(tensor, table, int(row0), int(col0), rows, width, bounds[table], seed)


def _fill(shard: torch.Tensor, table: str, row0: int, col0: int, rows: int, width: int,
          bounds: tuple[float, float], seed: int) -> None:
    """Rows ``row0 ..`` and columns ``col0 ..`` of ``table`` (``rows`` x ``width`` in all) into ``shard``."""
    end = row0 + shard.size(0)
    cols = slice(col0, col0 + shard.size(1))
    generator = torch.Generator(device=shard.device)
    with torch.no_grad():
        for block in range(row0 // BLOCK_ROWS, -(-end // BLOCK_ROWS)):
            first, last = block * BLOCK_ROWS, min((block + 1) * BLOCK_ROWS, rows)
            generator.manual_seed(_block_seed(seed, table, block))
            values = torch.empty(last - first, width, device=shard.device, dtype=torch.float32)
            values.uniform_(*bounds, generator=generator)
            lo, hi = max(first, row0), min(last, end)
            shard[lo - row0:hi - row0].copy_(values[lo - first:hi - first, cols])


def _block_seed(seed: int, table: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{table}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)
