"""The averaging of ``freescale.ft.sparse_average`` on two replicas in one process.

Replicas A and B start from the same tables, each trains its own batch (the fused update runs in
backward, after the fence), then every slice is exchanged and applied as FTAR does it: after
``average_every`` steps' slices both hold, bit for bit, the elementwise mean of their two tables and
of their row-wise Adagrad state.  The exchange is run on a one-rank gloo group per replica (a sum
over itself) and the two sums are added here, as a two-rank all-reduce would.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from freescale.dataloader.batch import Batch
from freescale.dataloader.schema import DatasetManifest
from freescale.distributed import init_distributed
from freescale.ft.client import Quorum
from freescale.ft.config import FTConfig
from freescale.ft.sparse_average import AveragedSparseSync, SliceSum, slice_bounds
from freescale.rank_console import quiet_libraries
from freescale.trainer import TrainerConfig
from tests.test_sparse_sync import first_batches, sharded_replica


def _buffers(sync: AveragedSparseSync) -> list[torch.Tensor]:
    return [b.detach().clone() for b in sync._buffers]  # noqa: SLF001


def test_slices_cover_every_element_once() -> None:
    for numel in (0, 1, 7, 1000):
        for every in (1, 3, 8):
            covered = [i for j in range(every) for i in range(*slice_bounds(numel, j, every))]
            assert covered == list(range(numel)), (numel, every)


def test_config_refuses_an_unknown_scheme_and_a_zero_period() -> None:
    from freescale.config import ConfigError

    with pytest.raises(ConfigError, match="embedding_sync: must be one of union, average, got 'mean'"):
        FTConfig(embedding_sync="mean").validate()
    with pytest.raises(ConfigError, match="average_every: must be >= 1, got 0"):
        FTConfig(average_every=0).validate()


def test_two_replicas_end_with_the_mean_of_their_tables_and_state(tiny_data: Path) -> None:
    quiet_libraries()
    cfg = TrainerConfig()
    cfg.data.path, cfg.model.kind, cfg.data.batch_size = str(tiny_data), "dlrm", 24
    ctx = init_distributed(cfg.dist)
    every = 3
    try:
        manifest = DatasetManifest.read(cfg.data.path)

        def fresh() -> torch.nn.Module:
            return sharded_replica(cfg, ctx, manifest)

        batches = first_batches(cfg, manifest, 2)
        replicas, syncs, local = [fresh(), fresh()], [], []
        initial: list[torch.Tensor] = []
        for replica, batch in zip(replicas, batches):
            fenced: list[list[torch.Tensor]] = []
            holder: list[AveragedSparseSync] = []
            sync = AveragedSparseSync(replica, every, fence=lambda: fenced.append(_buffers(holder[0])))  # noqa: B023
            holder.append(sync)
            syncs.append(sync)
            before = _buffers(sync)
            initial = before
            replica(Batch(batch.sparse, batch.dense, batch.labels))[0].backward()
            after = _buffers(sync)
            assert fenced and all(torch.equal(f, b) for f, b in zip(fenced[0], before)), \
                "the fence ran after the fused update had written the tables"
            assert any(not torch.equal(a, b) for a, b in zip(after, before)), "the fused update did not run"
            local.append(after)
        assert any(not torch.equal(a, b) for a, b in zip(*local)), "both replicas trained the same rows alike"

        groups = [dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5)) for _ in syncs]
        for step in range(every):
            quorum = Quorum(1, (), step, "", 0)
            sums = [sync(group, quorum, [24.0], [], [True]) for sync, group in zip(syncs, groups)]
            idle = syncs[0](groups[0], quorum, [0.0], [], [False])
            assert idle.holders == 0 and not idle.summed.any(), "a replica catching up must send zeros"
            both = SliceSum(sums[0].index, sums[0].summed + sums[1].summed, 2)
            assert both.index == step % every
            held = _buffers(syncs[0])
            for sync in syncs:
                sync.discard(sync.prepare(both))  # a failed vote writes nothing
            assert all(torch.equal(a, b) for a, b in zip(_buffers(syncs[0]), held))
            for sync in syncs:
                sync.apply(both)
        accumulators = syncs[0]._accumulators  # noqa: SLF001
        assert accumulators.count(True) == 2, "row-wise Adagrad: one accumulator per TBE"
        for a, b, la, lb, acc, start in zip(_buffers(syncs[0]), _buffers(syncs[1]), *local, accumulators, initial):
            assert torch.equal(a, b), "replicas applying the same averages differ"
            mean = (la.float() + lb.float()) / 2
            if acc:  # grown from its last average by the mean growth over the holders (2)
                assert torch.equal(a, start + (mean - start) / 2), "the accumulator's growth is not scaled"
            else:
                assert torch.equal(a, mean), "not the elementwise mean"
        state = syncs[0].state_dict()
        assert all(torch.equal(t, b) for t, b in zip(state["averaged"], [x for x, acc in zip(_buffers(syncs[0]),
                                                                                            accumulators) if acc]))
        for t in syncs[1]._averaged:  # noqa: SLF001
            t.add_(1.0)
        syncs[1].load_state_dict(state)  # what a recovering group loads from its snapshot
        assert all(torch.equal(a, b) for a, b in zip(syncs[1]._averaged, state["averaged"]))  # noqa: SLF001
        with pytest.raises(RuntimeError, match="an embedding average of 1 elements for slice 0"):
            syncs[0].apply(SliceSum(0, torch.zeros(1), 1))
        _replay_matches_the_holders(fresh(), syncs, groups[0], every)
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _replay_matches_the_holders(replica: torch.nn.Module, holders: list[AveragedSparseSync],
                                group: dist.ProcessGroup, every: int) -> None:
    """A replica loads holder A's tables and accumulators' last averages (its snapshot), then records two rounds of
    slice sums while catching up: in the first the holders' tables change differently before each sum (their own
    steps), in the second they do not, so every slice ends averaged and identical on both.  The first round's
    records are cut to their accumulators by the second's; replaying all of them gives the holders' bits, and
    every accumulator then equals its last average."""
    catching_up = AveragedSparseSync(replica, every, fence=lambda: None)
    with torch.no_grad():
        for mine, theirs in zip(catching_up._buffers, holders[0]._buffers):  # noqa: SLF001
            mine.copy_(theirs)
    catching_up.load_state_dict({"averaged": [t.clone() for t in holders[0].state_dict()["averaged"]]})
    recorded = []
    for step in range(2 * every):
        if step < every:
            with torch.no_grad():
                for i, sync in enumerate(holders):
                    for buffer in sync._buffers:  # noqa: SLF001
                        buffer.add_((i + 1) * 1e-3 * (step + 1))  # grows the accumulators, moves the weights
        quorum = Quorum(1, (), step, "", 0)
        sums = [sync(group, quorum, [24.0], [], [True]) for sync in holders]
        both = SliceSum(sums[0].index, sums[0].summed + sums[1].summed, 2)
        for sync in holders:
            sync.apply(both)
        assert catching_up(group, quorum, [0.0], [], [False]).holders == 0  # what it sends: zeros
        recorded.append(catching_up._record(SliceSum(both.index, both.summed.clone(), 2)))  # noqa: SLF001
    assert [r.accumulators_only for r in recorded] == [True] * every + [False] * every
    assert all(torch.equal(a, b) for a, b in zip(_buffers(holders[0]), _buffers(holders[1])))
    for update in recorded:
        catching_up.apply(update)
    assert all(torch.equal(a, b) for a, b in zip(_buffers(catching_up), _buffers(holders[0])))
    assert all(torch.equal(a, b) for a, b in zip(catching_up._averaged, holders[0]._averaged))  # noqa: SLF001
    accumulators = [b for b, acc in zip(_buffers(holders[0]), holders[0]._accumulators) if acc]  # noqa: SLF001
    assert all(torch.equal(a, b) for a, b in zip(accumulators, holders[0]._averaged))  # noqa: SLF001


def test_skipping_a_non_finite_step_is_refused_with_averaged_tables(tiny_data: Path) -> None:
    from freescale.components import prepare
    from freescale.config import ConfigError

    cfg = TrainerConfig()
    cfg.data.path, cfg.ft.lighthouse, cfg.train.nonfinite = str(tiny_data), "http://127.0.0.1:1", "skip_step"
    cfg.ft.embedding_sync = "average"
    with pytest.raises(ConfigError, match="'skip_step' needs the union update"):
        prepare(cfg)
    cfg.ft.embedding_sync = "union"
    prepare(cfg)
