"""Every Triton kernel compiled ahead of time for Hopper (sm_90a) and Blackwell (sm_100a), no GPU needed.

For each kernel in ``freescale.kernels`` x each autotune config its pruning keeps x dtype (fp32,
bf16, fp16) x head dim (32, 64, 128; rows of 256 / 1,024 / 4,096 for the fused norm) x with and
without the relative bias, ``triton.compile`` builds PTX and a cubin for the target, and the
``ptxas`` inside the triton wheel (``-v``) reports registers per thread, spill stores / loads
(bytes per thread) and shared memory per block.  From those and the target's limits
(64 K registers, 228 KB shared memory, 64 warps and 32 blocks per SM; 227 KB per block, 255
registers per thread), the theoretical occupancy: resident warps per SM over 64.

Per row: compiled or the compiler's one-line error, ``regs``, ``spill_stores``, ``spill_loads``,
``smem_bytes``, ``blocks_per_sm``, ``occupancy``, ``verdict`` (``ok``, ``spills``, ``no_fit``
(more shared memory than a block may have: can never launch), ``error``), and whether the kernel
module's own pruning keeps it (``kept``).

    python benchmarks/compile_kernels.py [--quick] [--workers N] [--json benchmarks/results/compile_kernels.json]

``--quick``: bf16 x head dim 128 (and the norm at width 1,024) on sm_90a.  Results are cached per
(kernel source, Triton version, case) under ``~/.cache/freescale/compile_kernels`` (``--no-cache``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TARGETS = {"sm_90a": 90, "sm_100a": 100}
REGS_PER_SM, SMEM_PER_SM, SMEM_PER_BLOCK, MAX_WARPS, MAX_BLOCKS = 65536, 233472, 232448, 64, 32
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "freescale" / "compile_kernels"


@dataclass(frozen=True)
class Case:
    kernel: str  # "attention.forward" | "attention.backward_dkdv" | "attention.backward_dq" | "norm.forward" | "norm.backward"
    target: str
    dtype: str
    dim: int  # head dim (attention) or row width (norm)
    bias: bool
    config: dict[str, int]
    num_warps: int
    num_stages: int
    kept: bool


_ATTENTION = "freescale.kernels.triton_hstu_attention"
_NORM = "freescale.kernels.triton_layer_norm_mul"
_ATTENTION_KERNELS = {"attention.forward": ("_fwd_kernel", "_forward_configs"),
                      "attention.backward_dkdv": ("_bwd_dkdv_kernel", "_backward_configs"),
                      "attention.backward_dq": ("_bwd_dq_kernel", "_backward_configs")}
_NORM_KERNELS = {"norm.forward": "_fwd_kernel", "norm.backward": "_bwd_kernel"}


def _kept(module: Any, name: str, configs: list[Any], meta: dict[str, Any]) -> list[Any]:
    """What the kernel module's own early pruning keeps (its rules and the kept-configs table)."""
    return list(module.prune_configs(name, configs, meta))


def cases(quick: bool) -> list[Case]:
    attention, norm = importlib.import_module(_ATTENTION), importlib.import_module(_NORM)
    out: list[Case] = []
    targets = ["sm_90a"] if quick else list(TARGETS)
    dtypes, dims, biases = (["bf16"], [128], [False]) if quick else (["fp32", "bf16", "fp16"], [32, 64, 128], [False, True])
    for target, name, dtype, dim, bias in itertools.product(targets, _ATTENTION_KERNELS, dtypes, dims, biases):
        configs = getattr(attention, _ATTENTION_KERNELS[name][1])()
        meta = {"BLOCK_A": dim, "BLOCK_V": dim, "Q": _empty(dtype), "HAS_POS": bias, "TARGET": target}
        kept = _kept(attention, name, configs, meta)
        out += [Case(name, target, dtype, dim, bias, dict(c.kwargs), c.num_warps, c.num_stages, c in kept)
                for c in configs]
    widths = [1024] if quick else [256, 1024, 4096]
    norm_dtypes = ["bf16"] if quick else ["fp32", "bf16"]
    for target, name, dtype, width in itertools.product(targets, _NORM_KERNELS, norm_dtypes, widths):
        configs = norm._configs()
        kept = _kept(norm, name, configs, {"BLOCK_D": width, "X": _empty(dtype), "TARGET": target})
        out += [Case(name, target, dtype, width, False, dict(c.kwargs), c.num_warps, c.num_stages, c in kept)
                for c in configs]
    return out


def _signature(fn: Any, types: dict[str, str], constexprs: dict[str, Any], aligned: set[str]) -> Any:
    """An ASTSource: every argument's type, constexpr values, and the 16-divisibility that Triton's
    launcher would find at run time (pointers, strides and head dims that are multiples of 16)."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in constexprs and (signature[n].startswith("*") or n in aligned)}
    return ASTSource(fn, signature, {(names.index(k),): v for k, v in constexprs.items()}, attrs)


def _empty(dtype: str) -> Any:
    """A tensor of the dtype: what the kernel modules' pruning and precision choice read."""
    import torch

    from freescale.kernels.tile_table import DTYPES

    return torch.empty(0, dtype=DTYPES[dtype])


def _attention_source(case: Case) -> Any:
    from freescale.kernels.hstu_attention import TIME_BUCKET_SUB_BITS

    module = importlib.import_module(_ATTENTION)
    fn = getattr(module, _ATTENTION_KERNELS[case.kernel][0])
    data = "*" + case.dtype  # the table's dtype names are Triton's element types
    types: dict[str, str] = {}
    for n in fn.arg_names:
        if n in ("Q", "K", "V", "Out", "dO", "dK", "dV", "dQ"):
            types[n] = data
        elif n in ("seq_offsets", "num_targets", "QTime", "KTime"):
            types[n] = "*i64"
        elif n == "Work":  # the work list (``_work_lists``)
            types[n] = "*i64"
        elif n in ("PosW", "TimeW", "dPosW", "dTimeW"):
            types[n] = "*fp32" if case.bias or n.startswith("d") else "*i64"
        elif n in ("alpha", "inv_n"):
            types[n] = "fp32"
        else:
            types[n] = "i32"
    constexprs = {"HAS_POS": case.bias, "HAS_TIME": case.bias, "SUB_BITS": TIME_BUCKET_SUB_BITS, "HAS_TARGETS": False,
                  "BLOCK_A": case.dim, "BLOCK_V": case.dim, "PRECISION": module._precision(_empty(case.dtype)),
                  **case.config}
    aligned = {n for n in fn.arg_names if n.startswith("stride_")} | {"A", "Vd"}
    return _signature(fn, types, constexprs, aligned)


def _norm_source(case: Case) -> Any:
    fn = getattr(importlib.import_module(_NORM), _NORM_KERNELS[case.kernel])
    data = "*" + case.dtype  # the table's dtype names are Triton's element types
    scalars = {"T": "i32", "D": "i32", "eps": "fp32", "inv_d": "fp32"}
    types = {n: scalars.get(n) or ("i32" if n.startswith("stride_") else
                                  "*fp32" if n in ("Mean", "Rstd", "DW_partial", "DB_partial") else data)
             for n in fn.arg_names}
    aligned = {n for n in fn.arg_names if n.startswith("stride_")} | {"D"}
    return _signature(fn, types, {"BLOCK_D": case.dim, **case.config}, aligned)


def _ptxas_report(ptx: str, target: str) -> dict[str, int]:
    """Registers, spill bytes and shared memory, read off ``ptxas -v`` for the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(TARGETS[target]).path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name={target}", str(path), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    text = done.stderr + done.stdout
    if done.returncode or "Used " not in text:
        raise RuntimeError(f"ptxas failed ({done.returncode}): {text.strip().splitlines()[-1:] or 'no output'}")

    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0
    return {"regs": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack_bytes": number(r"(\d+) bytes stack frame")}


def occupancy(regs: int, smem: int, warps: int) -> tuple[int, float]:
    """Blocks per SM and resident warps / 64 from registers per thread and shared memory per block."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * warps)
    by_smem = SMEM_PER_SM // (smem + 1024) if smem else MAX_BLOCKS  # 1 KB per block reserved
    blocks = max(0, min(MAX_WARPS // warps, by_regs, by_smem, MAX_BLOCKS))
    return blocks, blocks * warps / MAX_WARPS


def compile_case(case: Case) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget

    row = _identity(case)
    source = _attention_source(case) if case.kernel.startswith("attention") else _norm_source(case)
    started = time.perf_counter()
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", TARGETS[case.target], 32),
                                  options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    except Exception as exc:  # noqa: BLE001 - the compiler's refusal is the finding
        return {**row, "verdict": "error", "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}",
                "seconds": time.perf_counter() - started}
    try:
        report = _ptxas_report(compiled.asm["ptx"], case.target)
    except RuntimeError as exc:
        return {**row, "verdict": "error", "error": str(exc)[:300], "seconds": time.perf_counter() - started}
    smem = int(compiled.metadata.shared)
    blocks, occ = occupancy(report["regs"], smem, case.num_warps)
    verdict = "no_fit" if smem > SMEM_PER_BLOCK else "spills" if report["spill_stores"] else "ok"
    return {**row, **report, "smem_bytes": smem, "blocks_per_sm": blocks, "occupancy": occ, "verdict": verdict,
            "seconds": time.perf_counter() - started}


def _jit_sources(module_name: str) -> str:
    """The source of every ``@triton.jit`` function in a module: what a compile depends on (config
    lists, wrappers and docstrings around them do not)."""
    import triton

    module = importlib.import_module(module_name)
    return "".join(v.src for _, v in sorted(vars(module).items()) if isinstance(v, triton.runtime.JITFunction))


@functools.cache
def _toolchain() -> str:
    """What else a compile's outcome depends on: Triton, both ptxas builds, the attention wrapper's
    dot precision, and this script's own signature building and judging."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = [subprocess.run([get_ptxas(arch).path, "--version"], capture_output=True, text=True).stdout
             for arch in TARGETS.values()]
    attention = importlib.import_module(_ATTENTION)
    ours = [inspect.getsource(f) for f in (_signature, _attention_source, _norm_source, _ptxas_report, compile_case)]
    return json.dumps([triton.__version__, ptxas, inspect.getsource(attention._precision), ours])


def _cache_key(case: Case) -> str:
    sources = _jit_sources(_ATTENTION if case.kernel.startswith("attention") else _NORM)
    compiled = {k: v for k, v in asdict(case).items() if k != "kept"}
    text = json.dumps([_toolchain(), sources, compiled], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _identity(case: Case) -> dict[str, Any]:
    """The case's fields as a row: the compile's outcome does not depend on whether pruning keeps it."""
    from freescale.kernels import tile_table

    return {**asdict(case), "config": "x".join(str(v) for v in case.config.values()),
            "config_id": tile_table.config_name(list(case.config.values()), case.num_warps, case.num_stages)}


def _cached_compile(case: Case) -> dict[str, Any]:
    path = CACHE / f"{_cache_key(case)}.json"
    if path.exists():
        return {**json.loads(path.read_text()), **_identity(case), "cached": True}
    row = compile_case(case)
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row))
    return {**row, "cached": False}


def run(selected: list[Case], workers: int, cache: bool) -> list[dict[str, Any]]:
    job = _cached_compile if cache else compile_case
    if workers <= 1:
        return [job(c) for c in selected]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(job, selected, chunksize=4))


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (kernel, target, dtype, dim, bias): configs kept, of those ok / spilling / not fitting / failing."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["target"], r["dtype"], r["dim"], r["bias"]), []).append(r)
    out = []
    for (kernel, target, dtype, dim, bias), members in groups.items():
        kept = [m for m in members if m["kept"]]
        count = lambda verdict: sum(m["verdict"] == verdict for m in kept)  # noqa: E731
        ok = [m for m in kept if m["verdict"] == "ok"]
        out.append({"kernel": kernel, "target": target, "dtype": dtype, "dim": dim, "bias": bias, "kept": len(kept),
                    "ok": count("ok"), "spills": count("spills"), "no_fit": count("no_fit"), "error": count("error"),
                    "max_regs": max((m.get("regs", 0) for m in kept), default=0),
                    "worst_spill": max((m.get("spill_stores", 0) for m in kept), default=0),
                    "best_occupancy": max((m["occupancy"] for m in ok), default=0.0)})
    return out


SMALL_SPILL_BYTES = 32
"""Spill stores per thread a kept config may have: measured on an H100 (results/gpu_all_h100*.json), the
backward dK/dV kernel at head dim 128 in bf16 ran 20% faster fwd+bwd with its 32x64 tile (24 B spilled by
this Triton's ptxas) than with the best tile that spills nothing; a few spilled registers stay in L1."""


def kept_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kernel -> target -> "dtype/width/bias|plain" -> the configs that fit and compile without spilling
    more than ``SMALL_SPILL_BYTES`` (every candidate, kept or not, is judged; those that spill a little
    are listed under ``small_spill``); where none does, the one that spills least, marked."""
    import triton

    from freescale.kernels import tile_table

    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["kernel"], r["target"], tile_table.entry_key(r["dtype"], r["dim"], r["bias"]))
        groups.setdefault(key, []).append(r)
    table: dict[str, Any] = {"_meta": {"triton": triton.__version__, "small_spill_bytes": SMALL_SPILL_BYTES}}
    for (kernel, target, shape), members in sorted(groups.items()):
        small = [m["config_id"] for m in members
                 if m["verdict"] == "spills" and m["spill_stores"] <= SMALL_SPILL_BYTES]
        ok = [m["config_id"] for m in members if m["verdict"] == "ok"] + small
        entry: dict[str, Any] = {"configs": sorted(ok), **({"small_spill": sorted(small)} if small else {})}
        if not ok:
            fits = [m for m in members if m["verdict"] == "spills"]
            least = min(fits, key=lambda m: m["spill_stores"]) if fits else None
            entry = {"configs": [least["config_id"]] if least else [],
                     "exception": f"every candidate spills; kept the least ({least['spill_stores']} B/thread)"
                     if least else "no candidate compiles and fits"}
        table.setdefault(kernel, {}).setdefault(target, {})[shape] = entry
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--write-kept", metavar="PATH",
                        help="write the kept-configs table (kernels/kept_configs.json) from this run")
    args = parser.parse_args()
    from common import write_json

    from freescale.tables import print_table

    started = time.perf_counter()
    rows = run(cases(args.quick), args.workers, not args.no_cache)
    table = summary(rows)
    print_table(table, ["kernel", "target", "dtype", "dim", "bias", "kept", "ok", "spills", "no_fit", "error",
                        "max_regs", "worst_spill", "best_occupancy"])
    bad = [r for r in rows if r["kept"] and r["verdict"] != "ok"]
    print(f"{len(rows)} compiles ({sum(r.get('cached', False) for r in rows)} cached) in "
          f"{time.perf_counter() - started:.0f} s; kept configs that spill, cannot fit or fail: {len(bad)}")
    if args.write_kept:
        Path(args.write_kept).write_text(json.dumps(kept_table(rows), indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.write_kept}")
    if args.json:
        import triton

        write_json(args.json, "compile_kernels", {"quick": args.quick, "triton": triton.__version__,
                                                  "targets": list(TARGETS)}, rows)


if __name__ == "__main__":
    main()
