"""Checkpoint atomicity: a SIGKILL at a random moment of a save never leaves a
checkpoint that ``latest`` offers and that then fails to load or holds mixed steps."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from freescale import checkpoint
from freescale.checkpoint import CheckpointError
from tests.procs import wait_for

WRITER = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from freescale import checkpoint
    root, mode = sys.argv[1], sys.argv[2]
    if mode == "async":  # DCP's background save runs its collectives on a process group
        dist.init_process_group("gloo", init_method=f"file://{root}.store", rank=0, world_size=1)
    writer = checkpoint.CheckpointWriter(asynchronous=mode == "async")
    weight = torch.zeros(2_000_000)
    for step in range(1, 10_000):
        weight.fill_(float(step))  # the live state moves on while the previous save may still be written
        state = {"weight": weight, "bias": torch.full((7,), float(step))}
        writer.start(root, step, state, {"data": {"step_in_epoch": step}}, keep=3)
        writer.poll()
    """
)


def test_latest_ignores_partial_and_incomplete(tmp_path: Path) -> None:
    (tmp_path / "step_000000005").mkdir()  # no freescale.json: never committed
    (tmp_path / "step_000000009.partial").mkdir()
    assert checkpoint.latest(tmp_path) is None
    checkpoint.save(tmp_path, 3, {"x": torch.ones(3)}, {"data": {}})
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000000003"
    with pytest.raises(CheckpointError, match="step_000000005: not a complete checkpoint"):
        checkpoint.load(tmp_path / "step_000000005", {"x": torch.zeros(3)})


def test_round_trip_and_keep(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, {"x": torch.full((4,), float(step))}, {"data": {"k": step}}, keep=2)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [2, 3]
    state = {"x": torch.zeros(4)}
    meta = checkpoint.load(checkpoint.latest(tmp_path), state)  # type: ignore[arg-type]
    assert meta["step"] == 3 and meta["data"] == {"k": 3}
    assert torch.equal(state["x"], torch.full((4,), 3.0))
    with pytest.raises(CheckpointError, match="cannot load into this model/optimizer"):
        checkpoint.load(checkpoint.latest(tmp_path), {"y": torch.zeros(4)})  # type: ignore[arg-type]


def test_sigkill_during_saves_never_leaves_a_bad_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(1234)
    for attempt in range(4):
        root = tmp_path / f"attempt{attempt}"
        mode = "async" if attempt % 2 else "sync"  # a kill mid background write, too
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), mode])
        try:
            assert wait_for(lambda: checkpoint.latest(root) is not None, timeout=60)
            # Kill somewhere inside the following saves (each takes tens of ms).
            wait_for(lambda: False, timeout=rng.uniform(0.05, 0.6))
        finally:
            proc.kill()
            proc.wait()
        found = checkpoint.complete_checkpoints(root)
        assert found, "the first checkpoint was committed before the kill"
        for step, path in found:
            state = {"weight": torch.zeros(2_000_000), "bias": torch.zeros(7)}
            meta = checkpoint.load(path, state)
            assert meta["step"] == step == meta["data"]["step_in_epoch"]
            assert torch.all(state["weight"] == step) and torch.all(state["bias"] == step)
