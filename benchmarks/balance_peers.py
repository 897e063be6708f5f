"""Public balancers run beside ours in ``bench_balance.py`` (benchmark only, never a runtime dependency).

- ``recsys_kk``: NVIDIA recsys-examples' C++ Karmarkar-Karp (``examples/commons/perf_model/
  csrc/kk_partition.cpp``, equal-size KK that releases the GIL), compiled here with
  ``torch.utils.cpp_extension`` from a checkout:
  ``git clone https://github.com/NVIDIA/recsys-examples`` and pass ``--recsys-examples DIR``
  (or set ``RECSYS_EXAMPLES``).
- ``verl_kk``: verl's pure-Python Karmarkar-Karp (``verl/utils/seqlen_balancing.py``; the same
  code ships as ``examples/commons/perf_model/partitioner.py`` in recsys-examples, which is where
  it is loaded from).

Both take integer workloads: costs are scaled to int64 (``2**40`` for the heaviest sample), so
their ties and ours agree to ~1e-12.  Each peer becomes ``(costs, parts, equal_count) -> (Parts,
seconds)``: the seconds of its own call (with pybind11's list <-> vector copies for the C++ one),
not our conversions to and from its list types.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from freescale.dataloader.partition import Parts

Peer = Callable[[np.ndarray, int, bool], tuple[Parts, float]]
CPP = Path("examples/commons/perf_model/csrc/kk_partition.cpp")
PYTHON_KK = Path("examples/commons/perf_model/partitioner.py")


def _workloads(costs: np.ndarray) -> np.ndarray:
    top = float(costs.max()) if costs.size else 0.0
    return np.rint(costs / top * 2.0**40).astype(np.int64) if top > 0 else np.zeros(costs.size, dtype=np.int64)


def _as_parts(partitions: list[list[int]], num_parts: int) -> Parts:
    return Parts.of_list([np.asarray(p, dtype=np.int64) for p in partitions] + [np.zeros(0, dtype=np.int64)]
                         * (num_parts - len(partitions)))


def _peer(kk: Callable[[list[int], int, bool], list[list[int]]], always_equal: bool) -> Peer:
    """``kk(workloads, parts, equal_size)`` as a ``Peer``, timing its call only."""
    def run(costs: np.ndarray, num_parts: int, equal_count: bool) -> tuple[Parts, float]:
        workloads = _workloads(costs).tolist()
        start = time.perf_counter()
        partitions = kk(workloads, num_parts, always_equal or equal_count)
        return _as_parts(partitions, num_parts), time.perf_counter() - start
    return run


def load(checkout: str | None) -> tuple[dict[str, Peer], dict[str, str]]:
    """The peers found under ``checkout`` (or ``$RECSYS_EXAMPLES``), and why any is missing."""
    root = Path(checkout or os.environ.get("RECSYS_EXAMPLES", ""))
    peers: dict[str, Peer] = {}
    missing: dict[str, str] = {}
    if not str(root) or not (root / CPP).is_file():
        why = "pass --recsys-examples DIR (a clone of github.com/NVIDIA/recsys-examples)"
        return peers, {"recsys_kk": why, "verl_kk": why}
    try:
        from torch.utils.cpp_extension import load as load_extension

        module = load_extension(name="kk_cpu_ops", sources=[str(root / CPP)], extra_cflags=["-O3", "-std=c++17"],
                                verbose=False)
        peers["recsys_kk"] = _peer(module.karmarkar_karp, always_equal=True)  # an equal-size KK
    except Exception as exc:  # a compiler or header missing: report, run the rest
        missing["recsys_kk"] = f"could not build {CPP}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    spec = importlib.util.spec_from_file_location("verl_kk_peer", root / PYTHON_KK)
    assert spec is not None and spec.loader is not None
    python_kk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(python_kk)
    peers["verl_kk"] = _peer(python_kk._karmarkar_karp_python, always_equal=False)  # (its nvtx-free path)
    return peers, missing
