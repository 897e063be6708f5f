"""The lighthouse under load, and how fast it comes back: the control plane's claims (issue 20).

Two measures, one table each:

1. **start to serving**: ``freescale lighthouse`` started as a user starts it (a new process,
   ``--state`` file), timed from ``Popen`` to the first ``GET /v1/status`` answered 200.
   Target <= 0.5 s.  Fresh starts and restarts on an existing state file alike.
2. **load**: simulated ranks (asyncio coroutines on loopback, one process) speak the real
   protocol to a real ``freescale lighthouse`` process: a heartbeat every 50 ms per rank, the
   step's quorum (all members of every group join, then the steady path: a committed vote's
   reply carries the next quorum), and every rank's commit vote per step after ``--step-ms`` of
   "compute".  Per size: requests/s the lighthouse answered, heartbeats answered as a fraction
   of those sent for (``held``: below 1 the simulator or the lighthouse fell behind), the
   quorum *formation* latency (last member's join request to its answer), the vote
   *decision* latency (the step's last ballot sent to each rank's answer), P50/P99, and the
   lighthouse's CPU (utime + stime over the measured window; 100% = one core).

Every rank speaking for itself is what the code does today.  ``--speakers group`` simulates one
speaker per replica group (heartbeats, quorum and vote sent once per group): the load that
per-group aggregation would leave, which is *not built yet*; those rows say so.

The simulator and the lighthouse share this machine's cores: on a 2-core VM a size whose
``held`` falls below 1 is as much the simulator's limit as the lighthouse's; the lighthouse's
CPU column tells which.  Targets (issue 20): P99 quorum decision <= 50 ms at 4,096 ranks;
serving within 0.5 s of start.

    python benchmarks/bench_lighthouse.py --quick
    python benchmarks/bench_lighthouse.py --json benchmarks/results/lighthouse_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, write_json  # noqa: E402

from freescale.tables import print_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def start_lighthouse(port: int, state: Path, heartbeat_timeout: float = 3.0) -> tuple[subprocess.Popen[bytes], float]:
    """A ``freescale lighthouse`` process and the seconds from its start to a 200 on /v1/status."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "freescale.cli", "lighthouse", "--bind", f"127.0.0.1:{port}",
                             "--state", str(state), "--heartbeat-timeout", str(heartbeat_timeout),
                             "--join-timeout", "5", "--max-request-bytes", "65536"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=1) as answer:
                if answer.status == 200:
                    return proc, time.perf_counter() - start
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the lighthouse exited with status {proc.returncode}") from None
            time.sleep(0.002)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_start(repeats: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.json"
        for kind in ("fresh", "restart"):
            times = []
            for _ in range(repeats):
                if kind == "fresh":
                    state.unlink(missing_ok=True)
                else:  # a state file from a run that reached a step, as a restart finds it
                    state.write_text('{"format": "freescale-lighthouse-state/1", "run_id": "r", "quorum_id": 7, '
                                     '"high_step": 120, "finished_step": null, "holders_quorum_id": 7, '
                                     '"holders": {"replica0": 0, "replica1": 0}}')
                proc, seconds = start_lighthouse(free_port(), state)
                proc.terminate()
                proc.wait()
                times.append(seconds)
            rows.append({"measure": "start_to_serving", "kind": kind, "repeats": repeats,
                         "p50_s": float(np.median(times)), "max_s": max(times), "target_s": 0.5,
                         "met": max(times) <= 0.5})
    return rows


@dataclass
class Load:
    """What the simulated ranks saw."""

    requests: int = 0
    beats_sent_for: int = 0
    beats_answered: int = 0
    formation_s: list[float] = field(default_factory=list)
    decision_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last_ballot: dict[int, float] = field(default_factory=dict)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], load: Load) -> dict[str, Any]:
    """One request; an error or a timeout (an overloaded lighthouse) is counted and answers {}."""
    try:
        async with session.post(url, json=body) as answer:
            load.requests += 1
            payload: dict[str, Any] = await answer.json()
            if answer.status != 200:
                load.errors.append(f"{url.rsplit('/', 1)[1]} {answer.status}: {payload.get('error', '')[:120]}")
            return payload
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        load.errors.append(f"{url.rsplit('/', 1)[1]}: {type(exc).__name__}")
        return {}


async def _beats(session: aiohttp.ClientSession, base: str, who: dict[str, Any], load: Load, stop: asyncio.Event,
                 interval_s: float) -> None:
    started = time.perf_counter()
    while not stop.is_set():
        await _post(session, f"{base}/v1/heartbeat", who, load)
        load.beats_answered += 1
        await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - started) % interval_s))
    load.beats_sent_for += int((time.perf_counter() - started) / interval_s)


async def _speaker(session: aiohttp.ClientSession, base: str, who: dict[str, Any], steps: int, step_s: float,
                   speakers: int, load: Load, arrived: list[float]) -> None:
    """One speaker's steps: join the quorum, then per step compute and vote (the vote's answer
    carries the next quorum)."""
    arrived.append(time.perf_counter())
    quorum = await _post(session, f"{base}/v1/quorum", {**who, "step": 0, "last_quorum_id": 0}, load)
    load.formation_s.append(time.perf_counter() - max(arrived) if len(arrived) == speakers else float("nan"))
    for step in range(steps):
        await asyncio.sleep(step_s)
        if "quorum_id" not in quorum:
            return
        sent = time.perf_counter()
        load.last_ballot[step] = max(load.last_ballot.get(step, 0.0), sent)
        vote = await _post(session, f"{base}/v1/commit",
                           {**who, "quorum_id": quorum["quorum_id"], "step": step, "ok": True}, load)
        load.decision_s.append(time.perf_counter() - load.last_ballot[step])
        quorum = vote.get("next") or await _post(session, f"{base}/v1/quorum",
                                                 {**who, "step": step + 1, "last_quorum_id": quorum["quorum_id"]}, load)


async def _simulate(base: str, groups: int, group_size: int, steps: int, step_s: float, run_id: str,
                    interval_s: float, max_s: float = 120.0) -> Load:
    load, stop, arrived = Load(), asyncio.Event(), []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
        identities = [{"replica_id": f"replica{g}", "incarnation": 0, "member": m, "group_size": group_size,
                       "run_id": run_id} for g in range(groups) for m in range(group_size)]
        beats = [asyncio.create_task(_beats(session, base, who, load, stop, interval_s)) for who in identities]
        await asyncio.sleep(2 * interval_s)  # every member known before anyone asks
        try:
            await asyncio.wait_for(asyncio.gather(*(_speaker(session, base, who, steps, step_s, len(identities), load,
                                                            arrived) for who in identities)), max_s)
        except asyncio.TimeoutError:
            load.errors.append(f"the steps did not finish within {max_s:.0f} s")
        stop.set()
        await asyncio.gather(*beats)
        await _post(session, f"{base}/v1/finish", {**identities[0], "step": steps - 1}, load)
    return load


def bench_load(ranks: int, group_size: int, speakers: str, steps: int, step_ms: float, interval_s: float) -> dict[str, Any]:
    groups = ranks // group_size
    simulated_size = group_size if speakers == "rank" else 1
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc, _ = start_lighthouse(port, Path(tmp) / "state.json")
        try:
            cpu0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            load = asyncio.run(_simulate(f"http://127.0.0.1:{port}", groups, simulated_size, steps, step_ms / 1e3,
                                         f"bench-{ranks}-{speakers}", interval_s))
            wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait()
    decision = np.array(load.decision_s) * 1e3
    formation = np.array([x for x in load.formation_s if x == x]) * 1e3
    return {
        "measure": "load", "ranks": ranks, "groups": groups, "speakers": speakers,
        "built": speakers == "rank", "steps": steps, "step_ms": step_ms, "heartbeat_interval_s": interval_s,
        "requests_per_s": load.requests / wall, "held": load.beats_answered / max(1, load.beats_sent_for),
        "formation_ms": float(formation.max()) if formation.size else float("nan"),
        "decision_p50_ms": float(np.percentile(decision, 50)) if decision.size else float("nan"),
        "decision_p99_ms": float(np.percentile(decision, 99)) if decision.size else float("nan"),
        "lighthouse_cpu": cpu / wall, "errors": len(load.errors), "first_error": load.errors[0] if load.errors else "",
        "steps_done": len(load.last_ballot),
    }


def _more_files() -> None:
    """Every simulated rank holds two connections (and the lighthouse as many): raise the soft limit
    on open files to the hard one, for this process and the lighthouse it starts."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    _more_files()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized: 64 and 256 ranks, fewer steps (< 60 s)")
    parser.add_argument("--ranks", default="", help="comma-separated rank counts (default 64,256,1024,4096)")
    parser.add_argument("--group-size", type=int, default=8, help="ranks per replica group (default 8)")
    parser.add_argument("--steps", type=int, default=0, help="steps per size (default 20; 8 with --quick)")
    parser.add_argument("--step-ms", type=float, default=200.0, help="simulated compute per step (default 200)")
    parser.add_argument("--heartbeat-interval", type=float, default=0.05, help="seconds (the client's default 0.05)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")] if args.ranks else ([64, 256] if args.quick else [64, 256, 1024, 4096])
    steps = args.steps or (8 if args.quick else 20)
    start_rows = bench_start(3 if args.quick else 10)
    print("freescale lighthouse: process start to serving (target <= 0.5 s)")
    print_table([{"kind": r["kind"], "repeats": r["repeats"], "P50 s": f"{r['p50_s']:.3f}", "max s": f"{r['max_s']:.3f}",
                  "met": r["met"]} for r in start_rows], ["kind", "repeats", "P50 s", "max s", "met"])
    load_rows = []
    for ranks in sizes:
        for speakers in ("rank", "group"):
            row = bench_load(ranks, args.group_size, speakers, steps, args.step_ms, args.heartbeat_interval)
            load_rows.append(row)
            print(f"  {ranks} ranks, speakers={speakers}: {row['requests_per_s']:.0f} req/s, held {row['held']:.2f}, "
                  f"decision P99 {row['decision_p99_ms']:.1f} ms", flush=True)
    columns = ["ranks", "groups", "speakers", "req/s", "held", "formation ms", "decision P50 ms", "P99 ms",
               "lighthouse CPU", "errors"]
    print("lighthouse under load (simulated ranks on loopback, real protocol)")
    print_table([dict(zip(columns, [
        r["ranks"], r["groups"], r["speakers"] + ("" if r["built"] else " (not built)"), f"{r['requests_per_s']:.0f}",
        f"{r['held']:.2f}", f"{r['formation_ms']:.1f}", f"{r['decision_p50_ms']:.1f}", f"{r['decision_p99_ms']:.1f}",
        f"{100 * r['lighthouse_cpu']:.0f}%", r["errors"]])) for r in load_rows], columns)
    if args.json:
        write_json(args.json, "lighthouse", {"quick": args.quick, "sizes": sizes, "group_size": args.group_size,
                                             "steps": steps, "step_ms": args.step_ms,
                                             "heartbeat_interval_s": args.heartbeat_interval},
                   start_rows + load_rows)


if __name__ == "__main__":
    main()
