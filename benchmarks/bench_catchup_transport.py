"""Catch-up transport alone: one model's state from a source process into a fresh receiver, freescale vs torchft.

The failure runs of ``bench_ft.py`` time a catch-up inside a training job, where on this 2-core machine
three trainers share the cores and the figure is mostly contention.  This script times the transport
itself on the same state (``mlp_replica``'s MLP and its AdamW state after one step: 617 MB at the
default 4096 x 4), source and receiver in their own processes, interleaved repeats:

- ``freescale``: the source stages the state (``SnapshotServer.stage``: host tensors are served live,
  from where they are, with no copy; a job's fence before the next update would withdraw them, here
  nothing updates) and serves it; the receiver's ``fetch_snapshot`` reads it into its own model and optimizer tensors
  (the ones that exist; AdamW's state is adopted as received) and loads the rest
  (``FaultTolerance.load``'s work for a plain optimizer).
- ``freescale_copy``: the same with the source copying its state into a staging buffer first (what
  a GPU's state always gets, and a host state after a transfer was cut): its set-up is that copy.
- ``torchft``: the source's ``HTTPTransport.send_checkpoint`` (torchft's default transport: the state
  dict is streamed with ``torch.save``; ``num_chunks=0``), the receiver's ``recv_checkpoint`` then
  ``model.load_state_dict`` + ``optimizer.load_state_dict`` (what torchft's healing does).

Timed on the receiver from its request to the state loaded (end to end), plus the source's
staging/serving set-up.  ``--busy N`` runs N processes that keep a core busy with torch matmuls
beside both (contention like a training job's, the same for both systems).  torchft is optional:
without it its rows say why.

    python benchmarks/bench_catchup_transport.py [--quick] [--busy 1] [--json benchmarks/results/catchup_transport_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import write_json
from mlp_replica import build_model

from freescale.tables import print_table

HERE = Path(__file__)


def model_and_optimizer(hidden: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.set_num_threads(1)
    model = build_model(hidden, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def trained_state(hidden: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The source's state: one AdamW step taken (so the optimizer holds its moments)."""
    model, optimizer = model_and_optimizer(hidden, layers)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def source(system: str, hidden: int, layers: int) -> None:
    model, optimizer = trained_state(hidden, layers)
    start = time.perf_counter()
    if system.startswith("freescale"):
        from freescale.ft.catchup import SnapshotServer
        from freescale.ft.snapshot_state import named_tensors

        server = SnapshotServer(live=system == "freescale")
        address = server.start()
        server.stage(1, dict(named_tensors({"model": model.state_dict(), "optim": optimizer.state_dict()}, "")))
        if not server.live:
            server.wait_staged()  # the copy is done (a copied snapshot stays served after its fence)
    else:
        from torchft.checkpointing.http_transport import HTTPTransport

        transport: Any = HTTPTransport(timedelta(seconds=60), num_chunks=0)
        transport.send_checkpoint([1], 1, {"model": model.state_dict(), "optim": optimizer.state_dict()},
                                  timedelta(seconds=60))
        address = transport.metadata()
    print(json.dumps({"address": address, "setup_s": time.perf_counter() - start}), flush=True)
    sys.stdin.read()  # until the driver closes it


def receive(system: str, address: str, hidden: int, layers: int) -> None:
    model, optimizer = model_and_optimizer(hidden, layers)
    start = time.perf_counter()
    if system.startswith("freescale"):
        from freescale.ft.snapshot_fetch import fetch_snapshot
        from freescale.ft.snapshot_state import load_torch_optimizer, named_tensors

        own = dict(named_tensors({"model": model.state_dict(), "optim": optimizer.state_dict()}, ""))
        fetched = fetch_snapshot(address, 1, own=own)
        arrived = time.perf_counter()
        load_torch_optimizer(optimizer, fetched.tensors)
        with torch.no_grad():  # the parameters landed in place: nothing to copy unless one did not fit
            for name, t in own.items():
                if t.data_ptr() != fetched.tensors[name].data_ptr() and not name.startswith("/optim/"):
                    t.copy_(fetched.tensors[name])
        nbytes = fetched.nbytes
    else:
        from torchft.checkpointing.http_transport import HTTPTransport

        transport: Any = HTTPTransport(timedelta(seconds=60), num_chunks=0)
        state = transport.recv_checkpoint(0, address, 1, timedelta(seconds=60))
        arrived = time.perf_counter()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
            t.numel() * t.element_size() for s in optimizer.state_dict()["state"].values() for t in s.values())
    done = time.perf_counter()
    probe = next(iter(model.parameters())).detach().reshape(-1)[:4].tolist()
    print(json.dumps({"end_to_end_s": done - start, "transfer_s": arrived - start, "load_s": done - arrived,
                      "bytes": nbytes, "probe": probe}), flush=True)


def burner() -> None:
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(HERE), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_transfer(system: str, hidden: int, layers: int) -> dict[str, Any]:
    src = spawn("--role", "source", "--system", system, "--hidden", str(hidden), "--layers", str(layers))
    try:
        assert src.stdout is not None
        offer = json.loads(src.stdout.readline())
        rcv = subprocess.run([sys.executable, str(HERE), "--role", "receive", "--system", system, "--address",
                              offer["address"], "--hidden", str(hidden), "--layers", str(layers)],
                             capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if rcv.returncode != 0:
            raise RuntimeError(f"{system} receiver failed: {rcv.stderr[-1500:]}")
        return {**json.loads(rcv.stdout.strip().splitlines()[-1]), "source_setup_s": offer["setup_s"]}
    finally:
        src.kill()
        src.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["driver", "source", "receive", "burn"], default="driver")
    parser.add_argument("--system", choices=["freescale", "freescale_copy", "torchft"], default="freescale")
    parser.add_argument("--address", default="")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="CPU-burning processes beside the transfer")
    parser.add_argument("--quick", action="store_true", help="2048 x 4 (157 MB), 3 repeats")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.role == "source":
        return source(args.system, args.hidden, args.layers)
    if args.role == "receive":
        return receive(args.system, args.address, args.hidden, args.layers)
    if args.role == "burn":
        return burner()
    if args.quick:
        args.hidden, args.repeats = 2048, 3
    try:
        import torchft  # noqa: F401

        systems, why = ["freescale", "freescale_copy", "torchft"], ""
    except ImportError as exc:
        systems, why = ["freescale", "freescale_copy"], f"torchft not installed ({exc}); see bench_ft.py for how"
    burners = [spawn("--role", "burn") for _ in range(args.busy)]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    try:
        for _ in range(args.repeats):
            for system in systems:
                runs[system].append(one_transfer(system, args.hidden, args.layers))
    finally:
        for b in burners:
            b.kill()
    probes = {s: r[0]["probe"] for s, r in runs.items()}
    assert len({json.dumps(p) for p in probes.values()}) == 1, f"the receivers hold different weights: {probes}"
    rows = []
    for system, results in runs.items():
        e2e = np.array([r["end_to_end_s"] for r in results])
        nbytes = results[0]["bytes"]
        rows.append({"system": system, "state_MB": round(nbytes / 1e6), "repeats": len(results),
                     "end_to_end_s": f"{np.median(e2e):.3f} ({e2e.min():.3f}..{e2e.max():.3f})",
                     "GB_per_s": f"{nbytes / np.median(e2e) / 1e9:.2f} ({nbytes / e2e.max() / 1e9:.2f}.."
                                 f"{nbytes / e2e.min() / 1e9:.2f})",
                     "transfer_s": float(np.median([r["transfer_s"] for r in results])),
                     "load_s": float(np.median([r["load_s"] for r in results])),
                     "source_setup_s": float(np.median([r["source_setup_s"] for r in results])),
                     "end_to_end_all_s": e2e.tolist()})
    peer = next((r for r in rows if r["system"] == "torchft"), None)
    for row in rows[:2] if peer is not None else []:
        ratios = [f / t for f, t in zip(row["end_to_end_all_s"], peer["end_to_end_all_s"])]
        row["vs_torchft"] = f"{np.median(ratios):.2f}x time ({min(ratios):.2f}..{max(ratios):.2f}, paired)"
    print_table(rows, ["system", "state_MB", "end_to_end_s", "GB_per_s", "transfer_s", "load_s", "source_setup_s",
                       "vs_torchft"])
    print(f"busy processes beside: {args.busy}; end to end: the receiver's request to the state loaded"
          + (f"; {why}" if why else ""))
    if args.json:
        write_json(args.json, "bench_catchup_transport", {"hidden": args.hidden, "layers": args.layers,
                                                          "busy": args.busy, "repeats": args.repeats,
                                                          "torchft_skipped": why or None}, rows)


if __name__ == "__main__":
    main()
