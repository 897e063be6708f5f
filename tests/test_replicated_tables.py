"""``optim.sharding = data_parallel``: whole tables on every rank, updated after DDP's all-reduce by the sparse
optimizer's math (``parallelize.build_optimizer``), equal to what the fused kernel does inside backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from freescale.components import prepare
from freescale.config import ConfigError
from freescale.dataloader.build import build_loader
from freescale.dataloader.schema import DatasetManifest
from freescale.distributed import init_distributed
from freescale.models import build_model, cost_model_for
from freescale.parallelize import (
    build_optimizer,
    replicated_kernel_weights,
    replicated_table_parameters,
    replicated_tables,
    shard_model,
)
from freescale.rank_console import quiet_libraries
from freescale.trainer import TrainerConfig


def _table_weights(dmp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``table -> weight`` (a fused table's local shard, a replicated table's tensor), by table name."""
    out = {}
    for key, value in dmp.state_dict().items():
        if key.endswith(".weight") and "_table" in key:
            out[key.split(".")[-2]] = (value.local_shards()[0].tensor if hasattr(value, "local_shards") else value).clone()
    return out


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_a_data_parallel_table_takes_the_fused_kernels_step(tiny_data: Path, optimizer: str) -> None:
    """The same rows move by the same steps, over two steps (the second on the first's Adagrad state), whether a
    table is fused or replicated (``build_optimizer``).  On any number of ranks both kernels step on the ranks'
    mean gradient (torchrec divides a fused shard's all-to-all gradient by the group's size; DDP averages), so
    one rank shows it; ``test_ft_torchrec``'s plain 4-rank reference checks it across ranks."""
    quiet_libraries()
    cfg = TrainerConfig()
    cfg.data.path, cfg.data.batch_size, cfg.model.kind = str(tiny_data), 32, "dlrm"
    cfg.optim.sparse_eps = 1e-3  # as large as the rows' gradients: a wrong eps shows
    cfg.optim.sparse_optimizer = optimizer  # type: ignore[assignment]
    ctx = init_distributed(cfg.dist)
    try:
        manifest = DatasetManifest.read(cfg.data.path)

        def sharded(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            cfg.optim.sharding = kind
            torch.manual_seed(0)
            model = build_model(cfg.model, manifest, max_seq_len=cfg.data.max_seq_len, embedding_device=torch.device("meta"))
            dmp = shard_model(model, ctx, cfg.optim)
            return dmp, build_optimizer(dmp, cfg.optim)

        fused, fused_opt = sharded("table_wise")
        replicated, replicated_opt = sharded("data_parallel")
        tables = replicated_table_parameters(replicated)
        assert sorted(k.split(".")[-2] for k in tables) == ["item_table", "user_table"]
        with torch.no_grad():  # the same starting rows (each kernel initialises its own)
            start = _table_weights(fused)
            for key, param in tables.items():
                param.copy_(start[key.split(".")[-2]])
        loader = build_loader(cfg.data, "train", rank=0, world_size=1, sparse_features=list(fused.module.sparse_feature_names),
                              derived_cost=cost_model_for(cfg.model, manifest.dense_dim), seed=0, training=True)
        for _ in range(2):
            batch = loader.next_batch()
            for dmp, opt in ((fused, fused_opt), (replicated, replicated_opt)):
                opt.zero_grad()
                dmp(batch)[0].backward()  # the fused tables update here
                opt.step()  # the replicated ones here (and both dense parts)
        loader.close()
        after_fused, after_replicated = _table_weights(fused), _table_weights(replicated)
        for name, weight in after_fused.items():
            moved = (weight - start[name]).abs().sum(dim=1) > 0
            assert moved.any() and not moved.all(), name
            assert torch.equal((after_replicated[name] - start[name]).abs().sum(dim=1) > 0, moved), name
            torch.testing.assert_close(after_replicated[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def test_sharding_without_ddp_takes_torchrecs_ddp_off_the_data_parallel_lookups(tiny_data: Path) -> None:
    """Fault tolerance reduces a data_parallel table's gradient itself: with torchrec's DDP still around the
    lookup it would be all-reduced in the group twice (the same mean, so no loss would show it)."""
    from torch.nn.parallel import DistributedDataParallel

    quiet_libraries()
    cfg = TrainerConfig()
    cfg.data.path, cfg.model.kind, cfg.optim.sharding = str(tiny_data), "dlrm", "item_table=data_parallel"
    ctx = init_distributed(cfg.dist)
    try:
        manifest = DatasetManifest.read(cfg.data.path)
        for ddp in (True, False):
            model = build_model(cfg.model, manifest, max_seq_len=16, embedding_device=torch.device("meta"))
            dmp = shard_model(model, ctx, cfg.optim, data_parallel=ddp)
            wrapped = [lookup for m in dmp.modules() for lookup in getattr(m, "_lookups", None) or []
                       if isinstance(lookup, DistributedDataParallel)]
            assert replicated_tables(dmp) == {"item_table"} and bool(wrapped) is ddp
            if not ddp:
                weights = replicated_kernel_weights(dmp)
                assert len(weights) == 1 and weights[0].numel() == 2000 * 16  # the item table, whole
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def test_data_parallel_tables_are_refused_with_the_prioritized_pipeline_and_taken_by_fault_tolerance() -> None:
    """Fault tolerance reduces their gradients, with any pipeline (``tests/test_ft_torchrec.py`` trains and kills
    with one, and its chaos run does with the prioritized pipeline)."""
    cfg = TrainerConfig()
    cfg.optim.sharding = "item_table=data_parallel"
    cfg.pipeline.kind = "prioritized"
    with pytest.raises(ConfigError, match=r"optim.sharding: data_parallel tables \(optim.sharding\) are refused here") as info:
        prepare(cfg)
    assert "pipeline.kind = 'prioritized'" in str(info.value) and "\n" not in str(info.value)
    cfg.ft.replicas, cfg.ft.replica_index, cfg.ft.lighthouse = 2, 0, "http://127.0.0.1:1"
    prepare(cfg)  # prioritized, with fault tolerance
    cfg.pipeline.kind = "plain"
    prepare(cfg)


def test_a_sequence_table_is_refused_as_data_parallel(tiny_data: Path) -> None:
    """torchrec 1.8's data-parallel ``EmbeddingCollection`` fails in its forward (HSTU's item table, shared by
    two features): refused at sharding, naming the table."""
    quiet_libraries()
    cfg = TrainerConfig()
    cfg.optim.sharding = "data_parallel"
    ctx = init_distributed(cfg.dist)
    try:
        model = build_model(cfg.model, DatasetManifest.read(tiny_data), max_seq_len=16, embedding_device=torch.device("meta"))
        with pytest.raises(ConfigError, match="data_parallel for table 'item_table', a sequence table"):
            shard_model(model, ctx, cfg.optim)
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()
