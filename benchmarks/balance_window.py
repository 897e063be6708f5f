"""Windowed planning inside a training run (``bench_balance.py``): does any step's batch come late?

Rank 0 of a simulated 1,024 ranks trains with a planning window of 16 (each window plans
16 global batches at once: 16 x 1,024 x 32 = 524,288 samples in one partition).  The step is
30 ms of matmuls on the training thread; the loader prefetches 2 batches on its thread.  The
loader's wait per step (``StepInfo.wait_s``) is measured in three modes:

- ``halfway``: the next window planned halfway through the current one
  (``BalancedLoader._plan_next_window``, the default);
- ``burst``: that turned off: each window is planned when its first step is produced;
- ``preplanned``: every window planned before training starts: what is left is reading
  (rank 0 decodes each row group its rows lie in), the floor planning cannot go below.

Reading is taken out of the measure: every row group rank 0 reads is decoded into the source's
cache before training (at 1,024 ranks each rank touches every row group of a window for its 32
rows, and decoding new row groups at a window's start makes steps late whatever the planner
does: a loader matter, reported apart).  What is left is planning, on the producer thread in
every mode: a step is late only when a window's plan takes longer than the prefetched steps
(``prefetch x step``); ``halfway`` moves the plan off the window's first step, it does not make
it cheaper.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from freescale.dataloader import SyntheticSpec, generate
from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.loader import BalancedLoader
from freescale.models import ModelConfig, cost_model_for

RANKS, WINDOW, STEP_S = 1024, 16, 0.030


def _data(root: str, rows: int) -> Path:
    path = Path(root) / f"rows{rows}_len16"
    if not (path / "dataset.json").is_file():
        generate(path, SyntheticSpec(rows=rows, eval_rows=0, max_len=16, lengths="ml-20m", seed=0))
    return path


def _step(x: torch.Tensor) -> None:
    """About ``STEP_S`` of compute on the training thread (torch releases the GIL inside)."""
    end = time.perf_counter() + STEP_S
    while time.perf_counter() < end:
        x @ x


def _run(path: Path, per_rank: int, steps: int, mode: str) -> tuple[list[float], float]:
    cfg = DataConfig(path=str(path), batch_size=per_rank, window=WINDOW, prefetch=2, max_seq_len=16)
    loader = build_loader(cfg, "train", rank=0, world_size=RANKS, sparse_features=["history_item_ids"],
                          derived_cost=cost_model_for(ModelConfig(kind="hstu"), 8), seed=0)
    source = loader.source
    source._cache_size = len(source.rg_rows)  # benchmark only: every row group decoded once, up front
    for group in range(len(source.rg_rows)):
        source._row_group(group)
    x = torch.randn(256, 256)
    waits, plan_s = [], 0.0
    patch = mock.patch.object(BalancedLoader, "_plan_next_window", lambda *a: None) if mode != "halfway" else None
    try:
        if patch:
            patch.start()
        if mode == "preplanned":
            loader.planner.windows_kept = loader.steps_per_epoch // WINDOW + 2
            for first in range(0, loader.steps_per_epoch, WINDOW):
                start = time.perf_counter()
                loader.planner.plan_window(0, first, tuple(range(RANKS)))
                plan_s = max(plan_s, time.perf_counter() - start)
        loader.next_batch()  # the first window is planned before training starts, in every mode
        for _ in range(steps):
            _step(x)
            loader.next_batch()
            assert loader.last is not None
            waits.append(loader.last.wait_s)
    finally:
        loader.close()
        if patch:
            patch.stop()
    return waits, plan_s


def window_rows(root: str, quick: bool) -> list[dict[str, Any]]:
    per_rank = 8 if quick else 32
    steps = 2 * WINDOW + 2 if quick else 3 * WINDOW + 2
    path = _data(root, RANKS * per_rank * (steps + 2))
    rows = []
    for mode in ("preplanned", "halfway", "burst"):
        measured, plan_s = _run(path, per_rank, steps, mode)
        waits = 1e3 * np.array(measured)
        rows.append({"mode": mode, "ranks": RANKS, "per_rank": per_rank, "window": WINDOW, "steps": steps,
                     "step_ms": 1e3 * STEP_S, "wait_ms_p50": float(np.median(waits)),
                     "wait_ms_p99": float(np.percentile(waits, 99)), "wait_ms_max": float(waits.max()),
                     "late_steps": int((waits > 1.0).sum()), "late_ms_total": float(waits[waits > 1.0].sum()),
                     **({"window_plan_ms": 1e3 * plan_s} if mode == "preplanned" else {})})
    return rows
