"""Replica-dimension process groups: backend choice everywhere; NCCL itself on machines with >= 2 GPUs.

The NCCL tests run two real processes, one GPU each (NCCL refuses two ranks on
one GPU): the sample-weighted reduction is exact and bit-identical on a device
buffer, and when one process SIGKILLs itself in the middle of a collective the
other's bounded wait raises, the aborted group lets go, and a fresh group under
a new store prefix works.  They are skipped on CPU machines (CI).
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.config import ConfigError
from freescale.ft.config import FTConfig
from freescale.ft.replica_group import SHARED_GPUS_ENV, ReplicaGroup, resolve_backend
from tests.procs import free_port

two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                                   and dist.is_nccl_available()),
                              reason="NCCL across replica groups needs >= 2 GPUs")


def test_backend_choice_and_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "gloo"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match=r"ft.replica_backend: 'nccl' needs a GPU of its own per rank.*trains on cpu"):
        resolve_backend("nccl", cpu)
    with pytest.raises(ValueError, match="ft.replica_backend: must be one of auto, gloo, nccl, got 'mpi'"):
        resolve_backend("mpi", cpu)
    # Groups sharing GPUs (the launcher says so): NCCL would refuse them, auto means gloo.
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    monkeypatch.setenv(SHARED_GPUS_ENV, "1")
    assert resolve_backend("auto", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError, match="replica groups share GPUs here"):
        resolve_backend("nccl", torch.device("cuda", 0))
    cfg = FTConfig(replica_backend="ncl")
    with pytest.raises(ConfigError, match="replica_backend: must be one of auto, gloo, nccl, got 'ncl'"):
        cfg.validate()


def test_a_bare_gloo_group_reduces_on_the_host() -> None:
    from freescale.ft.weighted_reduce import weighted_all_reduce

    group = ReplicaGroup.create("gloo", dist.HashStore(), 0, 1, 5.0, torch.device("cpu"), "solo")
    assert group.device == torch.device("cpu")
    grads = [torch.tensor([3.0, -1.5]), torch.tensor([[0.25]])]
    reduced = weighted_all_reduce(group, grads, 4.0)
    assert reduced.weights == [4.0] and all(torch.equal(a, b) for a, b in zip(reduced.tensors, grads))


def _hung_peer_proc(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    lost_at = time.monotonic() + 0.5
    group = ReplicaGroup.create("gloo", dist.PrefixStore("q1", store), rank, 2, 30.0, torch.device("cpu"), "q1",
                                lambda: rank == 0 and time.monotonic() > lost_at)
    x = torch.ones(1 << 16)
    group.wait(group.allreduce(x))
    if rank == 1:  # hangs: never joins the next collective, and holds its connections open
        Path(out, "hung").write_text("")
        time.sleep(4)
        os._exit(0)
    while not Path(out, "hung").exists():
        time.sleep(0.01)
    lost_at = time.monotonic() + 0.5
    start = time.monotonic()
    try:
        group.wait(group.allreduce(x))
        result = "completed?!"
    except RuntimeError as exc:
        result = str(exc)
    given_up = time.monotonic() - start
    del group  # retired: its unfinished collective is let go off this thread, which must not block here
    released = time.monotonic() - start
    Path(out, "0.json").write_text(json.dumps({"error": result, "given_up_s": given_up, "released_s": released}))
    os._exit(0)


def test_gloo_wait_gives_up_when_the_quorum_is_lost_without_blocking_on_the_hung_peer(tmp_path: Path) -> None:
    """A hung peer (30 s collective timeout): the wait ends once ``lost`` says so, and letting the
    group go does not block on the collective still running inside gloo."""
    mp.spawn(_hung_peer_proc, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    run = json.loads((tmp_path / "0.json").read_text())
    assert "quorum lost" in run["error"]
    assert 0.4 < run["given_up_s"] < 2.0 and run["released_s"] < 2.0, run


def _nccl_proc(rank: int, port: int, out: str, kill: bool) -> None:
    from freescale.ft.weighted_reduce import weighted_all_reduce

    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    group = ReplicaGroup.create("nccl", dist.PrefixStore("q1", store), rank, 2, 5.0, device, "q1")
    assert group.device == device
    torch.manual_seed(rank)
    grads = [torch.randn(1000, 7, device=device), torch.randn(3, device=device)]
    weight = [16.0, 48.0][rank]
    reduced = weighted_all_reduce(group, grads, weight, rank, 2)
    assert all(t.device == device for t in reduced.tensors)
    result: dict[str, object] = {"weights": reduced.weights,
                                 "grads": [t.double().cpu().reshape(-1).tolist() for t in reduced.tensors],
                                 "mine": [t.double().cpu().reshape(-1).tolist() for t in grads]}
    if kill:
        if rank == 1:
            Path(out, "ready").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)  # before its part of the next collective: rank 0 waits on a dead peer
        while not Path(out, "ready").exists():
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises((RuntimeError, dist.DistError)):
            group.wait(group.allreduce(torch.ones(1 << 20, device=device)))
        result["failed_after_s"] = time.monotonic() - start
        group.retire()
        alone = ReplicaGroup.create("nccl", dist.PrefixStore("q2", store), 0, 1, 5.0, device, "q2")
        x = torch.full((5,), 2.0, device=device)
        alone.wait(alone.allreduce(x))
        result["alone"] = x.cpu().tolist()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


@two_gpus
def test_nccl_weighted_reduction_is_exact_and_identical(tmp_path: Path) -> None:
    mp.spawn(_nccl_proc, args=(free_port(), str(tmp_path), False), nprocs=2, join=True)
    runs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert runs[0]["grads"] == runs[1]["grads"], "replicas must receive identical bits"
    assert runs[0]["weights"] == [16.0, 48.0]
    for k in range(2):
        expected = (16 * torch.tensor(runs[0]["mine"][k]) + 48 * torch.tensor(runs[1]["mine"][k])) / 64
        torch.testing.assert_close(torch.tensor(runs[0]["grads"][k]), expected, rtol=1e-6, atol=1e-6)


@two_gpus
def test_nccl_peer_killed_mid_collective_is_detected_and_the_group_replaced(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_nccl_proc, args=(r, port, str(tmp_path), True)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert procs[1].exitcode == -signal.SIGKILL
    assert procs[0].exitcode == 0, "the survivor must not be taken down by the dead peer"
    survivor = json.loads((tmp_path / "0.json").read_text())
    assert survivor["failed_after_s"] < 5.0 + 3.0, "detected within the bounded wait (timeout 5 s)"
    assert survivor["alone"] == [2.0] * 5
