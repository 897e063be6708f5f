"""A background writer's save plans, reused between its saves (``freescale/save_plans.py``).

Two real processes (spawn, gloo on loopback), each holding items the other does not (a missing rank's items
would be missing from the checkpoint).  One spawn covers: the plans kept after the first save and reused by the
next ones (rank 0's kept plans not made again), every checkpoint loading back whole; two writers of one process,
over different states, never taking each other's plans; one rank's state gaining an item, then changing an
item's dtype (the checkpoint's metadata says the new one); rank 0 alone, then rank 1 alone, losing its kept plans:
that save refused on both ranks, every rank's plans under that key dropped, the next save whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.procs import free_port


def _state(rank: int, value: float, name: str, extra: bool = False,
           dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Rank ``rank``'s items of state ``name``, all ``value``: its own, one every rank holds, maybe one more."""
    state = {f"{name}_{rank}": torch.full((1000,), value, dtype=dtype), "shared": torch.full((3,), value)}
    if extra:
        state[f"extra_{rank}"] = torch.full((5,), value)
    return state


def _save(writer: Any, root: Path, step: int, state: dict[str, Any]) -> Path:
    """Save ``state`` as ``step``, wait for it, and check it loads back whole."""
    from freescale import checkpoint

    writer.start(root, step, state, {"data": {}}, keep=2)
    found = writer.wait()
    dist.barrier()
    assert found is not None
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    checkpoint.load(found[0], into)
    assert all(torch.equal(into[k], v) for k, v in state.items()), (found[0], sorted(state))
    return found[0]


def _rank(rank: int, port: int, tmp: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import SavePlanner

    from freescale import checkpoint
    from freescale.save_plans import _TABLES

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        first, second = (checkpoint.CheckpointWriter(group=dist.new_group(backend="gloo")) for _ in range(2))
        assert first.plans.key != second.plans.key
        made: list[Any] = []  # rank 0's kept plans of every rank after each of the first writer's saves
        for step in (1, 2, 3):  # interleaved saves of two states, each writer its own plans
            for writer, name in ((first, "a"), (second, "b")):
                _save(writer, Path(tmp) / name, step, _state(rank, float(step), name))
                assert writer.plans.key in SavePlanner._cached_save_plan  # kept: the next save reuses it
                assert (writer.plans.key in SavePlanner._cached_all_plans) == (rank == 0)
            made.append(SavePlanner._cached_all_plans.get(first.plans.key))
        assert rank != 0 or made[0] is made[1] is made[2]  # reused as kept, not made again

        _save(first, Path(tmp) / "a", 4, _state(rank, 4.0, "a", extra=rank == 1))  # rank 1 gains an item
        same = {"extra": rank == 1, "dtype": torch.float64 if rank == 1 else torch.float32}  # (from here on)
        path = _save(first, Path(tmp) / "a", 5, _state(rank, 5.0, "a", **same))
        dtypes = {k: v.properties.dtype for k, v in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()}
        assert dtypes["a_1"] == torch.float64 and dtypes["a_0"] == torch.float32, dtypes

        step = 6
        for alone, says in ((0, "rank 0 no longer keeps"), (1, "this rank no longer keeps")):
            old = first.plans.key  # one rank alone loses its plans: the other's reuse is refused, on both ranks
            if rank == alone:
                first.plans.forget()
            first.start(Path(tmp) / "a", step, _state(rank, float(step), "a", **same), {"data": {}}, keep=2)
            try:
                first.wait()
                raise AssertionError(f"a save with rank {alone}'s plans lost was committed")
            except checkpoint.CheckpointError as exc:
                assert says in str(exc), exc
            dist.barrier()
            assert not any(old in getattr(SavePlanner, table) for table in _TABLES)  # dropped on every rank
            _save(first, Path(tmp) / "a", step + 1, _state(rank, step + 1.0, "a", **same))
            assert checkpoint.latest(Path(tmp) / "a") == checkpoint.step_dir(Path(tmp) / "a", step + 1)
            step += 2
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_saves_reuse_their_writers_plans_and_a_lost_plan_fails_one_save_on_every_rank(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=True)
