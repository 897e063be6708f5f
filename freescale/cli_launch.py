"""``freescale launch``: the job's ranks on this machine (``freescale.launch``), behind the run directory's
lease (``run_lease``) and the ranks' warm fork server (``forkserver``); or a user's own loop (``-- python ...``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from freescale.cli import _load_train_config
from freescale.config import ConfigError


def cmd_launch(args: argparse.Namespace, overrides: list[str], command: list[str]) -> int:
    from freescale.testing import FAULTS_ENV, parse_faults

    parse_faults(os.environ.get(FAULTS_ENV, ""))  # a malformed one: one line here, not a traceback from every rank
    if command:
        return _launch_command(args, overrides, command)
    from freescale import forkserver

    with forkserver.started():  # the ranks' warm server, importing while this checks the config
        return _launch_train(args, overrides)


def _launch_train(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = _load_train_config(args.config, overrides, args.resume)
    from freescale.dataloader.schema import DatasetManifest

    DatasetManifest.read(cfg.data.path)  # fail here, once, before any rank starts
    from freescale import run_lease

    if args.lighthouse or cfg.ft.lighthouse:  # groups of this job may run under other launchers (by hand, on
        return _launch_ranks(args, overrides, cfg)  # other machines) sharing the directory: no lease of ours
    root = Path(cfg.checkpoint.dir or Path(cfg.train.output_dir) / "checkpoints")
    # One job per run directory, held until every rank has ended (the ranks' commits check its token); what
    # killed saves left is removed before any rank starts.
    with run_lease.held(run_lease.lease_directories(cfg.train.output_dir, root), stale=root):
        from freescale.resume import newest_earlier, refuse_an_earlier_run

        refuse_an_earlier_run(root, newest_earlier(cfg, root))  # once, before any rank starts (and the stale partials go)
        try:
            return _launch_ranks(args, overrides, cfg)
        finally:  # every rank has ended: what a stop or a crash left half-written goes, no writer can race it
            from freescale.checkpoint import remove_stale

            remove_stale(root)


def _launch_ranks(args: argparse.Namespace, overrides: list[str], cfg: Any) -> int:
    from freescale.launch import launch_local, launch_replicas

    train_args = ([f"--config={args.config}"] if args.config else []) + (["--resume"] if args.resume else [])
    if args.replicas > 1:
        if cfg.data.calibrate_every:
            raise ConfigError("data.calibrate_every: not supported with replica groups yet (the fitted cost model "
                              "would have to be agreed across groups to keep their plans identical); set it to 0")
        policy = rank_loss_policy(args, cfg.ft.on_rank_loss, cfg.ft.min_group_ranks, cfg.ft.grow_back_after_s,
                                  args.replicas)
        return launch_replicas(args.replicas, args.nproc_per_node, args.max_restarts, [*train_args, *overrides],
                               lighthouse_url=args.lighthouse, output_dir=cfg.train.output_dir,
                               title=f"freescale: {cfg.model.kind}, {args.replicas} replica group(s) of "
                                     f"{args.nproc_per_node} rank(s)", standby=standby_wanted(args), **policy)
    standby_wanted(args)
    # One group of a job whose groups run under launchers of their own (``--ft.lighthouse``, on other machines).
    peers = cfg.ft.replicas if (args.lighthouse or cfg.ft.lighthouse) else 1
    policy = rank_loss_policy(args, cfg.ft.on_rank_loss, cfg.ft.min_group_ranks, cfg.ft.grow_back_after_s, peers)
    if peers > 1:
        from freescale.ft.config import REPLICA_INDEX_ENV

        os.environ.setdefault(REPLICA_INDEX_ENV, str(cfg.ft.replica_index))  # (the agent's lines name the group)
    return launch_local(args.nproc_per_node, args.max_restarts, [*train_args, *overrides], **policy)


def standby_wanted(args: argparse.Namespace) -> bool:
    """``--standby``, refused in one line where a standby could not take over: groups of several ranks (it
    cannot join their process group), or a job without peer groups to catch up from."""
    if not args.standby:
        return False
    if args.nproc_per_node != 1:
        raise ConfigError(f"--standby: warm standbys are for one-rank replica groups (--nproc-per-node 1); got "
                          f"{args.nproc_per_node} ranks per group (a standby cannot join a group's process group)")
    if args.replicas < 2:
        raise ConfigError("--standby: a standby catches up from the other replica groups; needs --replicas 2 or more")
    return True


def rank_loss_policy(args: argparse.Namespace, on_rank_loss: str, min_group_ranks: int,
                     grow_back_after_s: float, replicas: int) -> dict[str, Any]:
    """``--on-rank-loss`` / ``--min-group-ranks`` / ``--grow-back-after`` where given, else the config's (``[ft]``),
    as ``launch_replicas`` takes them; refused where a group that shrinks would have no peer group to catch up
    from, or could not shrink at all."""
    policy = args.on_rank_loss or on_rank_loss
    min_ranks = args.min_group_ranks if args.min_group_ranks is not None else min_group_ranks
    grow_back = args.grow_back_after if args.grow_back_after is not None else grow_back_after_s
    if grow_back < 0:
        raise ConfigError(f"--grow-back-after: must be >= 0 seconds (0: never), got {grow_back:g}")
    if policy == "shrink" and replicas < 2:
        raise ConfigError("on_rank_loss = shrink: needs --replicas 2 or more (a group that lost a rank catches up "
                          "from a peer group)")
    if policy == "shrink" and not 1 <= min_ranks < args.nproc_per_node:
        raise ConfigError(f"min_group_ranks: must be in 1..{args.nproc_per_node - 1} for a group of "
                          f"{args.nproc_per_node} ranks to shrink, got {min_ranks}")
    return {"on_rank_loss": policy, "min_group_ranks": min_ranks, "grow_back_after_s": grow_back}


def _launch_command(args: argparse.Namespace, overrides: list[str], command: list[str]) -> int:
    """``freescale launch [--replicas R] ... -- python my_loop.py ...``: a user's own loop under the launcher."""
    from freescale.launch import launch_replicas

    if args.config or args.resume or overrides:
        raise ConfigError(f"launch -- {command[0]} ...: --config, --resume and config keys are for `freescale train`; "
                          "pass your script's own options after --")
    from freescale import forkserver

    # Always replica groups (one is fine): the command's loop asks the lighthouse for every step.
    with forkserver.started(forkserver.LOOP_MODULES):  # `python my_loop.py` ranks forked warm
        return launch_replicas(args.replicas, args.nproc_per_node, args.max_restarts, [],
                               lighthouse_url=args.lighthouse, command=command, standby=standby_wanted(args),
                               **rank_loss_policy(args, "restart", 1, 0.0, args.replicas))
