"""The SM-free all-to-all's CPU fallback: same bytes as ``all_to_all_single``, issued in priority order.

Two real processes (spawn, gloo on loopback).  The CUDA copy-engine path has
no test yet: it needs two GPUs in one node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.procs import free_port

pytestmark = pytest.mark.multiprocess


def _rank(rank: int, port: int, result_path: str) -> None:
    import torch.distributed as dist

    from freescale.comm_trace import CommTracer
    from freescale.kernels.copy_engine import CopyEngineAllToAll

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        engine = CopyEngineAllToAll()
        assert not engine.uses_copy_engines
        results, expected = [], []
        with CommTracer() as tracer:
            # Rows of width priority + 1 (so the trace tells the transfers apart); rank r sends (r + 1 + p) rows to peer p, tagged by sender, peer and priority.
            for priority in (2, 0, 1):
                send_splits = [rank + 1 + p for p in range(2)]
                recv_splits = [p + 1 + rank for p in range(2)]
                rows = torch.cat([torch.full((n, priority + 1), 100.0 * rank + 10 * p + priority) for p, n in enumerate(send_splits)])
                out = torch.empty(sum(recv_splits), priority + 1)
                engine.submit(out, rows, recv_splits, send_splits, priority)
                results.append((priority, out))
                want = torch.cat([torch.full((n, priority + 1), 100.0 * p + 10 * rank + priority) for p, n in enumerate(recv_splits)])
                expected.append(want)
            engine.flush()
        order = [e.bytes for e in tracer.events]
        for (_, got), want in zip(results, expected):
            assert torch.equal(got, want)
        Path(result_path).write_text(json.dumps({"issued_bytes": order}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_cpu_fallback_matches_all_to_all_and_runs_highest_priority_first(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path / f"r{r}.json"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        issued = json.loads((tmp_path / f"r{r}.json").read_text())["issued_bytes"]
        rows_sent = (r + 1) + (r + 2)
        assert issued == [rows_sent * width * 4 for width in (1, 2, 3)]  # priority 0, then 1, then 2
