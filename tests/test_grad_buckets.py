"""BucketedGrads' in-group stage (the prioritized pipeline's dense reduction) against a plain
all-reduce average: bit-equal, any bucketing and chunking, bounded in flight, no deadlock.

Two real processes (spawn, gloo on loopback).
"""

from __future__ import annotations


import pytest
import torch
import torch.multiprocessing as mp

from tests.procs import free_port

pytestmark = pytest.mark.multiprocess


def _rank(rank: int, port: int, chunk_bytes: int, max_inflight: int) -> None:
    import torch.distributed as dist

    from freescale.grad_buckets import BucketedGrads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)  # different initial weights: the reducer must broadcast rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5),
                                    torch.nn.LayerNorm(5))
        group = dist.new_group(backend="gloo")
        reducer = BucketedGrads(list(model.parameters()), group, chunk_bytes, chunk_bytes, chunk_bytes=chunk_bytes,
                                max_inflight=max_inflight)
        reference = [p.detach().clone() for p in model.parameters()]
        for t in reference:
            dist.broadcast(t, src=0)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference))
        for step in range(3):
            x = torch.randn(16, 7, generator=torch.Generator().manual_seed(100 * step + rank))
            model.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            local = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            want = [g.clone() / 2 for g in local]
            for w in want:
                dist.all_reduce(w)
            reducer.begin()
            loss.backward()
            reducer.finish()
            for p, w in zip(model.parameters(), want):
                assert p.grad is not None
                assert torch.equal(p.grad.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("chunk_bytes", "max_inflight"), [(16, 1), (64, 2), (1 << 20, 4)])
def test_reduced_gradients_equal_a_plain_average_bit_for_bit(chunk_bytes: int, max_inflight: int) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, chunk_bytes, max_inflight)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
