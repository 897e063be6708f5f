"""The replica processes ``bench_ft.py`` runs and reads: freescale's (``mlp_replica.py``, started as a process of
its own or forked from ``freescale launch``'s fork server), torchft's (``torchft_replica.py``), their logs, and
each system's lighthouse."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from mlp_replica import group_of

from freescale.ft.lighthouse import Lighthouse, LighthouseConfig
from freescale.testing import FAULTS_ENV

TORCHFT_INSTALL = ("pip download torchft-nightly --no-deps -d /tmp/tft && pip install --no-deps /tmp/tft/*.whl, "
                   "then its pure-python imports, also --no-deps: opentelemetry-api opentelemetry-sdk "
                   "opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http "
                   "opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common "
                   "opentelemetry-exporter-http-transport opentelemetry-proto protobuf googleapis-common-protos "
                   "importlib-metadata zipp lazy-importer (torch stays as it is)")
TORCHFT_REPLICA = Path(__file__).with_name("torchft_replica.py")
MLP_REPLICA = Path(__file__).with_name("mlp_replica.py")
TFT_CHILDREN: list[subprocess.Popen[str]] = []
CPUS_OF: dict[str, str] = {}
"""Replica name -> the CPUs its processes are pinned to (``BENCH_CPUS``; ``bench_ft --own-core``), both systems."""


def torchft_version() -> tuple[str | None, str]:
    """(torchft's version, "") when it imports, else (None, why not)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    try:
        import torchft  # noqa: F401
        from torchft.coordination import LighthouseServer  # noqa: F401
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    for dist in ("torchft-nightly", "torchft"):
        try:
            return metadata.version(dist), ""
        except metadata.PackageNotFoundError:
            pass
    return "unknown", ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fault_env(name: str, kill: bool) -> dict[str, str]:
    """``FREESCALE_FAULTS`` (``freescale.testing``): replica ``name`` SIGKILLs itself as step 20's exchange begins."""
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    env.pop(FAULTS_ENV, None)
    if kill:
        env[FAULTS_ENV] = f"{group_of(name)}:0:20:reduce:0"
    env.pop("BENCH_CPUS", None)
    if name in CPUS_OF:
        env["BENCH_CPUS"] = CPUS_OF[name]
    return env


def killed_at(out: Path, name: str) -> float:
    return float((out / name / "rank0.killed").read_text())


def replica(out: Path, name: str, steps: int, *extra: str, kill: bool = False,
            server: Any = None) -> subprocess.Popen[str]:
    """A replica process; with ``server`` (a ``freescale.forkserver.ForkServer``) forked from it, as ``freescale
    launch -- python mlp_replica.py`` starts each rank."""
    command = [str(MLP_REPLICA), "--replica-id", name, "--steps", str(steps), "--out", str(out), *extra]
    env = fault_env(name, kill)
    if server is not None:
        command, env = ["-m", "freescale.forkserver", "--script", *command], {**env, **server.env}
    return subprocess.Popen([sys.executable, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)


def tft_replica(out: Path, name: str, steps: int, *extra: str, kill: bool = False) -> subprocess.Popen[str]:
    """A torchft replica; its stderr (torchft logs a line per reconfiguration) goes to ``<out>/<name>.err``."""
    with open(out / f"{name}.err", "a") as err:
        proc = subprocess.Popen([sys.executable, str(TORCHFT_REPLICA), "--replica-id", name, "--steps", str(steps),
                                 "--out", str(out), *extra], stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env={**fault_env(name, kill), "RUST_LOG": "warn"})
    TFT_CHILDREN.append(proc)
    return proc


def torchft_failed(e: BaseException, what: str) -> str:
    """Stop the torchft replicas still running after a failed run; the torchft column's text."""
    for proc in TFT_CHILDREN:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    TFT_CHILDREN.clear()
    print(f"bench_ft: torchft {what}: {e}", file=sys.stderr)
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return f"failed: {lines[-1][:200]}"


def read(out: Path, name: str) -> list[dict[str, Any]]:
    path = out / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def committed(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The committed steps (torchft replicas also log the attempts torchft discarded)."""
    return [e for e in log if e.get("should_commit", True)]


def wait_all(procs: list[subprocess.Popen[str]], timeout: float = 600, out: Path | None = None) -> None:
    for p in procs:
        if p.wait(timeout=timeout) not in (0, -9):
            err = p.stderr.read()[-3000:] if p.stderr else ""
            if out is not None:
                err += "".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(out.glob("*.err")))
            raise SystemExit(f"bench_ft: a replica failed:\n{err}")


def step_ms(log: list[dict[str, Any]], skip: int = 5) -> float:
    times = [e["committed"] for e in log[skip:]]
    return float(np.median(np.diff(times)) * 1e3) if len(times) > 2 else float("nan")


def lighthouse() -> Lighthouse:
    lh = Lighthouse(LighthouseConfig(min_replicas=1, join_timeout_s=0.5, heartbeat_timeout_s=1.0))
    lh.start_in_thread()
    return lh


def tft_lighthouse() -> tuple[Any, str]:
    """torchft's Rust lighthouse, with freescale's timeouts: heartbeat 1 s, stragglers 0.5 s (quorum tick: 100 ms)."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    return lh, f"http://127.0.0.1:{lh.address().rsplit(':', 1)[1]}"
