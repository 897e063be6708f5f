"""Checkpoint atomicity: a SIGKILL at a random moment of a save never leaves a
checkpoint that ``latest`` offers and that then fails to load or holds mixed steps."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

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


def _two_checkpoints(root: Path) -> Path:
    for step in (1, 2):
        state = {"w": torch.full((50_000,), float(step)), "b": torch.arange(7.0) * step, "extra": {"k": step}}
        checkpoint.save(root, step, state, {"data": {}}, keep=3)
    newest = checkpoint.latest(root)
    assert newest is not None
    return newest


def _flip(file: Path, at: float = 0.5, count: int = 4096) -> None:
    data = bytearray(file.read_bytes())
    start = int(len(data) * at)
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    file.write_bytes(bytes(data))


def _data_file(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)


DAMAGES = {
    "flip in tensor data": lambda p: _flip(_data_file(p), 0.5, 64),
    "truncated data file": lambda p: _data_file(p).write_bytes(_data_file(p).read_bytes()[:1000]),
    "missing .metadata": lambda p: (p / ".metadata").unlink(),
    "flip in .metadata": lambda p: _flip(p / ".metadata", 0.5, 1),
    "missing data file": lambda p: _data_file(p).unlink(),
    "edited manifest": lambda p: (p / "checksums.json").write_text((p / "checksums.json").read_text().replace("0", "1", 1)),
    "edited freescale.json": lambda p: (p / "freescale.json").write_text(
        (p / "freescale.json").read_text().replace('"step": 2', '"step": 3')),
    "checksums deleted from freescale.json": lambda p: _edit_meta(p, drop=("integrity", "meta_hash"),
                                                                  config={"edited": True}),  # (fields all well-typed)
}


def _edit_meta(path: Path, drop: tuple[str, ...] = (), **fields: Any) -> None:
    meta = json.loads((path / "freescale.json").read_text())
    (path / "freescale.json").write_text(json.dumps({**{k: v for k, v in meta.items() if k not in drop}, **fields}))


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    """Whatever is damaged, loading raises ``CheckpointDamaged`` in one line naming the file, before or while
    DCP reads it (never a silent load, never DCP's traceback), and the older checkpoint still loads."""
    from freescale.checkpoint_integrity import CheckpointDamaged, verify_all

    newest = _two_checkpoints(tmp_path)
    assert verify_all(newest, checkpoint.read_meta(newest)) > 200_000
    DAMAGES[damage](newest)
    state = {"w": torch.zeros(50_000), "b": torch.zeros(7), "extra": {"k": 0}}
    with pytest.raises(CheckpointDamaged) as raised:
        checkpoint.load(newest, state)
    message = str(raised.value)
    assert "\n" not in message and str(newest) in message, message
    assert ("its checksum is gone" in message) == (damage == "checksums deleted from freescale.json"), message
    with pytest.raises(CheckpointDamaged):
        verify_all(newest, checkpoint.read_meta(newest))
    older = checkpoint.complete_checkpoints(tmp_path)[0][1]
    assert checkpoint.load(older, state)["step"] == 1 and torch.all(state["w"] == 1.0)


def test_checkpoint_without_checksums_loads_unverified(tmp_path: Path) -> None:
    """A checkpoint written before checksums existed (no ``integrity`` entry, no manifest) still loads."""
    import json

    newest = _two_checkpoints(tmp_path)
    meta = json.loads((newest / "freescale.json").read_text())
    for key in ("integrity", "meta_hash"):
        meta.pop(key)
    (newest / "freescale.json").write_text(json.dumps(meta))
    (newest / "checksums.json").unlink()
    state = {"w": torch.zeros(50_000), "b": torch.zeros(7), "extra": {"k": 0}}
    loaded = checkpoint.load(newest, state)
    assert loaded["step"] == 2 and not checkpoint.is_verified(loaded) and torch.all(state["w"] == 2.0)


@pytest.mark.parametrize("field, value", [("step", "abc"), ("step", 999), ("step", -1), ("world_size", 0),
                                          ("data", 7), ("config", [1]), ("ft", {"replicas": "2"}), ("plan", {"w_table": {"shards": 3}}),
                                          ("layouts", {"w": {"cuts": [0, 8], "dim": "8", "rows": 4}})])
def test_a_hand_edited_field_of_a_checkpoint_without_checksums_is_refused_naming_it(
        tmp_path: Path, field: str, value: Any) -> None:
    """Without checksums nothing else catches a hand edit: each field freescale reads is of the type it wrote (the
    step the one its directory is named after), else one line naming the field, before any byte is loaded."""
    newest = _two_checkpoints(tmp_path)
    (newest / "checksums.json").unlink()
    _edit_meta(newest, drop=("integrity", "meta_hash"), **{field: value})
    with pytest.raises(checkpoint.CheckpointDamaged, match=f"freescale.json: field '{field.split('.')[0]}"):
        checkpoint.read_meta(newest)
