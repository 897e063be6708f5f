"""FTAR overlapped with backward (``BucketedGrads`` + ``FTARStage``) across 2 groups x 2 ranks: exact
mean, same bits everywhere.

Four real processes (spawn, gloo on loopback).  Each group is its own world (the
in-group stage), rank position r of both groups is a replica-dimension group (the
cross-group stage), as in the FT trainer.  Small bucket caps give several buckets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.procs import free_port

pytestmark = pytest.mark.multiprocess

GROUPS, RANKS = 2, 2
SAMPLES = {0: 8, 1: 24}  # per rank: unequal groups, so averaging by participants would be wrong


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.ReLU(), torch.nn.Linear(40, 30), torch.nn.Tanh(),
                               torch.nn.Linear(30, 1))


def _data(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * group + rank)
    x = torch.randn(SAMPLES[group], 6, generator=g)
    return x, x[:, :1] - x[:, 1:2]


def _expected(groups: list[int], step: int) -> list[torch.Tensor]:
    """The mean gradient over every sample of ``groups`` (float64, one model)."""
    model = _model().double()
    xs, ys = zip(*[_data(g, r, step) for g in groups for r in range(RANKS)])
    loss = torch.nn.functional.mse_loss(model(torch.cat(xs).double()), torch.cat(ys).double())
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _proc(index: int, in_ports: list[int], cross_ports: list[int], out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from freescale.ft.weighted_reduce import FlatReduction, FTARStage, weighted_all_reduce
    from freescale.ft.replica_group import ReplicaGroup
    from freescale.grad_buckets import BucketedGrads

    group, rank = divmod(index, RANKS)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{in_ports[group]}", rank=rank, world_size=RANKS)
    store = dist.TCPStore("127.0.0.1", cross_ports[rank], GROUPS, is_master=group == 0)
    try:
        model = _model()
        params = list(model.parameters())
        reduction = BucketedGrads(params, dist.group.WORLD, first_bucket_bytes=64, bucket_bytes=4096)
        results = {}
        for step, (contributing, overlapped) in enumerate([({0, 1}, {0, 1}), ({0}, {0}), ({0, 1}, {1})]):
            cross = dist.ProcessGroupGloo(dist.PrefixStore(f"s{step}", store), group, GROUPS, timedelta(seconds=30))
            x, y = _data(group, rank, step)
            weight = float(SAMPLES[group] * RANKS)
            if group not in contributing:  # a group catching up: zeros with weight 0, after backward, same layout
                reduced = weighted_all_reduce(cross, [torch.zeros_like(p) for p in params], 0.0, group, GROUPS,
                                              False, None, reduction.layout)
            elif group in overlapped:
                reduction.begin()
                replica_group = ReplicaGroup.of(cross)
                flat = FlatReduction(reduction.layout, weight, group, GROUPS, True, None, replica_group.device)
                reduction.attach(FTARStage(flat, replica_group, step))
                # sum over this rank's samples / (group's samples / ranks): the in-group mean is the group's mean
                loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") * RANKS / weight
                loss.backward()
                # autograd accumulated into the buckets in place (no copy between backward and the reduction)
                assert all(p.grad.untyped_storage().data_ptr() == reduction.grads.untyped_storage().data_ptr()
                           for p in params)
                reduced = reduction.finish()
            else:  # trained, not attached to the quorum: in-group stage only, then reduced after backward
                reduction.begin()  # (the path of every redo after a failure)
                loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") * RANKS / weight
                loss.backward()
                reduction.settle()
                means = [p.grad for p in params]
                reduced = weighted_all_reduce(cross, means, weight, group, GROUPS, True, None, reduction.layout)
            results[step] = {"weights": reduced.weights, "ready": reduced.ready,
                             "grads": [t.double().reshape(-1).tolist() for t in reduced.tensors]}
        Path(out, f"{index}.json").write_text(json.dumps({"buckets": len(reduction.layout.buckets),
                                                          "results": results}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_overlapped_ftar_exact_and_identical(tmp_path: Path) -> None:
    in_ports = [free_port() for _ in range(GROUPS)]
    cross_ports = [free_port() for _ in range(RANKS)]
    mp.spawn(_proc, args=(in_ports, cross_ports, str(tmp_path)), nprocs=GROUPS * RANKS, join=True)
    runs = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(GROUPS * RANKS)]
    assert runs[0]["buckets"] >= 3, "the small caps must give several buckets"
    for step, groups in [(0, [0, 1]), (1, [0]), (2, [0, 1])]:
        first = runs[0]["results"][str(step)]
        for other in runs[1:]:  # every rank of every group: the same bits
            assert other["results"][str(step)] == first, f"step {step}: ranks disagree"
        want = _expected(groups, step)
        for got, w in zip(first["grads"], want):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), w.reshape(-1), rtol=1e-5, atol=1e-7)
        assert first["weights"] == [float(SAMPLES[g] * RANKS) if g in groups else 0.0 for g in range(GROUPS)]
    assert runs[0]["results"]["1"]["ready"] == [True, False]
