"""Fault-tolerance core on one machine: overhead, stall per failure, catch-up.

Replicas are real processes (``benchmarks/mlp_replica.py``: ``freescale.ft.FaultTolerance`` in a user loop) training
a ~1.3M-parameter MLP (256 -> 1024 -> 1024 -> 1, AdamW) on CPU with gloo, one rank per
replica, the lighthouse in this process (heartbeat timeout 1 s; crashes are found
through failure reports, not the timeout).  Runs:

- ``ddp``: 2 replicas under torch DDP over gloo (no fault tolerance; buckets
  reduced during backward): the baseline step time; ``allreduce``: the same
  with one flat all-reduce after backward instead (printed under the table);
- ``ftar``: the same 2 replicas through the lighthouse (quorum request
  overlapping the forward, sample-weighted FTAR, commit vote): per-step
  overhead over ``ddp``, measured in the same run (interleaved repeats);
- ``kill``: 3 replicas, one SIGKILLs itself mid all-reduce of step 20; the
  survivors' stall = the kill's time to their next committed step; steps
  discarded = committed steps missing from the survivors' logs (a redo of
  the same step counts as zero);
- ``catch-up``: that replica is restarted (new incarnation, from scratch): the
  survivors' step time while it catches up vs after it (``steady_after``: the same
  replicas at the same moment's load; the target's ratio) and vs before the restart
  (the old baseline, which mixes in the machine's drift), its
  restart-to-contributing time, and the snapshot transfer rate; repeated with a
  ~60M-parameter model (``--big-hidden``) so the transfer is not all latency;
- the job's side of both: the throughput it keeps from the kill to the run's end (contributions committed per
  second, over the same before the kill: ``throughput_kept``), where each design's choices meet (survivors that
  wait for a healing replica and contribute it sooner, against survivors that never wait for it).

torchft runs side by side, on the same machine and model: ``benchmarks/torchft_replica.py``
(a ``torchft.Manager`` with async quorum, ``min_replica_size=1``, a reconfigurable
``torchft.ProcessGroupGloo``, healing through its ``HTTPTransport``) under torchft's own
Rust lighthouse (``torchft.coordination.LighthouseServer`` in this process, heartbeat
timeout 1 s, join timeout 0.5 s like freescale's, quorum tick 100 ms: its default).
The same 2 replicas under torchft are interleaved with ``ddp`` and ``ftar`` in the overhead repeats; the kill
and restart runs are repeated with torchft replicas (same step, same kill point, same
``--step-sleep``).  torchft drops the step in which a peer dies (``should_commit`` false)
and its data loader moves on: the replica logs every attempt and the dropped ones are the
committed steps missing.  Healing: the survivors' step time from the step whose quorum
first holds the restarted replica to one step after its first contributing step, vs their
steps before; restart to contributing = restart to its first committed step with a
non-zero gradient (the healing step itself contributes zeros).  torchft is not a freescale
dependency: without it (``import torchft`` fails) its column is skipped and the script says why and how
to install it.  Only figures measured in the run are printed (none quoted from elsewhere).

    python benchmarks/bench_ft.py [--quick] [--no-torchft] [--json benchmarks/results/ft_cpu.json]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import write_json
from ft_processes import (
    CPUS_OF,
    TORCHFT_INSTALL,
    committed,
    free_port,
    killed_at,
    lighthouse,
    read,
    replica,
    step_ms,
    tft_lighthouse,
    tft_replica,
    torchft_failed,
    torchft_version,
    wait_all,
)
from ft_windows import during_ms, steady_after, steady_before, throughput_kept

from freescale.tables import print_table


def overhead(tmp: Path, steps: int, repeats: int, hidden: int, tft: bool) -> dict[str, Any]:
    ddp, flat, ftar, tf = [], [], [], []
    failed = ""
    for r in range(repeats):
        for mode, times in (("ddp", ddp), ("allreduce", flat)):
            out = tmp / f"{mode}{r}"
            out.mkdir()
            master = f"127.0.0.1:{free_port()}"
            wait_all([replica(out, n, steps, "--mode", mode, "--rank", str(i), "--world-size", "2", "--master", master,
                              "--hidden", str(hidden), "--layers", "2") for i, n in enumerate("ab")])
            times.append(step_ms(read(out, "a")))
        out = tmp / f"ftar{r}"
        out.mkdir()
        lh = lighthouse()
        wait_all([replica(out, n, steps, "--lighthouse", lh.url, "--wait-for", "2", "--hidden", str(hidden), "--layers", "2")
                  for n in "ab"])
        ftar.append(step_ms(read(out, "a")))
        lh.stop_thread()
        if tft and not failed:
            out = tmp / f"torchft{r}"
            out.mkdir()
            tlh, addr = tft_lighthouse()
            try:
                wait_all([tft_replica(out, n, steps, "--lighthouse", addr, "--wait-for", "2", "--hidden", str(hidden),
                                     "--layers", "2")
                          for n in "ab"], timeout=300, out=out)
                tf.append(step_ms(committed(read(out, "a"))))
            except (Exception, SystemExit) as e:
                failed = torchft_failed(e, "overhead run")
            tlh.shutdown()
    d, a, f = float(np.median(ddp)), float(np.median(flat)), float(np.median(ftar))
    row = {"measure": "per-step overhead vs torch DDP", "ddp_step_ms": d, "allreduce_step_ms": a, "ftar_step_ms": f,
           "freescale": f"+{f - d:.2f} ms ({(f - d) / d:.1%})", "target": "<= 1 ms or 5%",
           "vs_allreduce": f"+{f - a:.2f} ms ({(f - a) / a:.1%})"}
    if failed:
        row["torchft"] = failed
    elif tft:
        t = float(np.median(tf))
        row.update(torchft_step_ms=t, torchft=f"+{t - d:.2f} ms ({(t - d) / d:.1%})")
    return row


def freescale_failure(tmp: Path, steps: int, hidden: int, layers: int, label: str,
                      standby: bool = False, forked: bool = False, join: str = "record") -> dict[str, Any]:
    """Kill replica c at step 20 and restart it (``standby``: a warm standby started beside it takes over;
    its restart is then the kill; ``forked``: the restart is forked from a warm server that imported torch,
    torchrec and the layer when the job started, ``freescale.forkserver``, as under ``freescale launch``;
    ``join``: ``[ft] join``, ``wait``: the others wait for its gradients in the step it joins)."""
    out = tmp / f"kill-{label}{'-standby' if standby else ''}{'-forked' if forked else ''}-{join}"
    out.mkdir()
    if forked:
        from freescale.forkserver import LOOP_MODULES, ForkServer

        with ForkServer(LOOP_MODULES) as server:
            deadline = time.monotonic() + 120
            while not Path(server.path).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # as in a job: the server has long finished importing when a group dies
            return _failure(out, steps, hidden, layers, False, server, join)
    return _failure(out, steps, hidden, layers, standby, None, join)


def _failure(out: Path, steps: int, hidden: int, layers: int, standby: bool, server: Any, join: str) -> dict[str, Any]:
    lh = lighthouse()
    common = ["--lighthouse", lh.url, "--snapshots", "--hidden", str(hidden), "--layers", str(layers),
              "--step-sleep", "0.02", "--join", join]
    lock = ["--standby-lock", str(out / "c.lock")] if standby else []
    procs = {n: replica(out, n, steps, *common, "--wait-for", "3", *(lock if n == "c" else []),
                        *(["--log-name", "c_first"] if n == "c" else []), kill=n == "c") for n in "abc"}
    spare = None
    if standby:  # started once the active c holds the lock (it opens its log right after taking it)
        deadline = time.monotonic() + 120
        while not (out / "c_first.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        spare = replica(out, "c", steps, *common, *lock, "--incarnation", "1")
    procs["c"].wait(timeout=300)
    killed = killed_at(out, "c")
    restart = killed if standby else time.time()
    procs["c"] = spare or replica(out, "c", steps, *common, "--incarnation", "1", server=server)
    wait_all(list(procs.values()))
    logs = {n: read(out, n) for n in "ab"}
    c = read(out, "c")
    lh.stop_thread()
    # A step is discarded when no surviving replica committed it.
    discarded = len(set(range(steps)) - {e["step"] for log in logs.values() for e in log})
    # The survivor that never had to catch up itself (the one with a complete log) times the others' steps.
    a = max(logs.values(), key=len)
    after = min((e for e in a if e["committed"] > killed), key=lambda e: e["committed"])
    res: dict[str, Any] = {"kill_s": after["committed"] - killed, "discarded": discarded}
    res.update(throughput_kept([*logs.values(), read(out, "c_first"), c], a, killed,
                               lambda e: bool(e.get("contributing", True)), lambda e: int(e["step"])))
    if after.get("failed_at"):  # the kill's two parts: the survivor finds the attempt failed, then redoes it
        res.update(detect_s=after["failed_at"] - killed, redo_s=after["committed"] - after["failed_at"])
    if c:
        info = c[0]["catch_up"]
        joined, done = info["joined_step"], c[0]["step"]
        before_ms, before_window = steady_before(a, joined)
        res.update(before_ms=before_ms, before_window=before_window,
                   during_ms=during_ms(a, joined, done, after["step"]),
                   **steady_after(a, done), rate=info["bytes_per_s"], caught_up_s=info["finished"] - restart,
                   catch_up_s=info["caught_up"] - info["started"], bytes=info["bytes"],
                   behind_seen_s=info["started"] - restart,  # start-up, imports, model, first quorum
                   boot={**{k: round(t - restart, 3) for k, t in c[0].get("boot", {}).items()},  # its start-up's parts
                         "requested": round(info["started"] - restart, 3)},
                   phases={k: info.get(k) for k in ("source_wait_s", "transfer_s", "load_s", "replay_s",
                                                    "stale_at_arrival", "in_place_bytes")})
        # torchft's endpoint, for both: the restarted replica's first committed step that carries its gradient.
        first = next((e["committed"] for e in c if e.get("contributing") and e["step"] >= info["joined_step"]), None)
        # Both endpoints from the first request for state, as for torchft: its last byte, and the first commit
        # that carries its gradient.
        res["last_byte_s"], res["join"] = info["arrived"] - info["started"], info.get("join", "record")
        if first is not None:
            res["contributing_s"] = first - restart
            res["request_to_contributing_s"] = first - info["started"]
    return _with_ratios(res)


def torchft_failure(tmp: Path, steps: int, hidden: int, layers: int, label: str, sync: bool = False) -> dict[str, Any]:
    """The same kill and restart with torchft replicas under torchft's lighthouse (``sync``: the quorum
    and the heal before the forward, ``use_async_quorum=False``)."""
    out = tmp / f"torchft-kill-{label}{'-sync' if sync else ''}"
    out.mkdir()
    lh, addr = tft_lighthouse()
    try:
        common = ["--lighthouse", addr, "--hidden", str(hidden), "--layers", str(layers), "--step-sleep", "0.02",
                  *(["--sync-quorum"] if sync else [])]
        procs = {n: tft_replica(out, n, steps, *common, "--wait-for", "3",
                                kill=n == "c") for n in "abc"}
        procs["c"].wait(timeout=300)
        killed = killed_at(out, "c")
        (out / "c.jsonl").rename(out / "c_first.jsonl")
        restart = time.time()
        procs["c"] = tft_replica(out, "c", steps, *common)
        wait_all(list(procs.values()), timeout=300, out=out)
    finally:
        lh.shutdown()
    logs = {n: read(out, n) for n in "ab"}
    # Survivors' data steps run on past a discarded one: the holes among the steps they attempted.
    attempted = max(e["step"] for log in logs.values() for e in log) + 1
    discarded = len(set(range(attempted)) - {e["step"] for log in logs.values() for e in committed(log)})
    a = committed(max(logs.values(), key=len))
    after = min((e for e in a if e["committed"] > killed), key=lambda e: e["committed"])
    res: dict[str, Any] = {"kill_s": after["committed"] - killed, "discarded": discarded}
    attempts = read(out, "c")
    c = committed(attempts)
    # torchft's restarted replica numbers its data steps from 0: its manager's committed-step count is the
    # step every replica numbers alike.
    res.update(throughput_kept([*map(committed, logs.values()), committed(read(out, "c_first")), c], a, killed,
                               lambda e: bool(e.get("participating", True)), lambda e: int(e["manager_step"])))
    contributing = [e for e in c if e["participating"]]
    # The restarted replica's own data steps restart from 0: match steps through quorum ids and torchft's
    # committed-step count.  (Had it joined only after the survivors finished, it would have trained alone.)
    joined = next((e["step"] for e in a if c and e["quorum_id"] >= c[0]["quorum_id"]), None)
    if contributing and joined is not None:
        done = next((e["step"] for e in a if e["manager_step"] >= contributing[0]["manager_step"]), a[-1]["step"])
        healed = next((e for e in c if "heal_fetch_s" in e), None)
        before_ms, before_window = steady_before(a, joined)
        res.update(before_ms=before_ms, before_window=before_window,
                   during_ms=during_ms(a, joined, done, after["step"]),
                   **steady_after(a, done), contributing_s=contributing[0]["committed"] - restart,
                   rate=healed["heal_bytes"] / healed["heal_fetch_s"] if healed else float("nan"),
                   heals=sum(1 for e in c if "heal_fetch_s" in e))
        if healed:  # torchft's source serves its live state in the quorum (no wait): fetch + load
            requested = healed["heal_fetch_ended"] - healed["heal_fetch_s"]  # its first request for state
            boot = attempts[0].get("boot", {}) if attempts else {}
            res["boot"] = {**{k: round(t - restart, 3) for k, t in boot.items()}, "requested": round(requested - restart, 3)}
            res.update(last_byte_s=healed["heal_fetch_s"],
                       request_to_contributing_s=contributing[0]["committed"] - requested)
            res.update(catch_up_s=healed["heal_fetch_s"] + (healed.get("heal_load_s") or 0.0),
                       bytes=healed["heal_bytes"], phases={"transfer_s": healed["heal_fetch_s"],
                                                            "load_s": healed.get("heal_load_s")})
    return _with_ratios(res)


def _with_ratios(res: dict[str, Any]) -> dict[str, Any]:
    """``res`` with the survivors' step during the catch-up over after it and over before the restart (per run,
    so that repeats give each ratio's median and spread)."""
    if "during_ms" in res:
        res["before_ratio"] = res["during_ms"] / res["before_ms"]
        if "after_ms" in res:
            res["after_ratio"] = res["during_ms"] / res["after_ms"]
    return res


def repeated(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one failure run as one: each figure's median over the repeats that have it (finite), its
    (min, max) as ``<key>_range`` and, where some repeats lack it, how many have it as ``<key>_of``."""
    import math

    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in runs for k in r):
        found = [r[key] for r in runs if key in r]
        values = [v for v in found if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if not values:
            out[key] = found[0]
            continue
        out[key] = float(np.median(values))
        if len(values) > 1:
            out[f"{key}_range"] = (min(values), max(values))
        if len(values) < len(runs):
            out[f"{key}_of"] = f"{len(values)}/{len(runs)}"
    for parts in ("phases", "boot"):  # each part's median over the repeats (not the first repeat's)
        each = [r[parts] for r in runs if isinstance(r.get(parts), dict)]
        if len(each) == len(runs) > 1:
            out[parts] = {k: float(np.median([p[k] for p in each])) for k in each[0]
                          if all(isinstance(p.get(k), (int, float)) and not isinstance(p.get(k), bool) for p in each)}
    out["repeats"] = len(runs)
    out["runs"] = runs
    return out


def failure_rows(label: str, columns: dict[str, dict[str, Any] | str]) -> list[dict[str, Any]]:
    """One row per measure; a column's cell is its figure, or why it has none (a string)."""
    def cells(key: str, fmt: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, res in columns.items():  # (a figure not measured: its ``<key>_why``, else the catch-up's absence)
            out[name] = res if isinstance(res, str) else fmt(res) if key in res else res.get(f"{key}_why",
                                                                                              "never caught up")
            out[f"{name}_raw"] = None if isinstance(res, str) else res.get(key)
            if not isinstance(res, str) and f"{key}_range" in res:  # medians, with the spread over the repeats
                lo, hi = res[f"{key}_range"]
                out[name] += f" [{lo:.3g}..{hi:.3g}]"
                out[f"{name}_range"] = [lo, hi]
            if not isinstance(res, str) and f"{key}_of" in res:  # not every repeat has this figure
                out[name] += f" ({res[key + '_of']} runs)"
        return out

    def catch_up(r: dict[str, Any]) -> str:
        return f"{r['catch_up_s']:.2f} s = {r['bytes'] / r['catch_up_s'] / 1e9:.2f} GB/s"

    rows = [
        {"measure": f"kill -> survivors' next committed step ({label})",
         **cells("kill_s", lambda r: f"{r['kill_s']:.3f} s" + (
             f" (found {r['detect_s']:.3f} + redo {r['redo_s']:.3f})" if "detect_s" in r else "")),
         "target": "<= 0.3 s"},
        {"measure": f"steps discarded per failure ({label})", **cells("discarded", lambda r: str(r["discarded"])),
         "target": "0"},
        {"measure": f"job throughput kept, kill -> the run's end, over before the kill ({label})",
         **cells("kept", lambda r: f"{r['kept']:.2f} (over {r['kept_window_s']:.1f} s)"), "target": "-"},
        {"measure": f"survivor step during catch-up (the failed step's redo left out) / after it ({label})",
         **cells("after_ratio", lambda r: f"{r['after_ratio']:.2f} ({r['during_ms']:.1f} vs "
                                          f"{r['after_ms']:.1f} ms)"), "target": "<= 1.05"},
        {"measure": f"  the same / before the restart (the old baseline: the machine's drift, 3 replicas) ({label})",
         **cells("before_ratio", lambda r: f"{r['before_ratio']:.2f} ({r['during_ms']:.1f} vs "
                                           f"{r['before_ms']:.1f} ms)"), "target": "-"},
        {"measure": f"catch-up end to end: first request -> holds the latest state ({label})",
         **cells("catch_up_s", catch_up), "target": ">= 1 GB/s, <= torchft"},
        {"measure": f"catch-up, first request -> last byte ({label})",
         **cells("last_byte_s", lambda r: f"{r['last_byte_s']:.2f} s"), "target": "-"},
        {"measure": f"catch-up, first request -> first contributing commit ({label})",
         **cells("request_to_contributing_s", lambda r: f"{r['request_to_contributing_s']:.2f} s"),
         "target": "<= torchft"},
        {"measure": f"restart -> first contributing commit ({label})",
         **cells("contributing_s", lambda r: f"{r['contributing_s']:.2f} s"), "target": "<= torchft"},
        {"measure": f"  sub-figure: payload transfer rate ({label})",
         **cells("rate", lambda r: f"{r['rate'] / 1e9:.3f} GB/s"), "target": "-"},
    ]
    kept, before, catch_up_row, contributing = rows[2], rows[4], rows[5], rows[8]
    for name, res in columns.items():
        if not isinstance(res, str):
            kept[f"{name}_runs"] = [{k: run.get(k) for k in ("kept", "kept_before", "kept_after", "kept_window_s", "join")}
                                    for run in res.get("runs", [res])]
            before[f"{name}_before_window"] = res.get("before_window")
            catch_up_row[f"{name}_phases"] = res.get("phases")
            contributing[f"{name}_caught_up_s"] = res.get("caught_up_s")  # restart -> catch-up finished
            for row, key in ((rows[7], "request_to_contributing_s"), (contributing, "contributing_s")):
                row[f"{name}_each"] = [run.get(key) for run in res.get("runs", [res])]  # run by run, round order
            contributing[f"{name}_heals"], contributing[f"{name}_boot"] = res.get("heals"), res.get("boot")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat, no big-model catch-up")
    parser.add_argument("--big-hidden", type=int, default=4096, help="width of the big-model catch-up run")
    parser.add_argument("--no-torchft", action="store_true", help="skip the torchft runs")
    parser.add_argument("--failures-only", action="store_true", help="skip the overhead repeats")
    parser.add_argument("--failure-repeats", type=int, default=1,
                        help="interleaved repeats of every failure run (medians, [min..max] beside)")
    parser.add_argument("--small-only", action="store_true", help="no big-model failure run")
    parser.add_argument("--big-only", action="store_true", help="no 1.3M-parameter failure run (the big one only)")
    parser.add_argument("--standby", action="store_true",
                        help="also restart through a warm standby (ft/standby.py): a column of its own")
    parser.add_argument("--forked", action="store_true",
                        help="also restart forked from a warm server (freescale.forkserver, what freescale launch "
                             "does): a column of its own")
    parser.add_argument("--join-wait", action="store_true",
                        help="also restart with [ft] join = wait (the others wait for the joiner's gradients in the "
                             "step it joins): a column of its own, and one forked with --forked")
    parser.add_argument("--own-core", action="store_true",
                        help="failure runs: replicas a and b pinned to CPU 0, c (its first life and its restart) to CPU 1, "
                             "as on hosts of their own: the restart does not share a core with the survivors' steps")
    parser.add_argument("--big-steps", type=int, default=60,
                        help="steps of the big-model failure run (~2 s each on 2 cores; the kill is at step 20)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.big_only and (args.quick or args.small_only):
        parser.error("--big-only: --quick and --small-only leave out the big-model run (nothing would run)")
    steps, repeats = (60, 1) if args.quick else (300, 3)
    if args.own_core:
        CPUS_OF.update(a="0", b="0", c="1")
    tft_version, why = (None, "--no-torchft") if args.no_torchft else torchft_version()
    skip = "" if tft_version is not None else "skipped (--no-torchft)" if args.no_torchft else "skipped (see below)"
    if tft_version is None and not args.no_torchft:
        print(f"bench_ft: torchft does not import ({why}): its runs are skipped", file=sys.stderr)
    tft = tft_version is not None
    rows: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_ft"))
    try:
        if not args.failures_only:
            rows.append({"torchft": skip, **overhead(tmp, steps, repeats, 1024, tft)})
        # Quick: 200 steps, so that the restarted replica (~3-4 s to start on 2 cores) joins before the end.
        runs = [] if args.big_only else [(200 if args.quick else 300, 1024, 2, "1.3M params")]
        if not args.quick and not args.small_only:
            runs.append((args.big_steps, args.big_hidden, 4, f"{args.big_hidden}x4 MLP"))
        for n, hidden, layers, label in runs:
            repeats_of: dict[str, list[dict[str, Any]]] = {}
            failed: dict[str, str] = {}
            for r in range(args.failure_repeats):  # interleaved: every system once per round
                where = tmp / f"round{r}"
                where.mkdir(exist_ok=True)
                repeats_of.setdefault("freescale", []).append(freescale_failure(where, n, hidden, layers, label))
                if args.standby:
                    repeats_of.setdefault("freescale_standby", []).append(
                        freescale_failure(where, n, hidden, layers, label, standby=True))
                for forked, join in ((True, "record"), (False, "wait"), (True, "wait")):
                    if (forked and not args.forked) or (join == "wait" and not args.join_wait):
                        continue
                    repeats_of.setdefault(f"freescale{'_forked' * forked}{'_wait' * (join == 'wait')}", []).append(
                        freescale_failure(where, n, hidden, layers, label, forked=forked, join=join))
                for name, sync in (("torchft", False), ("torchft_sync", True)):
                    if not tft or name in failed:
                        continue
                    try:
                        repeats_of.setdefault(name, []).append(torchft_failure(where, n, hidden, layers, label, sync=sync))
                    except (Exception, SystemExit) as e:
                        failed[name] = torchft_failed(e, f"failure run ({label}, {name})")
            columns: dict[str, dict[str, Any] | str] = {name: repeated(runs_) for name, runs_ in repeats_of.items()}
            for name in ("torchft", "torchft_sync"):
                if name not in columns or name in failed:
                    columns[name] = failed.get(name, skip)
            rows += failure_rows(label, columns)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    waits = ["freescale_wait", *(["freescale_forked_wait"] if args.forked else [])] if args.join_wait else []
    print_table(rows, ["measure", "freescale", *(["freescale_standby"] if args.standby else []),
                       *(["freescale_forked"] if args.forked else []), *waits, "torchft", "torchft_sync", "target"])
    print("torchft: use_async_quorum=True (its default: heals during the step, contributes from the next); "
          "torchft_sync: use_async_quorum=False (heals before the forward, contributes in the healing step)")
    if args.failures_only:
        rows.append({"measure": "(overhead repeats skipped: --failures-only)"})
        _finish(args, rows, tft_version, why)
        return
    o = rows[0]
    print(f"step ms (medians): torch DDP {o['ddp_step_ms']:.2f}, flat all-reduce after backward "
          f"{o['allreduce_step_ms']:.2f}, freescale FTAR {o['ftar_step_ms']:.2f} ({o['vs_allreduce']} vs the flat "
          f"all-reduce)" + (f", torchft {o['torchft_step_ms']:.2f}" if "torchft_step_ms" in o else ""))
    _finish(args, rows, tft_version, why)


def _finish(args: argparse.Namespace, rows: list[dict[str, Any]], tft_version: str | None, why: str) -> None:
    tft = tft_version is not None
    ran = f"torchft-nightly {tft_version}, run here" if tft else f"not run: {why}"
    if not tft and not args.no_torchft:
        ran += f"\n  install it (not a freescale dependency) with: {TORCHFT_INSTALL}"
    print(f"torchft: {ran}")  # only figures measured in this run: none quoted from elsewhere
    if args.json:
        write_json(args.json, "bench_ft", {
            "quick": args.quick, "replicas": "2 (overhead), 3 (failure)", "big_hidden": args.big_hidden,
            "big_steps": args.big_steps, "failures_only": args.failures_only, "standby": args.standby, "forked": args.forked,
            "join_wait": args.join_wait, "own_core": args.own_core, "failure_repeats": args.failure_repeats, "small_only": args.small_only,
            "big_only": args.big_only,
            "model": "MLP 256->1024->1024->1 (1.31M params), AdamW" if not args.big_only
                     else f"MLP {args.big_hidden}x4 (the big-model run only), AdamW", "backend": "gloo", "heartbeat_timeout_s": 1.0,
            "join_timeout_s": 0.5, "torchft": tft_version, "torchft_skipped": why or None,
            "torchft_setup": "torchft.Manager (min_replica_size=1; torchft: use_async_quorum=True, torchft_sync: "
                             "False), torchft.ProcessGroupGloo, HTTPTransport healing, Rust LighthouseServer "
                             "(heartbeat 1000 ms, join 500 ms, tick 100 ms), flat manager.allreduce per step"}, rows)

if __name__ == "__main__":
    main()
