"""A background writer's save plans, reused between its saves (``freescale/save_plans.py``).

Two real processes (spawn, gloo on loopback), each holding items the other does not (a missing rank's items
would be missing from the checkpoint).  One spawn covers: the plans kept after the first save and reused by the
next ones, every checkpoint loading back whole; two writers of one process, over different states, never taking
each other's plans; rank 0 alone losing its kept plans: that save refused on both ranks, the next one whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.procs import free_port


def _state(rank: int, value: float, name: str) -> dict[str, Any]:
    return {f"{name}_{rank}": torch.full((1000,), value), "shared": torch.full((3,), value)}


def _check_loads(path: Path, rank: int, value: float, name: str) -> None:
    from freescale import checkpoint

    into = {k: torch.zeros_like(v) for k, v in _state(rank, 0.0, name).items()}
    checkpoint.load(path, into)
    assert all(torch.equal(v, torch.full_like(v, value)) for v in into.values()), (path, rank)


def _save(writer: Any, root: Path, step: int, rank: int, name: str) -> Path:
    writer.start(root, step, _state(rank, float(step), name), {"data": {}}, keep=2)
    found = writer.wait()
    dist.barrier()
    assert found is not None
    return found[0]


def _rank(rank: int, port: int, tmp: str) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    from freescale import checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        first, second = checkpoint.CheckpointWriter(group=dist.new_group(backend="gloo")), \
            checkpoint.CheckpointWriter(group=dist.new_group(backend="gloo"))
        assert first.plans.key != second.plans.key
        for step in (1, 2, 3):  # interleaved saves of two states, each writer its own plans
            for writer, name in ((first, "a"), (second, "b")):
                path = _save(writer, Path(tmp) / name, step, rank, name)
                _check_loads(path, rank, float(step), name)
                assert writer.plans.key in SavePlanner._cached_save_plan  # kept: the next save reuses it
                assert (writer.plans.key in SavePlanner._cached_all_plans) == (rank == 0)

        if rank == 0:  # rank 0 alone loses its plans; rank 1 sends an empty one, as kept plans allow
            first.plans.forget()
        first.start(Path(tmp) / "a", 4, _state(rank, 4.0, "a"), {"data": {}}, keep=2)
        try:
            first.wait()
            raise AssertionError("a save rank 0 cannot plan was committed")
        except checkpoint.CheckpointError as exc:
            assert "no longer keeps" in str(exc), exc
        dist.barrier()
        assert first.plans.key not in SavePlanner._cached_save_plan  # every rank forgot
        _check_loads(_save(first, Path(tmp) / "a", 5, rank, "a"), rank, 5.0, "a")
        assert checkpoint.latest(Path(tmp) / "a") == checkpoint.step_dir(Path(tmp) / "a", 5)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_saves_reuse_their_writers_plans_and_a_lost_plan_fails_one_save_on_every_rank(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=True)
