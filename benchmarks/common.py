"""Shared by the benchmark scripts: machine/version facts, a printed table, JSON rows."""

from __future__ import annotations

import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "ci": os.environ.get("CI") == "true",
    }
    for package in ("torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu", "pyarrow", "triton"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - machine facts must never sink a benchmark
        info["gpu"] = None
    return info


def free_port() -> int:
    """A free TCP port on the loopback (for a server a benchmark starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_json(path: str | Path, benchmark: str, params: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    out = {"benchmark": benchmark, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
           "params": params, "rows": rows}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
