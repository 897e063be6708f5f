"""A background save's pacing (``write_pacing``) and the copy-on-write row keep (``row_copy``), in one process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from freescale import checkpoint, row_copy
from freescale import checkpoint_integrity as integrity
from freescale.staging import _Table
from freescale.write_pacing import Pacer


def _spin(seconds: float, pacer: Pacer) -> None:
    """Burn ``seconds`` of this thread's CPU, pausing every 1 ms of it."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        mark = time.thread_time() + 0.001
        while time.thread_time() < mark:
            pass
        pacer.pause()


def test_the_pacer_keeps_a_thread_to_its_share_and_lets_go_when_released() -> None:
    """At a quarter of a core, 40 ms of CPU take at least 160 ms of wall time (the bound holds at every pause,
    whatever the machine's load); released (even before the write began), the same work sleeps no more."""
    pacer = Pacer(0.25)
    pacer.arm()
    pacer.begin()
    started = time.perf_counter()
    _spin(0.04, pacer)
    pacer.end()
    assert time.perf_counter() - started >= 0.04 / 0.25 - 0.005
    assert 0.035 < pacer.cpu_s < 0.2
    pacer.arm()
    pacer.release()  # (before the write began: the training waits for it already)
    pacer.begin()
    started = time.perf_counter()
    _spin(0.04, pacer)
    assert pacer.slept_s == 0.0 and not pacer.active
    unpaced = Pacer(0.0)
    unpaced.begin()
    _spin(0.01, unpaced)
    assert unpaced.slept_s == 0.0


def test_a_paced_background_save_is_the_unpaced_one_and_a_wait_ends_its_pacing(tmp_path: Path) -> None:
    """The same state saved paced (a two-hundredth of a core) and at full speed: both verify and load back equal.  The
    paced write is slow on its own; ``wait`` (the training waits for it) lets it finish at full speed."""
    state = {"model": {"w": torch.randn(512, 1024), "b": torch.arange(1000, dtype=torch.bfloat16)}}
    paced = checkpoint.CheckpointWriter(asynchronous=True, write_share=0.005)
    paced.start(tmp_path / "paced", 1, state, {"note": "paced"})
    time.sleep(0.2)
    assert paced.busy, "a two-hundredth of a core: DCP's plan, 2 MB and their hashes are not written in 0.2 s"
    started = time.perf_counter()
    (path, _), = [paced.wait()]
    assert time.perf_counter() - started < 5.0
    assert paced.pacer.slept_s > 0
    full = checkpoint.CheckpointWriter(asynchronous=True)
    full.start(tmp_path / "full", 1, state, {"note": "full"})
    (other, _), = [full.wait()]
    assert full.pacer.slept_s == 0.0
    for saved in (path, other):
        assert integrity.verify_all(saved, checkpoint.read_meta(saved)) > 0
        loaded = {"model": {"w": torch.empty(512, 1024), "b": torch.empty(1000, dtype=torch.bfloat16)}}
        checkpoint.load(saved, loaded)
        assert torch.equal(loaded["model"]["w"], state["model"]["w"])
        assert torch.equal(loaded["model"]["b"], state["model"]["b"])


def test_a_write_the_training_waits_for_at_once_is_not_paced(tmp_path: Path) -> None:
    """``wait`` right after ``start`` (the last step's save: the writer's thread may not have begun yet) ends the
    pacing all the same: at a thousandth of a core the write would take minutes."""
    state = {"model": {"w": torch.randn(256, 1024)}}
    writer = checkpoint.CheckpointWriter(asynchronous=True, write_share=0.001)
    started = time.perf_counter()
    writer.start(tmp_path, 1, state, {"note": "last"})
    writer.wait()
    assert time.perf_counter() - started < 10.0
    assert writer.pacer.slept_s < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_the_row_keep_copies_each_new_row_once_as_torch_would(dtype: torch.dtype) -> None:
    """``_Table.keep`` on CPU (``row_copy``'s kernels) against the torch path: rows outside the table or below
    the cursor, rows kept before and repeated rows are left alone; the weight rows and the 1-wide state rows
    kept equal the live ones; the rest of the host buffers is untouched."""
    torch.manual_seed(0)
    rows, first, cursor = 1000, 37, 100
    live = [(torch.randn(rows, 12) * 100).to(dtype), torch.randn(rows).to(dtype)]
    flat = torch.randint(0, rows + 2 * first, (3000,))
    results = []
    for kernels in (True, False):
        host = [torch.zeros_like(t) for t in live]
        saved = torch.zeros(rows, dtype=torch.bool)
        saved[150:160] = True  # kept by an earlier lookup: their host rows hold older values
        table = _Table(0, first, rows, live, host, cursor, saved)
        usable = row_copy.usable
        try:
            if not kernels:
                row_copy.usable = lambda *tensors: False  # type: ignore[assignment]
            table.keep(flat)
        finally:
            row_copy.usable = usable  # type: ignore[assignment]
        results.append((host, saved))
    (fast, fast_saved), (slow, slow_saved) = results
    assert torch.equal(fast_saved, slow_saved)
    expected = flat - first
    expected = expected[(expected >= cursor) & (expected < rows)].unique()
    expected = expected[(expected < 150) | (expected >= 160)]
    assert int(fast_saved.sum()) == expected.numel() + 10
    for f, s, t in zip(fast, slow, live):
        assert torch.equal(f, s)
        assert torch.equal(f[expected], t[expected])
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[expected] = False
        assert not f[untouched].any()
