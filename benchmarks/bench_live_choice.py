"""A large state and fast steps: what a source's choice between serving live and copying costs.

A catch-up source serves its host tensors live (no copy) and fences before its next update: the
fence waits for the transfer, up to ``fence_wait_s`` (``LIVE_FENCE_WAIT_S``, 1 s), then cuts it and
the fetcher retries asking for a copy.  ``always_live`` is that alone; ``chosen`` is the source as
built: ``SnapshotServer.stage`` is given the step time and copies up front when the payload, at the
rate it last measured (1 GB/s before it has: every repeat here is a fresh source), would be cut
(``expected_live_cut``: not across within the step plus ``fence_wait_s``).

Both run the same source loop in their own process: ``mlp_replica``'s MLP and its AdamW state
(617 MB at 4096 x 4), steps of ``--step-ms`` (a sleep stands in for forward and backward, so the
machine's two cores go to the transfer and the copy), the fence before each update, an update that
writes the step number into the first element of every tensor (so a torn snapshot would show), and
a staging whenever a fetcher waits.  A receiver process fetches from it as ``SnapshotFetch`` does
(a retry after a broken transfer asks for a copy) and checks that every tensor carries the
snapshot's step.  Reported per mode, medians over ``--repeats``: the receiver's first request to the
whole state (end to end), its attempts, the source's longest and total fence wait, the transfers cut.

A cut needs a transfer longer than the step plus 1 s: more than about 2.5 GB on this machine's
loopback.  ``--fence-wait-s 0.1`` scales the fence's bound down instead, so the 617 MB state is in
that regime here; with the default bound both modes serve live.

    python benchmarks/bench_live_choice.py [--quick] [--step-ms 50] [--fence-wait-s 0.1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_catchup_transport import trained_state
from common import write_json

from freescale.tables import print_table

HERE = Path(__file__)
MODES = ("always_live", "chosen")


def source(mode: str, hidden: int, layers: int, step_s: float, fence_wait_s: float, done: str) -> None:
    from freescale.ft.catchup import SnapshotServer
    from freescale.ft.snapshot_state import named_tensors

    model, optimizer = trained_state(hidden, layers)
    tensors = dict(named_tensors({"model": model.state_dict(), "optim": optimizer.state_dict()}, ""))
    flat = [t.reshape(-1) for t in tensors.values() if t.numel() > 1]
    server = SnapshotServer(fence_wait_s=fence_wait_s)
    print(json.dumps({"address": server.start()}), flush=True)
    fences: list[float] = []
    choices: list[bool] = []
    step, deadline = 0, time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.exists(done):
        time.sleep(step_s)  # forward and backward: they only read the state
        start = time.perf_counter()
        server.wait_staged()  # the fence before the update
        fences.append(time.perf_counter() - start)
        step += 1
        with torch.no_grad():
            for t in flat:
                t[0] = step
        if server.wants(step):  # a fetcher waits: stage this commit (as the layer does)
            server.stage(step, tensors, None if mode == "always_live" else step_s)
            choices.append(bool(server.choice["live"]))
    print(json.dumps({"fences": fences, "cut": server.cut_transfers, "live": choices}), flush=True)


def receive(address: str) -> None:
    from freescale.ft.snapshot_fetch import fetch_snapshot

    start = time.perf_counter()
    attempts = 0
    while True:
        attempts += 1
        try:
            fetched = fetch_snapshot(address, 1, timeout_s=60, copied=attempts > 1)
            break
        except (ConnectionError, OSError, RuntimeError) as exc:
            if attempts >= 5:
                raise SystemExit(f"bench_live_choice: 5 attempts failed, the last: {exc}") from exc
    took = time.perf_counter() - start
    torn = [n for n, t in fetched.tensors.items() if t.numel() > 1 and n != "meta.json"
            and float(t.reshape(-1)[0]) != fetched.step]
    print(json.dumps({"end_to_end_s": took, "attempts": attempts, "step": fetched.step, "torn": torn,
                      "bytes": fetched.nbytes}), flush=True)


def one_catch_up(mode: str, args: argparse.Namespace, flag: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    Path(f"{flag}.done").unlink(missing_ok=True)
    src = subprocess.Popen([sys.executable, str(HERE), "--role", "source", "--mode", mode, "--hidden", str(args.hidden),
                            "--layers", str(args.layers), "--step-ms", str(args.step_ms), "--fence-wait-s",
                            str(args.fence_wait_s), str(flag)],
                           stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert src.stdout is not None
        address = json.loads(src.stdout.readline())["address"]
        time.sleep(1.0)  # a few steps before the fetcher asks
        rcv = subprocess.run([sys.executable, str(HERE), "--role", "receive", "--address", address],
                             capture_output=True, text=True, timeout=300, env=env)
        Path(f"{flag}.done").touch()
        if rcv.returncode != 0:
            raise RuntimeError(f"{mode}: the receiver failed: {rcv.stderr[-1500:]}")
        got = json.loads(rcv.stdout.strip().splitlines()[-1])
        served = json.loads(src.stdout.readline())
    finally:
        src.kill()
        src.wait()
    # Nothing is staged before the fetcher asks: every fence that waited, waited for this catch-up.
    return {**got, "fence_max_s": max(served["fences"]), "fence_total_s": sum(served["fences"]),
            "cut": served["cut"], "live": served["live"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["driver", "source", "receive"], default="driver")
    parser.add_argument("--mode", choices=MODES, default="chosen")
    parser.add_argument("--address", default="")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--fence-wait-s", type=float, default=1.0, help="the fence's bound (LIVE_FENCE_WAIT_S)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2048 x 4 (157 MB), 2 repeats")
    parser.add_argument("--json")
    parser.add_argument("flag", nargs="?", default="")
    args = parser.parse_args()
    if args.role == "source":
        return source(args.mode, args.hidden, args.layers, args.step_ms / 1e3, args.fence_wait_s, f"{args.flag}.done")
    if args.role == "receive":
        return receive(args.address)
    if args.quick:
        args.hidden, args.repeats = 2048, 2
    flag = Path(f"/tmp/bench_live_choice.{os.getpid()}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES[:: 1 if r % 2 == 0 else -1]:
            runs[mode].append(one_catch_up(mode, args, flag))
    rows = []
    for mode, results in runs.items():
        assert not any(r["torn"] for r in results), f"{mode}: a fetched snapshot was torn"

        def med(key: str, results: list[dict[str, Any]] = results) -> float:
            return float(np.median([r[key] for r in results]))
        rows.append({"mode": mode, "state_MB": round(results[0]["bytes"] / 1e6), "step_ms": args.step_ms,
                     "fence_wait_s": args.fence_wait_s,
                     "end_to_end_s": f"{med('end_to_end_s'):.3f} ({min(r['end_to_end_s'] for r in results):.3f}.."
                                     f"{max(r['end_to_end_s'] for r in results):.3f})",
                     "attempts": med("attempts"), "source_fence_max_s": round(med("fence_max_s"), 3),
                     "source_fence_total_s": round(med("fence_total_s"), 3), "cut": med("cut"),
                     "first_staging": "live" if results[0]["live"][:1] == [True] else "copied", "runs": results})
    print_table(rows, ["mode", "state_MB", "step_ms", "fence_wait_s", "end_to_end_s", "attempts", "source_fence_max_s",
                       "source_fence_total_s", "cut", "first_staging"])
    if args.json:
        write_json(args.json, "bench_live_choice", {"hidden": args.hidden, "layers": args.layers, "step_ms": args.step_ms,
                                                    "fence_wait_s": args.fence_wait_s, "repeats": args.repeats}, rows)


if __name__ == "__main__":
    main()
