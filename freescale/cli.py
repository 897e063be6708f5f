"""The ``freescale`` command: ``prepare``, ``gen-log``, ``gen-data``, ``train``, ``launch``, ``lighthouse``, ``simulate``, ``report``.

    freescale gen-log --out data/ratings.csv && freescale prepare data/ratings.csv --out data/ml \
        --user userId --item movieId --time timestamp --label rating --rating-threshold 4   (cli_prepare.py)
    freescale gen-data --out data/demo --rows 40000
    freescale train --config configs/tiny_hstu.toml --data.path data/demo --train.steps 50
    freescale launch --nproc-per-node 2 --config configs/tiny_hstu.toml --data.path data/demo
    freescale launch --replicas 2 --ranks-per-replica 2 --max-restarts 3 --config configs/tiny_hstu.toml
    freescale launch --replicas 2 --ranks-per-replica 2 --max-restarts 3 -- python my_loop.py   # your own loop (freescale.ft.wrap)
    freescale simulate --gpus 98304 --project --plot ettr.png
    freescale report runs/demo

``train`` runs one rank (under torchrun, or alone); ``launch`` starts N local
ranks under torch's elastic agent (``freescale.launch``) after checking the
config and data in the parent, so a typo costs one line, not N tracebacks.  Every config key can be overridden as
``--section.key VALUE`` (see ``freescale train --help``).  Bad input exits with
status 2 and one line that names the key, flag, file or column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from freescale.cli_parser import _reject_unknown_options, _trainer_config_cls, build_parser
from freescale.config import ConfigError, load_config


def _load_train_config(config: str | None, overrides: list[str], resume: bool) -> Any:
    cfg: Any = load_config(_trainer_config_cls(), config, overrides)
    # torchrun --max-restarts: a restarted group continues from its latest checkpoint.
    from freescale.ft.config import incarnation

    if resume or incarnation() > 0:
        cfg.checkpoint.resume = True
    return cfg


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


# ----- gen-data -----------------------------------------------------------------------
def cmd_gen_data(args: argparse.Namespace) -> int:
    import time

    from freescale.dataloader.synthetic import SyntheticSpec, generate

    spec = SyntheticSpec(
        rows=args.rows, eval_rows=args.eval_rows, valid_rows=args.valid_rows, num_items=args.num_items, num_users=args.num_users,
        num_categories=args.num_categories, dense_dim=args.dense_dim, max_len=args.max_len,
        lengths=args.lengths, zipf_alpha=args.zipf_alpha, seed=args.seed, row_group_size=args.row_group_size,
    )
    start = time.perf_counter()
    manifest = generate(args.out, spec)
    seconds = time.perf_counter() - start
    print(
        f"wrote {manifest.rows['train']:,} train + {manifest.rows['eval']:,} eval rows to {args.out} "
        f"in {seconds:.1f}s (items {manifest.num_items:,}, users {manifest.num_users:,}, "
        f"lengths {spec.lengths} clipped to {spec.max_len})"
    )
    return 0


# ----- train ----------------------------------------------------------------------------
def cmd_lighthouse(args: argparse.Namespace) -> int:
    from freescale.ft.lighthouse import LighthouseConfig, run_forever

    cfg = LighthouseConfig(
        bind=args.bind, min_replicas=args.min_replicas, join_timeout_s=args.join_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout, state_path=args.state, body_timeout_s=args.body_timeout,
        # Without a state file a start may be a restart: let live groups re-register first.
        settle_s=0.0 if args.state else args.heartbeat_timeout,
        max_request_bytes=args.max_request_bytes, token=os.environ.get("FREESCALE_LIGHTHOUSE_TOKEN", ""),
        max_beats_per_s=args.max_beats_per_s,
    )
    try:
        cfg.validate()
        run_forever(cfg)
    except (ValueError, OSError) as exc:  # a bad flag or state file, a port in use: one line
        raise ConfigError(str(exc)) from None
    return 0


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from freescale.launch import restart_is_futile

    if restart_is_futile():
        return 0  # the error that ended the previous incarnation is reported by ``launch``
    cfg = _load_train_config(args.config, overrides, args.resume)
    from freescale.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.open_dataset()  # fail before the process group exists (the run reads the manifest this once)
    cfg.ft.resolve_env()
    from freescale import rank_console
    from freescale.lifetime import Stopped, stops_raise

    try:
        # The run directory's lease first (without the launcher): a refused run touches none of its files.
        with trainer.lease(), stops_raise():  # SIGTERM (the agent, a scheduler) unwinds like ^C: no partial save
            rank_console.install(cfg.train.output_dir, cfg.ft.replica_id if cfg.ft.enabled else None)
            summary = trainer.fit()
    except Stopped as stopped:  # the launcher reports the stop, once
        return 128 + stopped.signum
    if _is_rank0():
        from freescale.job_summary import SUMMARY_ENV

        if summary.finished_elsewhere:
            print(f"freescale: replica group {cfg.ft.replica_index}: the run had finished when this group "
                  "(re)started; nothing left to train", file=sys.stderr)
        elif not (cfg.ft.enabled and os.environ.get(SUMMARY_ENV)):  # the launcher prints one for the job
            print_summary(summary, f"replica group {cfg.ft.replica_index}" if cfg.ft.enabled else "")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Training ended cleanly (barrier, process groups destroyed, files closed).
        # Interpreter teardown then runs C++ destructors of torchrec/gloo objects,
        # which abort now and then ("terminate called without an active
        # exception", signal 6) and would turn a finished run into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def print_summary(summary: Any, who: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"freescale: {summary.model} on {summary.world_size} rank(s)" + (f", {who}" if who else ""))
    table.add_column("metric")
    table.add_column("value", justify="right")
    if summary.steps:
        rows = [
            ("steps", f"{summary.steps:,} (from step {summary.start_step})"),
            ("samples", f"{summary.samples:,}"),
            ("samples/s", f"{summary.samples_per_s:,.0f}"),
            ("train loss", f"{summary.train_loss:.4f}"),
        ]
        if summary.train_auc is not None:
            rows.append(("train AUC", f"{summary.train_auc:.4f}"))
    else:  # (a run resumed where it had ended, say: no loss or rate to show)
        rows = [("steps", f"0 (from step {summary.start_step})")]
    names = {"auc": "AUC", "ne": "NE", "mrr": "MRR"}
    v = summary.validation
    if v:
        share = v["seconds"] / summary.seconds if summary.seconds else 0.0
        rows.append(("validation", f"{v['evaluations']} in {v['seconds']:.1f} s ({share:.1%} of training)"))
        if v["best_step"] >= 0:
            rows.append((f"best {v['metric']} (valid)", f"{v['best_value']:.4f} at step {v['best_step']:,}"))
    where = " (best step)" if v and v.get("best_step", -1) >= 0 and v.get("evaluated_best") else ""
    rows += [(f"eval {names.get(k, k.upper() if '@' in k else k)}{where}", f"{val:.4f}")
             for k, val in summary.eval_metrics.items()]
    if summary.skipped_rows:
        rows.append(("rows skipped as bad", f"{summary.skipped_rows:,}"))
    if summary.checkpoint:
        rows.append(("checkpoint", summary.checkpoint))
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


# ----- simulate / report -----------------------------------------------------------------
def _parse_sets(pairs: list[str]) -> dict[str, float]:
    found = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            found[key] = float(value) if sep else float("nan")
        except ValueError:
            raise ConfigError(f"--set {pair}: expected KEY=NUMBER") from None
        if not sep:
            raise ConfigError(f"--set {pair}: expected KEY=NUMBER")
    return found


def cmd_simulate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from freescale.sim.command import run_simulate, writable, write_text

    if args.failures < 1:
        raise ConfigError(f"--failures must be >= 1, got {args.failures}")
    if args.json:
        writable(Path(args.json))  # before the simulations: a bad path fails in a second
    doc = run_simulate(Path(args.results), args.gpus, args.replicas, args.failures, args.seed,
                       _parse_sets(args.set), args.project, Path(args.plot) if args.plot else None, args.quick,
                       fresh_gates=args.fresh_gates)
    if args.json:
        write_text(Path(args.json), json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from freescale.report import write_report

    page = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {page}")
    return 0


# ----- checkpoint ------------------------------------------------------------------------
def cmd_checkpoint(args: argparse.Namespace) -> int:
    from freescale.checkpoint_inspect import inspect, print_inspection

    found = inspect(args.path, verify=args.verify)
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print_inspection(found)
    return 0


# ----- entry -----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # a rank its agent started plainly: it ends with the agent (``freescale.lifetime``)
        from freescale.lifetime import die_with_parent

        die_with_parent()
    command: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:  # launch ... -- python my_loop.py ...: a user's own command
        argv, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
        if not command:
            print("freescale: error: launch: nothing after --; give the command to run, e.g. -- python my_loop.py",
                  file=sys.stderr)
            return 2
    parser = build_parser(with_config_keys="-h" in argv or "--help" in argv)
    args, rest = parser.parse_known_args(argv)
    try:
        _reject_unknown_options(parser.commands[args.command], rest, overrides=args.command in ("train", "launch"))
        if args.command in ("prepare", "gen-log"):
            from freescale.cli_prepare import cmd_gen_log, cmd_prepare

            return cmd_prepare(args) if args.command == "prepare" else cmd_gen_log(args)
        if args.command == "gen-data":
            return cmd_gen_data(args)
        if args.command == "lighthouse":
            return cmd_lighthouse(args)
        if args.command == "simulate":
            return cmd_simulate(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "checkpoint":
            return cmd_checkpoint(args)
        if args.command == "launch" and args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        if args.command == "launch" and args.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
        if args.command == "train":
            return cmd_train(args, rest)
        from freescale.cli_launch import cmd_launch

        return cmd_launch(args, rest, command)
    except Exception as exc:  # one line for what the user can fix; tracebacks for our bugs
        if args.command == "lighthouse" and isinstance(exc, ConfigError):  # no torch import to say it
            print(f"freescale: error: lighthouse: {str(exc).removeprefix('lighthouse: ')}", file=sys.stderr)
            return 2
        if args.command == "checkpoint":
            from freescale.checkpoint import CheckpointError

            if isinstance(exc, CheckpointError):
                print(f"freescale: error: {exc}", file=sys.stderr)
                return 2
            raise
        if args.command in ("simulate", "report", "prepare", "gen-log"):  # light: no torch import to report errors
            from freescale.dataloader.schema import DataError
            from freescale.report.logs import ReportError
            from freescale.sim.command import GateFailed
            from freescale.sim.params import SimError

            if isinstance(exc, (ConfigError, SimError, ReportError, DataError)):
                print(f"freescale: error: {exc}", file=sys.stderr)
                return 1 if isinstance(exc, GateFailed) else 2
            raise
        from freescale.checkpoint import CheckpointError
        from freescale.dataloader.schema import DataError
        from freescale.ft.client import LighthouseError, ProgressLost
        from freescale.step_types import NonFiniteError

        if isinstance(exc, (ConfigError, DataError, CheckpointError, LighthouseError, NonFiniteError)):
            from freescale.launch import report_user_error

            # A lighthouse out of reach may come back; a run whose progress is lost will not.
            report_user_error(str(exc), restartable=isinstance(exc, LighthouseError) and not isinstance(exc, ProgressLost))
            return 2
        from freescale.group_sizes import ShrinkRefused
        from freescale.rank_console import report_handled, say
        from freescale.rank_speed import FailSlowEvicted

        if isinstance(exc, ShrinkRefused):  # its agent says why and restarts the group at its size before
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if isinstance(exc, FailSlowEvicted):  # as a crash: the launcher restarts the group, it catches up
            if os.environ.get("RANK", "0") == "0":
                say(f"freescale: {exc}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if args.command == "train" and report_handled(exc):
            # A peer failed: one line said it, the traceback is in the rank's log; the agent restarts the
            # group.  No interpreter teardown: gloo's destructors can abort and print on the way out.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise


if __name__ == "__main__":
    sys.exit(main())
