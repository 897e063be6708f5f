"""Everything GPU-side in one command: on a machine with one CUDA GPU, checks and timings in <= 10 minutes.

    python benchmarks/gpu_all.py [--quick] [--budget-s 540] [--json benchmarks/results/gpu_<card>.json]

Sections, each in its own process (a kernel that faults the CUDA context, or a section that overruns
its share of the budget, cannot take the others down), rows merged into one JSON as each ends:

1. ``kernel_tests``: the kernels' unit tests compiled on the GPU (tests/test_triton_attention.py,
   tests/test_layer_norm_mul.py, tests/test_attention.py), with pytest-xdist where installed; and
   ``kernel_checks``: ``gpu_checks.py`` (every dtype x head dim at 1,024 tokens against float64),
   sharded over several processes.  The two run side by side: they are compile-bound (Triton
   compiles every autotune config of each specialization on first use) and the GPU idles.
2. ``kernels``: ``bench_kernels.py`` (jagged attention vs padded SDPA at 512..8,192, fused norm).
3. ``sm_free``: ``bench_sm_free.py`` (victim slowdown beside copy-engine vs SM copies).
4. ``copy_engine``: ``freescale.kernels.copy_engine`` on a one-rank NCCL group (symmetric memory,
   prioritized chunks): exact against the input, GB/s beside ``all_to_all_single``.
5. ``sm_free_backend``: ``gpu_sm_free_backend.py``, the SM-free backend's CUDA transport (CUDA IPC) with two
   ranks on the one GPU: exact against a local reference, GB/s at 1-256 MiB, a matmul's slowdown beside it.
6. ``training``: the tiny DLRM and HSTU on CUDA through ``freescale launch`` (NCCL, bf16), when
   torchrec's CUDA stack (torchrec + fbgemm-gpu) is installed; else one line saying so.

Without a CUDA GPU it prints one line and exits 0 (nothing ran, nothing failed).  Exit status:
0 every section that ran passed (a section with nothing to run here says so and counts as
"skipped"), 1 a section failed or overran, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHECK_SHARDS = 9
SECTIONS = ["kernel_tests", "kernel_checks", "kernels", "sm_free", "copy_engine", "sm_free_backend", "training"]
KERNEL_TESTS = ["tests/test_triton_attention.py", "tests/test_layer_norm_mul.py", "tests/test_attention.py"]


def _tail(text: str, lines: int = 120) -> str:
    return "\n".join(text.splitlines()[-lines:])


SKIPPED = 3
"""A section's exit status for "nothing to run here" (the training section without torchrec's CUDA stack)."""


class Run:
    """One section's process, in a session of its own (an overrun kills its children too: pytest-xdist
    workers, training ranks), output to a file (ten sections at once never block on a full pipe),
    waited on with a deadline."""

    def __init__(self, name: str, argv: list[str], out_json: Path | None, deadline: float) -> None:
        self.name, self.out_json, self.deadline = name, out_json, deadline
        self.started = time.monotonic()
        path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)  # `common` beside; freescale as installed
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def wait(self) -> dict[str, Any]:
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            status = {0: "passed", SKIPPED: "skipped"}.get(self.proc.returncode, "failed")
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            status = "overran"
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        result: dict[str, Any] = {"section": self.name, "status": status, "rc": self.proc.returncode,
                                  "seconds": round(time.monotonic() - self.started, 1), "output_tail": _tail(output)}
        if self.out_json is not None and self.out_json.exists():
            result["rows"] = json.loads(self.out_json.read_text()).get("rows", [])
        print(f"[gpu_all] {self.name}: {status} in {result['seconds']} s", flush=True)
        print(_tail(output, 25), flush=True)
        return result


def _device_facts() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    facts: dict[str, Any] = {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
                             "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
                             "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    return facts


def _pytest_argv() -> list[str]:
    import importlib.util

    # Failures first in the output's tail: no durations table, short tracebacks.
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=240",
            "--tb=short", "-rfE", *KERNEL_TESTS]
    if importlib.util.find_spec("xdist") is not None:
        argv += ["-n", "8"]
    return argv


def run_sections(args: argparse.Namespace, work: Path, write: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    start = time.monotonic()
    share = lambda fraction: start + fraction * args.budget_s  # noqa: E731 - deadline at a share of the budget
    py = sys.executable
    results: list[dict[str, Any]] = []

    wanted = set(args.sections)
    # 1. compile-bound checks, side by side
    first = [Run("kernel_tests", _pytest_argv(), None, share(0.45))] if "kernel_tests" in wanted else []
    if "kernel_checks" in wanted:
        first += [Run(f"kernel_checks_{i}", [py, str(HERE / "gpu_checks.py"), "--shard", f"{i}/{CHECK_SHARDS}",
                                             "--json", str(work / f"checks_{i}.json")], work / f"checks_{i}.json",
                      share(0.45)) for i in range(CHECK_SHARDS)]
    results += [r.wait() for r in first]
    write(results)
    # Shares of the budget, from the H100 runs: the compile-bound phase 88-144 s, kernels 52-83 s,
    # sm_free 13 s, copy_engine 7 s; sm_free_backend (two ranks started, never run yet) is guessed at 30 s and
    # bounds itself (--timeout-s); training (two CLI runs of 100 steps) gets the rest, at least 18%.
    timed_sections = [
        ("kernels", [py, str(HERE / "bench_kernels.py"), *(["--quick"] if args.quick else [])], 0.62),
        ("sm_free", [py, str(HERE / "bench_sm_free.py"), *(["--quick"] if args.quick else [])], 0.7),
        ("copy_engine", [py, str(Path(__file__)), "--section", "copy_engine"], 0.75),
        ("sm_free_backend", [py, str(HERE / "gpu_sm_free_backend.py"), "--timeout-s", "120",
                             *(["--quick"] if args.quick else [])], 0.82),
        ("training", [py, str(Path(__file__)), "--section", "training"], 1.0),
    ]
    for name, argv, fraction in [s for s in timed_sections if s[0] in wanted]:  # 2.-6. alone on the GPU
        out = work / f"{name}.json"
        results.append(Run(name, [*argv, "--json", str(out)], out, share(fraction)).wait())
        write(results)
    return results


def copy_engine_section(json_path: str) -> None:
    """One-rank NCCL group: the copy-engine path end to end (symmetric memory, chunks, barrier)."""
    import torch
    import torch.distributed as dist
    from common import write_json

    from freescale.kernels.copy_engine import CopyEngineAllToAll

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    rows = []
    try:
        engine = CopyEngineAllToAll(slot_bytes=512 << 20)
        for megabytes in (1, 64, 256):
            src = torch.randn(megabytes << 18, device="cuda")  # 4-byte floats
            low, high = torch.empty_like(src), torch.empty_like(src)
            engine.submit(low, src, [src.shape[0]], [src.shape[0]], priority=5)
            engine.submit(high, src * 2, [src.shape[0]], [src.shape[0]], priority=0)
            engine.flush()
            torch.cuda.synchronize()
            exact = bool(torch.equal(low, src) and torch.equal(high, src * 2))
            times = {}
            def through_copy_engines(out: torch.Tensor = low, data: torch.Tensor = src) -> None:
                engine.submit(out, data, [data.shape[0]], [data.shape[0]], 0)
                engine.flush()

            def through_nccl(out: torch.Tensor = low, data: torch.Tensor = src) -> None:
                dist.all_to_all_single(out, data, [data.shape[0]], [data.shape[0]])

            for name, fn in (("copy_engine", through_copy_engines), ("nccl", through_nccl)):
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
                times[name] = (time.perf_counter() - t0) / 10
            rows.append({"megabytes": megabytes, "uses_copy_engines": engine.uses_copy_engines, "exact": exact,
                         **{f"{k}_ms": v * 1e3 for k, v in times.items()},
                         **{f"{k}_GBps": (megabytes << 20) / v / 1e9 for k, v in times.items()}})
            print(rows[-1], flush=True)
    finally:
        dist.destroy_process_group()
    write_json(json_path, "gpu_copy_engine", {"world": 1}, rows)
    if not all(r["exact"] for r in rows):
        sys.exit(1)


def training_section(json_path: str) -> None:
    """The tiny models' steps on CUDA through the CLI, when torchrec's CUDA stack is there."""
    import importlib.util

    from common import write_json

    missing = [m for m in ("torchrec", "fbgemm_gpu") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"training: skipped, torchrec's CUDA stack is not installed (missing: {', '.join(missing)}); "
              "install fbgemm-gpu==1.8.0 and torchrec==1.8.0 for the CUDA torch to run it")
        write_json(json_path, "gpu_training", {"skipped": f"missing {', '.join(missing)}"}, [])
        sys.exit(SKIPPED)
    work = Path(json_path).parent / "training"
    cli = [sys.executable, "-m", "freescale.cli"]
    subprocess.run([*cli, "gen-data", "--out", str(work / "data"), "--rows", "40000", "--eval-rows", "4096",
                    "--max-len", "64", "--seed", "0"], check=True)
    rows = []
    for model in ("tiny_dlrm", "tiny_hstu"):
        started = time.perf_counter()
        done = subprocess.run([*cli, "launch", "--nproc-per-node", "1", "--config", f"configs/{model}.toml",
                               "--data.path", str(work / "data"), "--train.output_dir", str(work / model),
                               "--dist.backend", "nccl", "--train.precision", "bf16", "--train.steps", "100"],
                              capture_output=True, text=True)
        print(_tail(done.stdout + done.stderr, 10))
        rows.append({"model": model, "rc": done.returncode, "seconds": time.perf_counter() - started})
    write_json(json_path, "gpu_training", {"steps": 100, "precision": "bf16"}, rows)
    if any(r["rc"] for r in rows):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the benchmarks' --quick sizes")
    parser.add_argument("--budget-s", type=float, default=540.0, help="all sections together (default 540)")
    parser.add_argument("--json", help="one JSON with every section's status, output tail and rows")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS, help="default: all")
    parser.add_argument("--section", choices=["copy_engine", "training"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        {"copy_engine": copy_engine_section, "training": training_section}[args.section](args.json)
        return
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_all: no CUDA GPU found (torch {torch.__version__}); nothing to run")
        return
    sys.path.insert(0, str(HERE))
    from common import write_json

    facts = _device_facts()
    print(f"[gpu_all] {facts}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_all_"))  # each section's JSON; merged into --json

    def write(results: list[dict[str, Any]]) -> None:
        if args.json:
            write_json(args.json, "gpu_all", {**facts, "quick": args.quick, "budget_s": args.budget_s},
                       results)

    results = run_sections(args, work, write)
    write(results)
    print(f"[gpu_all] {facts['gpu']}: " + ", ".join(f"{r['section']} {r['status']}" for r in results))
    sys.exit(0 if all(r["status"] in ("passed", "skipped") for r in results) else 1)


if __name__ == "__main__":
    main()
