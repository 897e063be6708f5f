"""The Triton kernels compile for Hopper without a GPU, and no config the autotuner keeps spills more
than a few registers (``compile_kernels.SMALL_SPILL_BYTES``, measured on an H100: see its docstring).

A subset of ``benchmarks/compile_kernels.py`` (the full report is committed under
benchmarks/results/): the attention kernels at bf16 and head dim 128, the fused norm's at
width 1,024, ahead of time for sm_90a with the ``ptxas`` inside the triton wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import compile_kernels  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """The script's --quick run, in a process of its own: conftest interprets Triton kernels here
    (TRITON_INTERPRET=1), and a compile needs the real JIT."""
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compile_kernels.py"), "--quick", "--workers", "2",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return [r for r in json.loads(out.read_text())["rows"] if r["kept"]]


def test_every_kernel_has_kept_configs_and_none_spills_more_than_a_little(report: list[dict[str, object]]) -> None:
    kernels = {r["kernel"] for r in report}
    assert kernels == {"attention.forward", "attention.backward_dkdv", "attention.backward_dq",
                       "norm.forward", "norm.backward"}
    bad = [f"{r['kernel']} {r['dtype']} {r['config']}/{r['num_warps']}w: {r['verdict']} "
           f"({r.get('regs')} regs, {r.get('spill_stores')} B spilled, {r.get('smem_bytes')} B smem, {r.get('error', '')})"
           for r in report if not (r["verdict"] == "ok" or (r["verdict"] == "spills" and
                                                                int(r["spill_stores"]) <= compile_kernels.SMALL_SPILL_BYTES))]
    assert not bad, "\n".join(bad)


def test_occupancy_follows_the_targets_limits() -> None:
    # 128 regs x 4 warps: 4 blocks by registers (65536 / (128 * 32 * 4)), 16 warps of 64.
    assert compile_kernels.occupancy(128, 0, 4) == (4, 0.25)
    # 255 regs round up to 256 per thread: 2 blocks of 4 warps.
    assert compile_kernels.occupancy(255, 0, 4) == (2, 0.125)
    # Shared memory bound: 100 KB per block (plus 1 KB reserved) fits twice in 228 KB.
    assert compile_kernels.occupancy(32, 100 * 1024, 4) == (2, 0.125)
    # More shared memory than an SM has: never resident.
    assert compile_kernels.occupancy(32, 240 * 1024, 4) == (0, 0.0)
