"""``freescale launch``: N local ranks of ``freescale train`` (or of a user's own loop) under torch's elastic agent.

The same agent ``torchrun --standalone`` runs (c10d rendezvous on a free local
port, ``--max-restarts`` restarts of the whole group), but in this process, so a
failure ends in one line instead of the agent's traceback:

- a user error in a rank (bad data, bad checkpoint) is written by that rank to
  ``$FREESCALE_ERROR_DIR/rank<N>.txt`` and printed here once, however many ranks
  hit it; exit status 2.  An error every incarnation would meet again (bad
  config, data or checkpoint; a non-finite loss, reached alike by every rank
  and, with replica groups, every group) is written as ``rank<N>.final.txt``:
  the rank still exits 2, so the agent stops its peers at once, but the
  incarnation it restarts ends at start-up (``restart_is_futile``: exit 0
  before any process group exists) instead of spending ``--max-restarts``
  on the same error, and this returns 2 for it.  A lighthouse out of reach is
  restarted as a crash is;
- a crash keeps the rank's own traceback on stderr, and this prints which rank
  died and how; exit status 1.

Multi-node runs use torchrun directly (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from freescale import forkserver, standby_pair
from freescale.ft.config import incarnation
from freescale.group_sizes import ERROR_DIR_ENV, SHRINK_REFUSED, GroupSizes, RankLoss, take_shrink_refusal
from freescale.lifetime import PARENT_ENV, Stopped, children_die_with_me, die_with_parent, stops_raise

GROUP_AGENT_ENV = "FREESCALE_GROUP_AGENT"
"""Set in a replica group's agent (``launch_replicas`` starts it): the job's launcher reports for it."""
FINAL_SUFFIX = ".final"
"""``rank<N>.final.txt``: an error no restart can fix."""


def report_user_error(message: str, restartable: bool = False) -> None:
    """Called by a rank on a user error: hand it to the launcher (``restartable`` False: no restart
    can fix it, see the module docstring), or print it."""
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        Path(error_dir, f"rank{rank}{'' if restartable else FINAL_SUFFIX}.txt").write_text(message)
    else:
        prefix = f"[rank {rank}] " if world > 1 else ""
        print(f"freescale: error: {prefix}{message}", file=sys.stderr)


class FutileRestart(Exception):
    """Raised at the start of a restarted incarnation whose predecessor stopped on an error no restart can
    fix (``restart_is_futile``): under the launcher it ends the rank with status 0, quietly."""


def restart_is_futile() -> bool:
    """This is a restarted incarnation under ``launch`` and an earlier one stopped on an error no
    restart can fix: end now (every rank of the group reads the same files, before any collective)."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    return bool(error_dir and incarnation() > 0
                and any(Path(error_dir).glob(f"rank*{FINAL_SUFFIX}.txt")))


def _user_errors(error_dir: str, final_only: bool = False) -> list[str]:
    """The ranks' user errors (``final_only``: those no restart can fix), each once, printed."""
    pattern = f"rank*{FINAL_SUFFIX}.txt" if final_only else "rank*.txt"
    messages = sorted({p.read_text() for p in Path(error_dir).glob(pattern)})
    for message in messages:
        print(f"freescale: error: {message}", file=sys.stderr)
    return messages


def threads_per_rank(local_ranks: int) -> str:
    """torch's intra-op threads for each of ``local_ranks`` rank processes sharing this machine's cores
    (``OMP_NUM_THREADS``).  Every replica group's ranks count: a group's own agent sees only its ranks,
    and torchrun leaves a one-rank group at torch's default (every core), so R one-rank groups ran R
    times as many compute threads as cores: two one-rank groups of the tiny DLRM stepped at 37-56 ms
    against 11-12 ms for one 2-rank job on 2 cores (``benchmarks/bench_ft_threads.py``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return str(max(1, cores // max(1, local_ranks)))  # the cores this process may use (affinity, cpusets)


def launch_local(nproc_per_node: int, max_restarts: int, train_args: Sequence[str],
                 command: Sequence[str] = (), on_rank_loss: str = "restart", min_group_ranks: int = 1,
                 grow_back_after_s: float = 0.0) -> int:
    """Run ``freescale train TRAIN_ARGS`` (or a user's ``command``, e.g. ``python my_loop.py ...``) on
    ``nproc_per_node`` local ranks; return an exit status.

    A user's command gets a fresh rendezvous store per restart (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``:
    the agent would otherwise hand every incarnation its one shared store, where a plain
    ``dist.init_process_group`` reads the dead incarnation's gloo addresses and fails to connect).
    ``freescale train``'s ranks are forked from this node's warm server when ``freescale launch`` started
    one (``freescale.forkserver``).

    ``on_rank_loss``, ``min_group_ranks``, ``grow_back_after_s``: ``freescale.group_sizes.GroupSizes`` (a replica
    group's agent only)."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", threads_per_rank(nproc_per_node))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    error_dir = tempfile.mkdtemp(prefix="freescale-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir
    children_die_with_me()  # the ranks' clients: none outlives this agent (``freescale.lifetime``)
    if standby_pair.wanted():  # a one-rank group as an active process and a warm standby (``--standby``)
        try:
            return standby_pair.run_pair(max_restarts, train_args, command, error_dir)
        finally:
            shutil.rmtree(error_dir, ignore_errors=True)
    sizes = GroupSizes(nproc_per_node, max_restarts, on_rank_loss, min_group_ranks, grow_back_after_s)
    try:
        while True:
            with sizes.growing_back():
                code, lost = _run_agent(sizes.size, sizes.restarts_now(), train_args, command, error_dir)
            if sizes.grew_back() or (lost is not None and sizes.after_loss(lost, take_shrink_refusal(error_dir))):
                continue
            if lost is not None and lost.lost:
                print(f"freescale: error: rank {lost.rank} (pid {lost.pid}) failed with {lost.how}; see its output above",
                      file=sys.stderr)
            return code
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        os.environ.pop(PARENT_ENV, None)


def _run_agent(nproc_per_node: int, max_restarts: int, train_args: Sequence[str], command: Sequence[str],
               error_dir: str) -> tuple[int, RankLoss | None]:
    """One elastic launch of ``nproc_per_node`` ranks: (exit status, (rank, how) when it ended on a rank's
    crash rather than a user error)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # each of the agent's modules sets its logger's own level
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts, monitor_interval=0.1,
    )
    try:
        if command:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        argv = rank_argv(train_args, command)
        elastic_launch(config, argv[0])(*argv[1:])
        # A restarted incarnation that ended at start-up: the error of the one before stands.
        return (2 if _user_errors(error_dir, final_only=True) else 0), None
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        killed = [(r, f) for r, f in sorted(failed.failures.items()) if f.exitcode < 0]
        if killed and failure.exitcode >= 0:  # a rank a signal killed, not its peer that exited on seeing it
            rank, failure = killed[0]
        if Path(error_dir, SHRINK_REFUSED).exists():  # every rank refused alike: nothing to report as an error
            for path in Path(error_dir).glob("rank*.txt"):
                path.unlink()
            return 1, RankLoss(rank, "it cannot train at this size", failure.pid)
        if _user_errors(error_dir, final_only=True):
            return 2, None
        if _user_errors(error_dir):  # restartable (a lighthouse out of reach): the agent may launch again
            for path in Path(error_dir).glob("rank*.txt"):
                path.unlink()
            return 2, RankLoss(rank, "a restartable error", failure.pid, lost=False)
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        return 1, RankLoss(rank, how, failure.pid)
    except SignalException as stopped:  # the agent passed it to the ranks and waited for them
        return stopped_by(int(stopped.sigval)), None


def rank_argv(train_args: Sequence[str], command: Sequence[str]) -> list[str]:
    """A rank's command line: ``freescale train TRAIN_ARGS`` (or the user's ``command``), forked from the node's
    warm server where one runs (``freescale.forkserver``: ``python my_loop.py ...`` too), else started plain."""
    if command:
        forked = forkserver.client_command(list(command)) if forkserver.running() else None
        return [sys.executable, "-m", "freescale.forkserver", *forked] if forked is not None else list(command)
    entry = "freescale.forkserver" if forkserver.running() else "freescale.cli"
    return [sys.executable, "-m", entry, "train", *train_args]


def stopped_by(signum: int) -> int:
    """One line for a deliberate stop (the ranks were stopped first); the exit status a shell gives it."""
    if not os.environ.get(GROUP_AGENT_ENV):  # a group's agent: the job's launcher says it, once
        print(f"freescale: stopped by {signal.Signals(signum).name}; every rank has ended", file=sys.stderr, flush=True)
    return 128 + signum


def launch_replicas(replicas: int, nproc_per_node: int, max_restarts: int, train_args: Sequence[str],
                    heartbeat_timeout_s: float = 3.0, lighthouse_url: str = "", output_dir: str = "",
                    title: str = "freescale job", command: Sequence[str] = (), on_rank_loss: str = "restart",
                    min_group_ranks: int = 1, grow_back_after_s: float = 0.0, standby: bool = False) -> int:
    """Fault-tolerant training on this machine: a lighthouse in this process and ``replicas``
    groups of ``nproc_per_node`` ranks, each its own elastic job (``launch_local`` in a child
    process) that restarts with a new incarnation after a failure and catches up from its peers.

    ``lighthouse_url``: use that lighthouse (``freescale lighthouse``, e.g. on another host or
    one that outlives this launcher) instead of starting one here.  ``command``: each group's ranks run
    a user's own loop (``freescale.ft.wrap``) instead of ``freescale train TRAIN_ARGS``; its environment
    holds what ``FTConfig.from_env`` reads (``freescale.ft.config.ENVIRONMENT``).
    ``on_rank_loss`` / ``min_group_ranks`` / ``grow_back_after_s``: what a group's agent does when a rank fails
    and when its slot comes back (``freescale.group_sizes.GroupSizes``).  ``standby``: each (one-rank) group
    runs a warm standby beside its rank (``freescale.standby_pair``), their locks in a folder of this launch's.
    Returns 0 when every group finished, else the worst group's exit status.  With ``output_dir``
    the groups print no summary and this prints one for the job (``freescale.job_summary``).
    """
    import subprocess

    from freescale.ft.config import LIGHTHOUSE_ENV, REPLICA_INDEX_ENV, REPLICAS_ENV, RUN_ID_ENV
    from freescale.ft.lighthouse import Lighthouse, LighthouseConfig
    from freescale.ft.replica_group import SHARED_GPUS_ENV
    from freescale.ft.standby import STANDBY_ENV
    from freescale.job_summary import SUMMARY_ENV

    lighthouse = None if lighthouse_url else Lighthouse(LighthouseConfig(min_replicas=1,
                                                                         heartbeat_timeout_s=heartbeat_timeout_s))
    url = lighthouse_url or lighthouse.start_in_thread()  # type: ignore[union-attr]  # no url: one was built
    print(f"freescale: lighthouse at {url}; {replicas} replica group(s) of {nproc_per_node} rank(s)", flush=True)
    groups = []
    devices, shared_gpus = _gpus_per_group(replicas, nproc_per_node)
    run_id = os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:16]
    locks = tempfile.mkdtemp(prefix="freescale-standby-") if standby else ""  # local: flock is unsafe over NFS
    pair = {standby_pair.STANDBY_PAIR_ENV: "1", STANDBY_ENV: str(Path(locks) / "{replica}.lock")} if standby else {}
    try:
        for index in range(replicas):
            env = {"OMP_NUM_THREADS": threads_per_rank(replicas * nproc_per_node), **os.environ, LIGHTHOUSE_ENV: url,
                   REPLICAS_ENV: str(replicas), REPLICA_INDEX_ENV: str(index), RUN_ID_ENV: run_id,
                   GROUP_AGENT_ENV: "1", **({SUMMARY_ENV: "1"} if output_dir else {}), **pair}
            children_die_with_me(env)
            if devices is not None:  # each group its own GPUs (every group numbers its ranks 0..G-1)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[index * nproc_per_node:(index + 1) * nproc_per_node])
            elif shared_gpus:
                env[SHARED_GPUS_ENV] = "1"  # NCCL refuses two ranks on one GPU: replica groups use gloo
            # The group's own agent (``python -m freescale.launch``): the config was checked here, once,
            # so the group's launcher does not import torchrec to load it again.
            groups.append(subprocess.Popen(
                [sys.executable, "-m", "freescale.launch", str(nproc_per_node), str(max_restarts), on_rank_loss,
                 str(min_group_ranks), str(grow_back_after_s), *train_args,
                 *(["--", *command] if command else [])],
                env=env))
        with stops_raise():
            codes = [group.wait() for group in groups]
    except Stopped as stopped:  # SIGTERM/SIGINT/SIGHUP: each group's agent stops its ranks, then ends
        _stop_groups(groups, stopped.signum)
        return stopped_by(stopped.signum)
    finally:
        for group in groups:
            if group.poll() is None:
                group.kill()
        if lighthouse is not None:
            lighthouse.stop_thread()
        if locks:
            shutil.rmtree(locks, ignore_errors=True)
    for index, code in enumerate(codes):
        if code:
            print(f"freescale: error: replica group {index} exited with status {code}", file=sys.stderr)
    if output_dir:
        _print_job_summary(Path(output_dir), title)
    return max(codes, default=0)


STOP_GRACE_S = 30.0
"""How long a stopped group's agent has to stop its ranks (torch's agent gives them as long) before it is
killed; its ranks die with it (``freescale.lifetime``)."""


def _stop_groups(groups: list[Any], signum: int) -> None:
    """Pass the stop to every group's agent, wait for them (a second stop signal: at once), kill the rest."""
    import time

    for group in groups:
        if group.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                group.send_signal(signum)
    deadline = time.monotonic() + STOP_GRACE_S
    with contextlib.suppress(Stopped), stops_raise():
        while any(g.poll() is None for g in groups) and time.monotonic() < deadline:
            time.sleep(0.05)


def _print_job_summary(output_dir: Path, title: str) -> None:
    from freescale.job_summary import print_job_summary, summarize
    from freescale.report.logs import ReportError

    try:
        print_job_summary(summarize(output_dir), title)
    except (ReportError, OSError, ValueError) as exc:
        print(f"freescale: no job summary: {exc}", file=sys.stderr)


def _gpus_per_group(replicas: int, nproc_per_node: int) -> tuple[list[str] | None, bool]:
    """(The visible GPUs, if there are enough for every rank of every group to have its own;
    whether groups must share GPUs instead)."""
    import torch

    if not torch.cuda.is_available():
        return None, False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < replicas * nproc_per_node:
        print(f"freescale: warning: {len(devices)} GPU(s) for {replicas} x {nproc_per_node} ranks: groups share "
              "GPUs, so the gradient exchange across groups runs over gloo (NCCL refuses two ranks on one GPU)",
              file=sys.stderr)
        return None, True
    return devices, False


def main(argv: Sequence[str]) -> int:
    """``python -m freescale.launch NPROC MAX_RESTARTS ON_RANK_LOSS MIN_GROUP_RANKS GROW_BACK_AFTER_S TRAIN_ARGS...
    [-- COMMAND...]``: one replica group's agent (``launch_replicas`` starts one per group)."""
    die_with_parent()  # the job's launcher: this agent, and through it its ranks, end with it
    nproc, restarts, on_rank_loss, min_ranks, grow_back, *rest = argv
    cut = rest.index("--") if "--" in rest else len(rest)
    return launch_local(int(nproc), int(restarts), rest[:cut], rest[cut + 1:], on_rank_loss, int(min_ranks),
                        float(grow_back))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
