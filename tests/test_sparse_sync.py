"""The union update of ``freescale.ft.sparse_sync`` against one model trained on all samples.

In one process (a group of one rank): replicas A and B start from the same
weights, each looks up and back-propagates its own batch with the fused
update deferred; both then apply the weighted union of the two.  They must be
bit-identical to each other, and equal (to float rounding: the union scales
each replica's mean gradient by its sample share) to one model whose fused
optimizer updated the rows from the concatenated batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from freescale.dataloader.batch import Batch
from freescale.dataloader.build import build_loader
from freescale.dataloader.schema import DatasetManifest
from freescale.digest import local_digest
from freescale.distributed import DistContext, init_distributed
from freescale.ft.sparse_sync import GatheredSteps, UnionSparseUpdate
from freescale.models import build_model, cost_model_for
from freescale.parallelize import shard_model
from freescale.rank_console import quiet_libraries
from freescale.trainer import TrainerConfig


def _concat(a: Batch, b: Batch) -> Batch:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = a.sparse.keys()
    values, lengths = [], []
    for k in keys:
        for batch in (a, b):
            jt = batch.sparse[k]
            values.append(jt.values())
            lengths.append(jt.lengths())
    sparse = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return Batch(sparse, torch.cat([a.dense, b.dense]), torch.cat([a.labels, b.labels]))


def _tables(dmp: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.local_shards()[0].tensor.clone() for k, v in dmp.state_dict().items() if hasattr(v, "local_shards")}


def sharded_replica(cfg: TrainerConfig, ctx: DistContext, manifest: DatasetManifest) -> torch.nn.Module:
    """The model of ``cfg`` sharded on this one rank, from fixed seeds: every call the same weights (a replica)."""
    torch.manual_seed(0)
    model = build_model(cfg.model, manifest, max_seq_len=cfg.data.max_seq_len, embedding_device=torch.device("meta"))
    torch.manual_seed(1)  # tables are initialised when sharded
    return shard_model(model, ctx, cfg.optim)


def first_batches(cfg: TrainerConfig, manifest: DatasetManifest, count: int) -> list[Batch]:
    """The training loader's first ``count`` batches of ``cfg`` on one rank."""
    features = list(build_model(cfg.model, manifest, max_seq_len=cfg.data.max_seq_len,
                                embedding_device=torch.device("meta")).sparse_feature_names)
    loader = build_loader(cfg.data, "train", rank=0, world_size=1, sparse_features=features,
                          derived_cost=cost_model_for(cfg.model, manifest.dense_dim), seed=0, training=True)
    batches = [loader.next_batch() for _ in range(count)]
    loader.close()
    return batches


def _state(dmp: torch.nn.Module, sync: UnionSparseUpdate) -> tuple[str, list[tuple[int, list[int]]]]:
    """Digest of every local tensor (tables and their fused optimizer state) and each TBE's call counters."""
    tensors = {k: v.local_shards()[0].tensor if hasattr(v, "local_shards") else v for k, v in dmp.state_dict().items()}
    for key, value in dmp.fused_optimizer.state_dict()["state"].items():
        for name, t in value.items():
            tensors[f"optim/{key}/{name}"] = t.local_shards()[0].tensor if hasattr(t, "local_shards") else t
    counters = [(slot.tbe.step, [int(getattr(slot.tbe, n)[0]) for n in ("iter", "iter_cpu") if hasattr(slot.tbe, n)])
                for slot in sync._slots]
    return local_digest(tensors), counters


@pytest.mark.parametrize("kind", ["hstu", "dlrm"])
def test_union_update_equals_one_model_on_all_samples(kind: str, tiny_data: Path) -> None:
    quiet_libraries()
    cfg = TrainerConfig()
    cfg.data.path, cfg.model.kind, cfg.data.batch_size = str(tiny_data), kind, 24
    ctx = init_distributed(cfg.dist)
    try:
        manifest = DatasetManifest.read(cfg.data.path)

        def fresh() -> torch.nn.Module:
            return sharded_replica(cfg, ctx, manifest)

        batch_a, batch_b = first_batches(cfg, manifest, 2)
        reference, replica_a, replica_b = fresh(), fresh(), fresh()
        assert local_digest(_tables(reference)) == local_digest(_tables(replica_a)) == local_digest(_tables(replica_b))

        reference_before = fresh()
        both = _concat(batch_a, batch_b)
        reference(Batch(both.sparse, both.dense, both.labels))[0].backward()

        syncs, steps = [], []
        for replica, batch in ((replica_a, batch_a), (replica_b, batch_b)):
            sync = UnionSparseUpdate(replica)
            replica(Batch(batch.sparse, batch.dense, batch.labels))[0].backward()
            assert local_digest(_tables(replica)) == local_digest(_tables(reference_before)), \
                "the fused update ran inside backward"
            syncs.append(sync)
            steps.append(sync.local_blocks())
        weights = [float(batch_a.size), float(batch_b.size)]
        gathered = GatheredSteps({key: [step[key] for step in steps] for key in steps[0]}, weights)
        for i, sync in enumerate(syncs):
            union = sync.union(gathered)
            if i == 0:  # A: built while a vote was in flight, the vote failed, put back; then built again and applied
                before = _state(replica_a, sync)
                sync.discard(sync.prepare(union))
                assert _state(replica_a, sync) == before, "a discarded union left a trace (rows or fbgemm counters)"
                sync.apply(union, sync.prepare(union))
            else:  # B: built and applied in one go (a recorded step replayed during catch-up)
                sync.apply(union)
        a, b, ref = _tables(replica_a), _tables(replica_b), _tables(reference)
        assert local_digest(a) == local_digest(b), "replicas applying the same union differ"
        assert _state(replica_a, syncs[0]) == _state(replica_b, syncs[1]), "optimizer state or counters differ"
        initial = _tables(fresh())
        for name in ref:
            moved = (ref[name] - initial[name]).abs().sum(dim=1) > 0
            assert moved.any(), name
            assert torch.equal((a[name] - initial[name]).abs().sum(dim=1) > 0, moved), f"{name}: other rows updated"
            torch.testing.assert_close(a[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def test_headers_ride_in_the_reduction_exactly() -> None:
    """Integers up to 2**40 travel through the float32 sum split in two parts, bit-exact."""
    from datetime import timedelta

    from freescale.ft.weighted_reduce import weighted_all_reduce

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    header = torch.tensor([0, 1, 2**24 + 1, 2**33 + 12345, 2**40 - 1], dtype=torch.int64)
    grads = [torch.tensor([1.0, -2.0]), torch.tensor([[0.5]])]
    reduced = weighted_all_reduce(group, grads, 8.0, 0, 1, True, header)
    assert torch.equal(reduced.headers[0], header)
    assert reduced.weights == [8.0] and reduced.ready == [True]
    assert all(torch.equal(a, b) for a, b in zip(reduced.tensors, grads))
    with pytest.raises(ValueError, match="header values"):
        weighted_all_reduce(group, grads, 1.0, 0, 1, True, torch.tensor([-1]))
