"""The SM-free all-to-all on CPU: the copy-engine module's fallback (same bytes as ``all_to_all_single``, issued in
priority order) and the ``freescale_sm_free`` backend's shared-memory transport (bit for bit gloo's
``all_to_all_single``: even and uneven splits, empty chunks, several in flight, priorities, a non-contiguous
output, other collectives handed to gloo, a peer whose process ended said in one line).

Three real processes (spawn, gloo on loopback), one run for both.  The CUDA copy-engine path has no test
yet: it needs two GPUs in one node.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.procs import free_port

pytestmark = pytest.mark.multiprocess
WORLD = 3


def _copy_engine_fallback(rank: int) -> list[int]:
    """The copy-engine module's CPU fallback; the bytes it issued, in order."""
    from freescale.comm_trace import CommTracer
    from freescale.kernels.copy_engine import CopyEngineAllToAll

    engine = CopyEngineAllToAll()
    assert not engine.uses_copy_engines
    results, expected = [], []
    with CommTracer() as tracer:
        # Rows of width priority + 1 (so the trace tells the transfers apart); rank r sends (r + 1 + p) rows to
        # peer p, tagged by sender, peer and priority.
        for priority in (2, 0, 1):
            send_splits = [rank + 1 + p for p in range(WORLD)]
            recv_splits = [p + 1 + rank for p in range(WORLD)]
            rows = torch.cat([torch.full((n, priority + 1), 100.0 * rank + 10 * p + priority)
                              for p, n in enumerate(send_splits)])
            out = torch.empty(sum(recv_splits), priority + 1)
            engine.submit(out, rows, recv_splits, send_splits, priority)
            results.append((priority, out))
            expected.append(torch.cat([torch.full((n, priority + 1), 100.0 * p + 10 * rank + priority)
                                       for p, n in enumerate(recv_splits)]))
        engine.flush()
    for (_, got), want in zip(results, expected):
        assert torch.equal(got, want)
    return [e.bytes for e in tracer.events]


def _cases(rank: int) -> list[tuple[torch.Tensor, list[int], list[int], torch.dtype, int]]:
    """(input, input splits, output splits, dtype, trailing width) per case, the same on every rank's view."""
    g = torch.Generator().manual_seed(rank)
    cases = []
    for splits_of, dtype, width in (
            (lambda s, d: 2, torch.float32, 16),                             # even, default splits
            (lambda s, d: (s * 7 + d * 3) % 5, torch.float32, 3),            # uneven, some empty
            (lambda s, d: 0 if s == d else 40_000 * (1 + s), torch.int64, 4),  # large: many pieces per ring
            (lambda s, d: (s + d) % 2, torch.bfloat16, 1),                   # tiny, bf16
            (lambda s, d: 0, torch.float32, 8)):                             # nothing at all
        send = [splits_of(rank, d) for d in range(WORLD)]
        recv = [splits_of(s, rank) for s in range(WORLD)]
        data = torch.randint(-1000, 1000, (sum(send), width), generator=g).to(dtype)
        cases.append((data, send, recv, dtype, width))
    return cases


def _backend(rank: int) -> dict[str, object]:
    import torch.distributed as dist

    from freescale.kernels import sm_free_backend

    sm_free_backend.register()
    group = dist.new_group(backend=sm_free_backend.BACKEND)
    assert isinstance(group, sm_free_backend.SmFreeProcessGroup) and dist.get_rank(group) == rank
    cases = _cases(rank)
    wanted = []
    for data, send, recv, dtype, width in cases:  # gloo's answer on the same inputs
        out = torch.empty(sum(recv), width, dtype=dtype)
        dist.all_to_all_single(out, data, recv, send)
        wanted.append(out)
    # Several in flight, then waited for: each equal to gloo's, bit for bit.
    outs = [torch.full((sum(recv), width), -7, dtype=dtype) for _, _, recv, dtype, width in cases]
    works = [dist.all_to_all_single(out, data, recv, send, group=group, async_op=True)
             for out, (data, send, recv, _, _) in zip(outs, cases)]
    for work in works:
        work.wait()
    for got, want in zip(outs, wanted):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    even = dist.all_to_all_single(torch.empty(6, 16), cases[0][0], group=group, async_op=True)
    even.wait()
    # A non-contiguous output (a transposed view) gets the same values.
    data, send, recv, dtype, width = cases[1]
    strided = torch.empty(width, sum(recv)).t()
    dist.all_to_all_single(strided, data, recv, send, group=group)
    assert not strided.is_contiguous() and torch.equal(strided, wanted[1])
    # Priorities: a long exchange issued first at priority 1, a short one after it at priority 0: the short one
    # completes first on every rank (pieces of 1 MiB: the long one needs 32 per peer, the rings hold 8).
    long_out, short_out = torch.empty(WORLD * (1 << 23)), torch.empty(WORLD * 4)
    with sm_free_backend.priority(1):
        slow = dist.all_to_all_single(long_out, torch.arange(WORLD * (1 << 23), dtype=torch.float32),
                                      group=group, async_op=True)
    fast = dist.all_to_all_single(short_out, torch.full((WORLD * 4,), float(rank)), group=group, async_op=True)
    fast.wait()
    slow.wait()
    order = group.completed[-2:]
    assert torch.equal(short_out, torch.arange(WORLD).repeat_interleave(4).float())
    assert torch.equal(long_out.view(WORLD, -1)[:, 0], torch.full((WORLD,), rank * float(1 << 23)))
    # Another collective is gloo's, through the same group; the future completes with the output.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    assert total.item() == sum(range(WORLD))
    gathered = torch.empty(WORLD)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)]), group=group)  # reaches it as all_gather_single
    dist.barrier(group=group)  # (called with keyword options)
    assert gathered.tolist() == [float(r) for r in range(WORLD)]
    work = dist.all_to_all_single(torch.empty(6, 16), cases[0][0], group=group, async_op=True)
    assert torch.equal(work.get_future().wait()[0], wanted[0])
    return {"completed_last_two": order, "group": group}


def _rank(rank: int, port: int, result_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        result = {"issued_bytes": _copy_engine_fallback(rank), **_backend(rank)}
        group = result.pop("group")
        dist.barrier()
        if rank == WORLD - 1:  # a peer whose process ends: the others' next exchange says so, not a 300 s wait
            os._exit(0)
        start = time.monotonic()
        try:
            dist.all_to_all_single(torch.empty(WORLD), torch.zeros(WORLD), group=group)
        except RuntimeError as exc:
            result["gone"] = [str(exc), time.monotonic() - start]
        Path(result_path).write_text(json.dumps(result))
        os._exit(0)  # gloo's group has a dead member now: its teardown may abort the process (SIGABRT), so none
    finally:
        dist.destroy_process_group()


def test_sm_free_all_to_all_on_cpu_equals_gloo_and_runs_the_most_urgent_first(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path / f"r{r}.json"))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    assert [p.exitcode for p in procs] == [0] * WORLD
    for r in range(WORLD - 1):
        result = json.loads((tmp_path / f"r{r}.json").read_text())
        message, seconds = result["gone"]
        named = re.search(r"rank\(s\) \[([\d, ]+)\] of the group are gone", message)  # (the other survivor may be
        assert named and WORLD - 1 in json.loads(f"[{named.group(1)}]") and seconds < 10, result["gone"]  # gone too)
        rows_sent = sum(r + 1 + p for p in range(WORLD))
        assert result["issued_bytes"] == [rows_sent * width * 4 for width in (1, 2, 3)]  # priority 0, then 1, then 2
        long_one = len(_cases(r)) + 2  # its number: after the cases, the even one and the strided one
        assert result["completed_last_two"] == [long_one + 1, long_one], result
    assert not list(Path("/dev/shm").glob("freescale-a2a-*")), "shared-memory files left behind"
