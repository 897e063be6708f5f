"""Shared fixtures: a tiny synthetic dataset and helpers that run the real CLI."""

from __future__ import annotations

import os

# Triton has no CPU backend: without CUDA its kernels run in the interpreter, and
# unwritten kernel outputs are NaN so a test cannot pass on stale memory.  Both
# must be set before anything imports the kernels.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FREESCALE_POISON_KERNEL_OUTPUTS", "1")

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``freescale ARGS`` in a fresh interpreter; returns the finished process (never raises on rc)."""
    return subprocess.run(
        [sys.executable, "-m", "freescale.cli", *args],
        cwd=cwd or REPO, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )


def read_log(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "train_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(log: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in log if e["event"] == name]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20k train / 4k eval (test) / 2k validation rows, generated once per session through the library."""
    from freescale.dataloader import SyntheticSpec, generate

    out = tmp_path_factory.mktemp("data") / "tiny"
    generate(out, SyntheticSpec(rows=20_000, eval_rows=4_096, valid_rows=2_048, row_group_size=4_096, seed=0))
    return out
