"""What the fault-tolerance layer reduces of a model, and the models it refuses (``FaultTolerance`` at set-up).

The layer reduces the dense gradients itself, in the group and across groups: a torchrec DMP's parameters
outside its sharded modules, and the dense kernels' weights of its ``data_parallel`` tables; a plain module's
every trainable parameter.  A model wrapped in DDP, or a ``data_parallel`` table no optimizer steps, is
refused in one line (either would leave the groups identical but wrong, so no later check would see it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def reduced_parts(model: nn.Module, optimizer: Any) -> tuple[list[nn.Parameter], list[nn.Parameter],
                                                             list[torch.optim.Optimizer]]:
    """(The parameters the layer reduces, the dense ones among them (clipped), the optimizers that step them:
    ``optimizer``'s, or a torchrec ``CombinedOptimizer``'s other than the model's fused one.)"""
    reduced, dense = reduced_parameters(model)
    fused = getattr(model, "fused_optimizer", None)
    optimizers = [opt for _, opt in getattr(optimizer, "optimizers", [("", optimizer)]) if opt is not fused]
    refuse_unstepped_tables(model, optimizers)
    return reduced, dense, optimizers


def reduced_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(The parameters whose gradients this layer reduces, the dense ones among them.)  A torchrec DMP's are
    everything outside its sharded modules, and first (backward reaches them last) the dense kernels' weights of
    its ``data_parallel`` tables (torchrec's DDP around their lookups is taken off: reduced here instead)."""
    if hasattr(model, "fused_optimizer"):  # torchrec DMP: everything outside the sharded modules
        from freescale.parallelize import dense_named_parameters, replicated_kernel_weights

        ddp = getattr(model, "_dmp_wrapped_module", None)
        if isinstance(ddp, nn.parallel.DistributedDataParallel):
            raise ValueError("fault tolerance: the model is wrapped in DDP; shard it with freescale.ft.shard (or "
                             "DistributedModelParallel(..., data_parallel_wrapper=freescale.parallelize.NoDataParallel())"
                             "): this layer reduces the dense gradients itself, in the group and across groups")
        dense = list(dense_named_parameters(model).values())
        return replicated_kernel_weights(model) + dense, dense
    dense = [p for p in model.parameters() if p.requires_grad]
    return dense, dense


def refuse_unstepped_tables(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """One line if a ``data_parallel`` table of ``model`` is in none of ``optimizers`` (its gradient would be
    reduced every step and the table would never move, alike in every group, so no check would see it)."""
    if not hasattr(model, "fused_optimizer"):
        return
    from freescale.parallelize import replicated_table_parameters
    from freescale.reshard import table_name

    stepped = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    missing = sorted(table_name(name) for name, p in replicated_table_parameters(model).items() if id(p) not in stepped)
    if missing:
        raise ValueError(f"fault tolerance: the data_parallel table {missing[0]!r} is in no optimizer's parameters "
                         "(the fused optimizer does not step it): give your dense optimizer model.parameters(), "
                         "or put the table on a fused kernel")
