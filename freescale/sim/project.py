"""The projection: this project's measured figures and labelled assumptions, at 1K-98K GPUs.

Every input is a ``Sourced`` value: a figure read from a benchmark result of this repository
(file and field printed beside it; ``measured, CPU toy`` where the figure is an artifact of the
2-core machine rather than of the design), a default read from code (``ft/config.py``,
torchft's ``Manager``), or an assumption for what cannot be measured on a 2-core CPU machine (a
GPU cluster's failure rates, the restart time of an 8K-GPU group), each with where its number
comes from.  ``inputs()`` gathers them, ``check_inputs()`` validates them (errors name the
``--set`` key); ``scenario()`` turns them into one ``Cluster`` and the three ``Policy`` objects
at a GPU count; ``project()`` simulates the three on one trace per GPU count.

freescale keeps the embedding tables in step the cheaper at each scale of its two built ways: the union
update, whose step grows with the replica groups (``union_overhead``), or the tables averaged
``1/average_every`` a step, whose all-reduce is flat in the groups and grows with the table bytes a rank
holds (``average_overhead``).  A slow replica, once detected (``slow_detect_steps``, measured), keeps a
reduced share of the global batch, winning back ``slow_recovered`` of what it costs
(``benchmarks/bench_stragglers.py``: the planner's modelled figure, an upper bound; the end-to-end figure is
not established on the 2-core machine; ``freescale/speed_share.py``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from freescale.sim.engine import Outcome, simulate
from freescale.sim.params import Cluster, Policy, SimError
from freescale.sim.trace import make_trace

INF = math.inf
SCALES = (1_024, 16_384, 98_304)
CURVE = (1_024, 2_048, 4_096, 8_192, 16_384, 32_768, 65_536, 98_304)
"""GPU counts; the largest is FT-HSDP's: ~98K GPUs as 12 replica groups of 8,192."""
FREESCALE = "freescale"
SHRINK = "freescale + shrink"
NTP_FAILED_FRACTION = 0.001
VALIDATED_X = 0.5
"""The closed forms (and so the gates) hold where lambda * stall <= 0.5: rows past it are marked."""
RSC1_PER_GPU_HOUR = 6.5 / (1000 * 24 * 8)
"""Meta RSC-1: 6.5 failures per 1,000 node-days, 8 GPUs a node (arXiv 2410.21680); at 98K GPUs
that is a job MTBF of 18 min, FT-HSDP's figure."""


@dataclass(frozen=True)
class Sourced:
    value: float
    source: str
    kind: str
    """``measured`` (a benchmark result here), ``measured, CPU toy`` (one, but an artifact of the
    2-core machine), ``modelled`` (a benchmark's model of a part alone), ``code default``, ``assumption``,
    ``override`` (--set)."""


def _field(doc: dict[str, Any], path: str, file: Path) -> float:
    node: Any = doc
    for part in path.split("."):
        if isinstance(node, list):
            node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
        elif isinstance(node, dict):
            node = node.get(part)
        if node is None:
            raise SimError(f"{file}: no field '{path}' (re-run the benchmark that writes it)")
    if not isinstance(node, (int, float)):
        raise SimError(f"{file}: field '{path}' is not a number: {node!r}")
    return float(node)


def _load(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise SimError(f"{file}: not found (run from the repository root, where benchmarks/results holds it, or "
                       "pass --results DIR)") from None
    except json.JSONDecodeError as exc:
        raise SimError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg})") from None


def _row(doc: dict[str, Any], file: Path, measure: str) -> tuple[int, dict[str, Any]]:
    for i, row in enumerate(doc.get("rows", [])):
        if row.get("measure", "").startswith(measure):
            return i, row
    raise SimError(f"{file}: no row whose measure starts with '{measure}'")


def measured(results: Path) -> dict[str, Sourced]:
    """The fault-tolerance figures measured here (``bench_ft_torchrec.py``, ``bench_ft.py``, ``bench_stragglers.py``)."""
    tr_file, ft_file = results / "ft_torchrec_cpu.json", results / "ft_cpu.json"
    tr, ft = _load(tr_file), _load(ft_file)

    def m(file: Path, doc: dict[str, Any], path: str, kind: str = "measured", note: str = "") -> Sourced:
        return Sourced(_field(doc, path, file), f"{file.name}: {path}{note}", kind)

    toy = "measured, CPU toy"
    over_i, over = _row(ft, ft_file, "per-step overhead vs torch DDP")
    kill_i, _ = _row(ft, ft_file, "kill -> survivors' next committed step (1.3M")
    slow_i, _ = _row(tr, tr_file, "survivor step during catch-up / before")
    ddp = _field(over, "ddp_step_ms", ft_file)
    kr = "params.kill_run"
    rate = _field(tr, f"{kr}.rate", tr_file)
    fixed = (_field(tr, f"{kr}.contributing_s", tr_file) - _field(tr, f"{kr}.kill_to_catch_up_start_s", tr_file)
             - _field(tr, f"{kr}.catch_up.bytes", tr_file) / rate)
    return {
        **shrunk_groups(results / "degraded_cpu.json"),
        **slow_replicas(results / "stragglers_cpu.json"),
        "union_extra_per_group": union_extra_per_group(results / "union_update_cpu.json"),
        "kill_to_commit_s": m(tr_file, tr, f"{kr}.kill_s"),
        "torchft_kill_to_commit_s": m(ft_file, ft, f"rows.{kill_i}.torchft_raw"),
        "restart_to_catchup_s": m(tr_file, tr, f"{kr}.kill_to_catch_up_start_s", toy,
                                  " (agent restart, imports, sharding of a tiny model on CPU)"),
        "catchup_fixed_s": Sourced(max(0.0, fixed), f"{tr_file.name}: {kr}.contributing_s - kill_to_catch_up_start_s"
                                   " - catch_up.bytes / rate (catch-up start to first contributing step, less the "
                                   "transfer: ranks ready, connect, load, replay; 0.5 MB on loopback)", toy),
        "catchup_gbps": Sourced(rate / 1e9, f"{tr_file.name}: {kr}.rate / 1e9 (0.5 MB over loopback on 2 cores: "
                                "not a cluster network's rate)", toy),
        "catchup_slowdown": m(tr_file, tr, f"rows.{slow_i}.raw", toy,
                              " (2-core contention: the catching-up rank shares the survivors' cores)"),
        "overhead": Sourced(max(0.0, _field(over, "ftar_step_ms", ft_file) / ddp - 1),
                            f"{ft_file.name}: rows.{over_i}.ftar_step_ms / ddp_step_ms - 1 (one CPU run)", "measured"),
        "torchft_overhead": Sourced(max(0.0, _field(over, "torchft_step_ms", ft_file) / ddp - 1),
                                    f"{ft_file.name}: rows.{over_i}.torchft_step_ms / ddp_step_ms - 1 (one CPU run; "
                                    "measured negative, clipped to 0)", "measured"),
    }


def shrunk_groups(file: Path) -> dict[str, Sourced]:
    """``shrink_s``: a rank lost for good to the shrunk group's first contributing commit (``bench_degraded.py``,
    the median of its shrink runs; the restart of the group's agent, the catch-up and the first step included)."""
    rows = [r for r in _load(file)["rows"] if r.get("policy") == "shrink" and r.get("to_first_commit_s") is not None]
    if not rows:
        raise SimError(f"{file}: no shrink run with to_first_commit_s")
    return {"shrink_s": Sourced(float(statistics.median(r["to_first_commit_s"] for r in rows)),
                                f"{file.name}: median to_first_commit_s of {len(rows)} shrink run(s) (kill -> the "
                                "shrunk group's first contributing commit)", "measured, CPU toy")}


def slow_replicas(file: Path) -> dict[str, Sourced]:
    """From ``bench_stragglers.py``: the most steps any run took from a slowdown to its ``fail_slow`` verdict, and
    the share of a slow replica's cost planning by speed wins back, from its modelled rows (the planner and
    partitioner alone, the speeds known, 256-4,096 ranks: an upper bound).  Its measured runs on the 2-core VM
    cannot establish the end-to-end figure (the ranks share the cores, healthy runs vary more than a slow rank
    costs): their least is printed beside it, not used."""
    doc = _load(file)
    rows = doc.get("rows", [])
    detect = [r["detect_steps"] for r in rows if r.get("part") in ("measured", "groups") and r.get("detect_steps") is not None]
    modelled = [r["recovered"] for r in rows if r.get("part") == "modelled"]
    if not detect or not modelled:
        raise SimError(f"{file}: needs runs with a detection (detect_steps) and modelled rows (recovered); re-run "
                       "benchmarks/bench_stragglers.py")
    measured = [_won_back(r) for r in rows if r.get("part") == "groups"]
    seen = f"; measured on 2 shared CPU cores, replica groups: {min(measured):.2f}..{max(measured):.2f}" if measured else ""
    return {"slow_detect_steps": Sourced(float(max(detect)), f"{file.name}: the most detect_steps of {len(detect)} runs "
                                         "(balance.check_every 5, speed_window 10; a 1.5x slowdown is near the 0.7 "
                                         "threshold and takes longest)", "measured"),
            "slow_recovered": Sourced(min(modelled), f"{file.name}: the least 'recovered' of the modelled rows (planner "
                                      f"alone, speeds known: an upper bound{seen}, not established)", "modelled")}


def _won_back(row: dict[str, Any]) -> float:
    """A replica-group run's (rebalance - report) / (ideal - report) throughput, the ideal split giving each group
    its speed (the slow one's is report / healthy: while it sets the pace, the job runs at its speed)."""
    speed = row["report_sps"] / row["healthy_sps"]
    ideal = row["healthy_sps"] * (row["groups"] - 1 + speed) / row["groups"]
    return (row["rebalance_sps"] - row["report_sps"]) / (ideal - row["report_sps"]) if ideal > row["report_sps"] else 0.0


def union_extra_per_group(file: Path) -> Sourced:
    """The union update's added work per replica group beyond two, as a fraction of a group's own
    embedding update: the slope of ``extra_ms`` against ``R - 1`` over the measured rows of
    ``bench_union_update.py`` (least squares through the origin), over the one-group ``own_ms``."""
    doc = _load(file)
    rows = [r for r in doc.get("rows", []) if r.get("kind") == "measured"]
    fit = [(r["groups"] - 1, r["extra_ms"]) for r in rows if r.get("groups", 0) > 1 and "extra_ms" in r]
    own = [r["own_ms"] for r in rows if r.get("groups") == 1 and r.get("own_ms")]
    if not fit or not own:
        raise SimError(f"{file}: needs measured rows for 1 group (own_ms) and for more (extra_ms); re-run "
                       "benchmarks/bench_union_update.py")
    slope = sum(x * y for x, y in fit) / sum(x * x for x, _ in fit)
    return Sourced(slope / own[0], f"{file.name}: slope of extra_ms on groups - 1 ({slope:.1f} ms, R = "
                   f"{', '.join(str(x + 1) for x, _ in fit)}) / own_ms ({own[0]:g} ms); one fbgemm TBE on CPU: "
                   "the ratio, not the milliseconds, is what scales", "measured")


def update_overhead(base: float, share: float, extra: float) -> float:
    """The throughput lost at a replica count whose embedding update adds ``extra`` of a group's own update
    beyond what the measured two-group FT overhead ``base`` holds, that update being ``share`` of a step: the
    step takes ``1 + share * extra`` times as long as the measured one."""
    return 1.0 - (1.0 - base) / (1.0 + share * extra)


def union_overhead(base: float, share: float, per_group: float, replicas: int) -> float:
    """As built: each group beyond two adds ``per_group`` of the group's own update (the two-group run
    holds one other group's union work already)."""
    return update_overhead(base, share, per_group * max(0, replicas - 2))


def average_overhead(base: float, x: dict[str, float], replicas: int) -> float:
    """With the tables averaged across groups (``[ft] embedding_sync = "average"``): each step's ring all-reduce of
    ``1/average_every`` of a rank's tables and their row-wise state, ``2 (R - 1) / R`` of its bytes over the
    cross-group link, exposed after the step's dense reduction; no embedding work beyond the group's own."""
    seconds = 2 * (replicas - 1) / replicas * x["table_gb"] / x["average_every"] / x["cross_group_gbps"]
    return update_overhead(base, 1.0, seconds / x["step_s"])


def embedding_overhead(x: dict[str, float], replicas: int) -> tuple[float, str]:
    """As built: the cheaper of the two built schemes at ``replicas`` groups, and its name."""
    union = union_overhead(x["overhead"], x["sparse_update_share"], x["union_extra_per_group"], replicas)
    average = average_overhead(x["overhead"], x, replicas)
    return (union, "union") if union <= average else (average, "average")


def _ft_timeout_default() -> float:
    """``FTConfig.timeout_s``'s default, read from ``ft/config.py`` (installed as
    ``freescale/ft/config.py``) without importing it (that would import torch)."""
    spec = importlib.util.find_spec("freescale.ft")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / "config.py"
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "timeout_s"
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, (int, float))):
                return float(node.value.value)
    raise SimError("freescale.ft: no ft/config.py with a 'timeout_s' default (the hang bound)")


def assumptions() -> dict[str, Sourced]:
    """What a CPU machine cannot measure: each from a published figure or a stated guess."""
    a = "assumption"
    return {
        "failures_per_gpu_hour": Sourced(RSC1_PER_GPU_HOUR, "arXiv 2410.21680 (RSC-1: 6.5 / 1000 node-days, 8 GPUs/node);"
                                         " = FT-HSDP's 18 min job MTBF at 98K GPUs", a),
        "hang_fraction": Sourced(0.2, "guess: 1 in 5 failures hangs rather than crashes", a),
        "slow_per_gpu_hour": Sourced(1e-5, "guess (Falcon, arXiv 2410.12588: fail-slow is common, tens of s to hours)", a),
        "slow_speed": Sourced(0.5, "guess: a slow replica at half speed", a),
        "slow_duration_s": Sourced(600.0, "guess: 10 min episodes (Falcon: tens of s to hours)", a),
        "correlated_fraction": Sourced(0.05, "guess: 1 in 20 failures takes a second group (switch, power)", a),
        "step_s": Sourced(1.0, "guess: a 1 s recommendation-model step", a),
        "sparse_update_share": Sourced(0.1, "guess: a group's own fused embedding update (TBE backward and row-wise "
                                       "Adagrad) is 10% of its step; what the union update multiplies", a),
        "state_gb": Sourced(8.0, "guess: 8 GB of parameters + optimizer state per rank", a),
        "table_gb": Sourced(4.0, "guess: half of state_gb is fused embedding rows and their row-wise Adagrad state "
                            "(what the averaged scheme all-reduces)", a),
        "cross_group_gbps": Sourced(50.0, "guess: 400 Gb/s of cross-group network per GPU (one NDR InfiniBand port); "
                                    "bench_union_update.py's --link-gbps default", a),
        "average_every": Sourced(16.0, "choice: [ft] average_every = 16 for large tables (embedding_sync_cpu.json, "
                                 "tiny DLRM, 3 seeds at R = 2 and 3: eval AUC below the union's in 2 of 6 runs, by "
                                 "up to 0.0028, where N = 1 was in 5 of 6 (up to 0.0043) and 256 in 5 of 6 (up to "
                                 "0.0102); the job without FT minus the union: -0.0015..+0.0010; the code's default "
                                 "is 1)", a),
        "node_replacement_s": Sourced(390.0, "FT-HSDP: failed replica out 10 min, 3 of them the global stall: "
                                      "~7 min to replace and restart a group (scheduler, node swap, start)", a),
        "job_restart_fixed_s": Sourced(400.0, "FT-HSDP: 10 min synchronous recovery at 98K minus its ~200 s NCCL init", a),
        "nccl_init_16k_s": Sourced(17.0, "FT-HSDP: NCCL init 17 s at 16K GPUs, ~200 s at 98K (power law between)", a),
        "reconfigure_s": Sourced(10.0, "guess: new cross-group communicators after a failure, both FT policies", a),
        "sync_hang_detect_s": Sourced(600.0, "torch's default NCCL collective timeout (10 min)", a),
        "torchft_hang_detect_s": Sourced(60.0, "torchft Manager(timeout=60 s) default, the collective timeout: its "
                                         "heartbeats come from the Rust ManagerServer's own thread, so a hung but "
                                         "live trainer keeps beating (meta-pytorch/torchft torchft/manager.py)",
                                         "code default"),
        "checkpoint_interval_s": Sourced(1800.0, "guess: a checkpoint every 30 min, every policy", a),
        "failed_fraction": Sourced(NTP_FAILED_FRACTION, "NTP (arXiv 2504.06095, abstract): 0.1% of GPUs in a failed "
                                   "state, where a high tensor-parallel degree loses nearly 10% of the throughput; "
                                   "the degraded scenario's repair time is this over the failure rate", a),
        "checkpoint_cost_s": Sourced(30.0, "guess: 30 s blocking per save", a),
    }


def code_defaults() -> dict[str, Sourced]:
    return {"freescale_hang_detect_s": Sourced(
        _ft_timeout_default(), "ft/config.py: FTConfig.timeout_s (the FT all-reduce's timeout): heartbeats run on their "
        "own thread, so a hung but live trainer keeps beating and this timeout is what bounds a hang", "code default")}


def inputs(results: Path) -> dict[str, Sourced]:
    return {**measured(results), **code_defaults(), **assumptions()}


_AT_LEAST_0 = ("slow_per_gpu_hour", "slow_duration_s", "slow_detect_steps", "state_gb", "node_replacement_s",
               "job_restart_fixed_s", "nccl_init_16k_s", "reconfigure_s", "sync_hang_detect_s",
               "torchft_hang_detect_s", "freescale_hang_detect_s", "checkpoint_interval_s", "checkpoint_cost_s",
               "kill_to_commit_s", "torchft_kill_to_commit_s", "restart_to_catchup_s", "catchup_fixed_s", "shrink_s")
RULES: dict[str, tuple[str, Any]] = {
    **{k: (">= 0", lambda x: x >= 0) for k in _AT_LEAST_0},
    "failures_per_gpu_hour": ("> 0 (the simulation runs until --failures failures)", lambda x: x > 0),
    "hang_fraction": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "correlated_fraction": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "slow_speed": ("in (0, 1]", lambda x: 0 < x <= 1),
    "slow_recovered": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "failed_fraction": ("in (0, 1)", lambda x: 0 < x < 1),
    "step_s": ("> 0", lambda x: x > 0),
    "catchup_gbps": ("> 0", lambda x: x > 0),
    "catchup_slowdown": (">= 1", lambda x: x >= 1),
    "overhead": ("in [0, 1)", lambda x: 0 <= x < 1),
    "torchft_overhead": ("in [0, 1)", lambda x: 0 <= x < 1),
    "sparse_update_share": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "average_every": (">= 1", lambda x: x >= 1),
    "cross_group_gbps": ("> 0", lambda x: x > 0),
}
MAY_BE_INF = {"slow_detect_steps"}
"""``inf``: never detected (``--set slow_detect_steps=inf``: a slow replica sets everyone's pace, as under torchft)."""


def check_inputs(v: dict[str, Sourced]) -> None:
    """Every input within its range; the error names the ``--set`` key (or the result file's field)."""
    for key, s in v.items():
        rule, ok = RULES.get(key, (">= 0", lambda x: x >= 0))
        finite = math.isfinite(s.value) or (key in MAY_BE_INF and s.value == INF)
        if not finite or not ok(s.value):
            where = f"--set {key}={s.value:g}" if s.kind == "override" else f"{key} = {s.value:g} ({s.source})"
            raise SimError(f"{where}: must be {rule}{'' if finite else ' and finite'}")


def nccl_init_s(gpus: int, at_16k: float) -> float:
    """17 s at 16K GPUs growing to ~200 s at 98K: ``at_16k * (n/16K)^1.36``."""
    return at_16k * (gpus / 16_384) ** 1.36


def replicas_at(gpus: int) -> int:
    """16 replica groups up to 16K GPUs, then 8K-GPU groups (FT-HSDP: ~98K GPUs as 12 replicas);
    groups are equal, so the divisor of ``gpus`` nearest that (the smaller on a tie)."""
    target = 16 if gpus <= 16_384 else gpus / 8_192
    divisors = [d for d in range(1, math.isqrt(gpus) + 1) if gpus % d == 0]
    divisors += [gpus // d for d in divisors]
    return min(divisors, key=lambda d: (abs(d - target), d))


MAX_GPUS = 1 << 24
"""The largest job simulated (16.7M GPUs ran in under a second; 10**12 took gigabytes before a line was printed)."""


def check_grouping(gpus: int, replicas: int | None) -> int:
    """The replica groups of a ``--gpus``/``--replicas`` pair (equal groups: failure rates count every GPU)."""
    if not 1 <= gpus <= MAX_GPUS:
        raise SimError(f"--gpus must be 1 to {MAX_GPUS:,}, got {gpus:,}")
    if replicas is None:
        return replicas_at(gpus)
    if not 1 <= replicas <= gpus or gpus % replicas:
        raise SimError(f"--replicas {replicas} must divide --gpus {gpus} (equal replica groups; failure rates "
                       "count every GPU)")
    return replicas


def scenario(gpus: int, v: dict[str, Sourced], replicas: int | None = None) -> tuple[Cluster, list[Policy]]:
    """The cluster and the three policies at ``gpus`` from the sourced inputs ``v``."""
    x = {k: s.value for k, s in v.items()}
    groups = check_grouping(gpus, replicas)
    group = gpus // groups
    total = x["failures_per_gpu_hour"]
    cluster = Cluster(gpus=gpus, gpus_per_replica=group, crash_per_gpu_hour=total * (1 - x["hang_fraction"]),
                      hang_per_gpu_hour=total * x["hang_fraction"], slow_per_gpu_hour=x["slow_per_gpu_hour"],
                      slow_speed=x["slow_speed"], slow_duration_s=x["slow_duration_s"],
                      correlated_fraction=x["correlated_fraction"], step_s=x["step_s"], state_gb=x["state_gb"])
    ckpt: dict[str, Any] = {"checkpoint_interval_s": x["checkpoint_interval_s"], "checkpoint_cost_s": x["checkpoint_cost_s"]}
    group_restart = x["node_replacement_s"] + x["restart_to_catchup_s"] + nccl_init_s(group, x["nccl_init_16k_s"])
    sync = Policy("sync + checkpoint restart", "sync", {"crash": 0.0, "hang": x["sync_hang_detect_s"], "slow": INF},
                  restart_s=x["job_restart_fixed_s"] + nccl_init_s(gpus, x["nccl_init_16k_s"]), **ckpt)
    torchft = Policy("torchft-like", "torchft",
                     {"crash": x["torchft_kill_to_commit_s"], "hang": x["torchft_hang_detect_s"], "slow": INF},
                     restart_s=group_restart, reconfigure_s=x["reconfigure_s"], catchup_gbps=x["catchup_gbps"],
                     overhead=x["torchft_overhead"], **ckpt)
    ours = Policy(FREESCALE, "freescale", {"crash": x["kill_to_commit_s"], "hang": x["freescale_hang_detect_s"],
                                          "slow": x["slow_detect_steps"] * x["step_s"]},
                  restart_s=group_restart, reconfigure_s=x["reconfigure_s"], catchup_gbps=x["catchup_gbps"],
                  replay_s=x["catchup_fixed_s"], catchup_slowdown=x["catchup_slowdown"],
                  overhead=embedding_overhead(x, groups)[0], slow_recovered=x["slow_recovered"], **ckpt)
    return cluster, [sync, torchft, ours]


def degraded_scenario(gpus: int, v: dict[str, Sourced]) -> tuple[Cluster, list[Policy]]:
    """No spare pool: a crashed GPU's slot is back only after ``failed_fraction / failure rate`` (so that fraction
    of GPUs is down on average, NTP's figure).  The replica policies wait for it, or, ``freescale + shrink``, the
    group trains on its other GPUs at a share in proportion (after ``shrink_s``) and grows back once it is back."""
    x = {k: s.value for k, s in v.items()}
    cluster, (_, torchft, ours) = scenario(gpus, v)
    cluster = replace(cluster, repair_s=3600 * x["failed_fraction"] / x["failures_per_gpu_hour"])
    return cluster, [torchft, ours, replace(ours, name=SHRINK, shrink=True, shrink_s=x["shrink_s"])]


def check_scenarios(v: dict[str, Sourced], gpus: int, replicas: int | None, gpu_counts: tuple[int, ...]) -> None:
    """Build and validate every scenario a command will run, before it runs anything."""
    check_inputs(v)
    for n, r in ((gpus, replicas), *((n, None) for n in gpu_counts)):
        cluster, policies = scenario(n, v, r)
        try:
            cluster.validate()
            for policy in policies:
                policy.validate()
        except SimError as exc:  # a bug if check_inputs let it through: still one line, with the scale
            raise SimError(f"at {n:,} GPUs: {exc}") from None


def job_rate(cluster: Cluster) -> float:
    """Crash and hang arrivals per second over the whole job."""
    return sum(cluster.rate_per_s(k) for k in ("crash", "hang"))


def horizon_for(cluster: Cluster, failures: int) -> float:
    rate = job_rate(cluster)
    if rate <= 0:
        raise SimError("failures_per_gpu_hour: must be > 0 (the simulation runs until --failures failures)")
    return failures / rate


def compare(cluster: Cluster, policies: list[Policy], failures: int, seed: int, horizon_s: float | None = None,
            bins: int = 200) -> list[Outcome]:
    """Every policy on one trace."""
    horizon = horizon_s or horizon_for(cluster, failures)
    trace = make_trace(cluster, horizon, seed)
    return [simulate(cluster, p, trace, horizon, bins) for p in policies]


def project(v: dict[str, Sourced], gpu_counts: tuple[int, ...], failures: int, seed: int,
            scenario_at: Callable[[int, dict[str, Sourced]], tuple[Cluster, list[Policy]]] | None = None,
            ) -> list[dict[str, Any]]:
    """One row per (GPU count, policy) of ``scenario_at`` (default ``scenario``; ``degraded_scenario``: no spare
    pool), every policy on the same trace at a GPU count."""
    rows = []
    for gpus in gpu_counts:
        cluster, policies = (scenario_at or scenario)(gpus, v)
        rows += policy_rows(gpus, cluster, policies, compare(cluster, policies, failures, seed), v)
    return rows


def policy_rows(gpus: int, cluster: Cluster, policies: list[Policy], outs: list[Outcome],
                v: dict[str, Sourced]) -> list[dict[str, Any]]:
    """``summary_row`` per policy; freescale's also name the embedding scheme it keeps the tables in step with."""
    scheme = embedding_overhead({k: s.value for k, s in v.items()}, cluster.replicas)[1]
    rows = [summary_row(gpus, cluster, p, o) for p, o in zip(policies, outs)]
    for policy, row in zip(policies, rows):
        if policy.kind == "freescale":
            row["embedding_sync"] = scheme
    return rows


def summary_row(gpus: int, cluster: Cluster, policy: Policy, out: Outcome) -> dict[str, Any]:
    """One (GPU count, policy) result.  ``lambda_stall``: job failure rate x mean stall per
    failure; past ``VALIDATED_X`` the row is outside the range the gates validate (``validated``
    false, ``*`` in the table)."""
    stall = out.stall_stats()
    lost = sorted(((k, s) for k, s in out.breakdown.items() if k != "useful"), key=lambda kv: -kv[1])
    x = job_rate(cluster) * stall["mean"]
    return {"gpus": gpus, "replicas": cluster.replicas, "policy": policy.name, "ettr": round(out.ettr, 4),
            "stall_mean_s": round(stall["mean"], 2), "stall_p50_s": round(stall["p50"], 2),
            "stall_p90_s": round(stall["p90"], 2), "failures": out.failures,
            "discarded_per_failure": round(out.steps_discarded / max(out.failures, 1), 2),
            "mean_contributing": round(out.mean_contributing, 2),
            "job_mtbf_min": round(60 / (3600 * job_rate(cluster)), 1),
            "lambda_stall": round(x, 3), "validated": x <= VALIDATED_X,
            "top_losses": ", ".join(f"{k} {100 * s:.1f}%" for k, s in lost[:3]),
            "breakdown": {k: round(s, 5) for k, s in out.breakdown.items()}}


def with_overrides(v: dict[str, Sourced], overrides: dict[str, float]) -> dict[str, Sourced]:
    unknown = sorted(set(overrides) - set(v))
    if unknown:
        raise SimError(f"unknown input '{unknown[0]}' (one of: {', '.join(sorted(v))})")
    return {**v, **{k: replace(v[k], value=val, source="command line", kind="override") for k, val in overrides.items()}}
