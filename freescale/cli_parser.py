"""The ``freescale`` command line's grammar: every command's flags and the value types they take (one-line errors:
``freescale: error: --flag: expected ..., got 'x'``), the train config's ``--section.key`` overrides (their names for
did-you-mean, their types and defaults for ``--help``), and the check that names an unknown option wherever it sits.
The commands themselves are ``freescale.cli`` (and ``cli_launch``, ``cli_prepare``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

from freescale.config import ConfigError, did_you_mean, type_name


def _config_keys(cls: type, prefix: str = "") -> list[str]:
    """``section.key  (type, default)`` lines for ``train --help``."""
    lines = []
    hints = typing.get_type_hints(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            lines += _config_keys(tp, f"{prefix}{f.name}.")
        else:
            lines.append(f"  --{prefix}{f.name:<24} {type_name(tp)}, default {getattr(instance, f.name)!r}")
    return lines


def _config_key_names(cls: type, prefix: str = "") -> list[str]:
    """Every ``section.key`` of a config tree (for did-you-mean)."""
    hints = typing.get_type_hints(cls)
    names: list[str] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        nested = isinstance(tp, type) and dataclasses.is_dataclass(tp)
        names += _config_key_names(tp, f"{prefix}{f.name}.") if nested else [prefix + f.name]
    return names


def _trainer_config_cls() -> type:
    from freescale.trainer import TrainerConfig

    return TrainerConfig


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``freescale: error: --flag: ...``, status 2); ``--help`` as usual."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.long_options: list[str] = []  # "nproc-per-node", ... (for did-you-mean)
        self.commands: dict[str, _Parser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.long_options += [s[2:] for s in action.option_strings if s.startswith("--")]
        return action

    def error(self, message: str) -> typing.NoReturn:
        from freescale.launch import report_user_error

        report_user_error(message.removeprefix("argument "))  # "--flag/--alias: expected ..., got 'x'"
        sys.exit(2)


def _typed(convert: typing.Callable[[str], Any], what: str) -> typing.Callable[[str], Any]:
    """An argparse ``type`` whose error reads ``expected <what>, got '<text>'``."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    return parse


def _whole(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


_int, _float, _natural = _typed(int, "an integer"), _typed(float, "a number"), _typed(_whole, "a whole number >= 0")


def _reject_unknown_options(command: _Parser, rest: list[str], overrides: bool) -> None:
    """Name the first flag in ``rest`` that is not an option of ``command`` (nor, with ``overrides``,
    a dotted ``--section.key``), wherever it sits.  Parsed as an override it would take the next
    argument as its value, and the error would name that argument instead."""
    for arg in rest:
        name = arg[2:].split("=", 1)[0]
        if arg.startswith("--") and name and not (overrides and "." in name):
            known = command.long_options + (_config_key_names(_trainer_config_cls()) if overrides else [])
            raise ConfigError(f"unknown option '--{name}'{did_you_mean(name, known, prefix='--')}")
    if rest and not overrides:
        raise ConfigError(f"unexpected argument {rest[0]!r}")


_LAUNCH_USAGE = """
  freescale launch [options] [--section.key VALUE ...]      train with `freescale train` on each rank
  freescale launch [options] -- COMMAND [ARG ...]          your own loop on each rank, e.g. -- python my_loop.py
                                                           (freescale.ft.wrap; its own options after the --)"""


def build_parser(with_config_keys: bool = True) -> _Parser:
    parser = _Parser(
        prog="freescale", description="Train recommendation models on torchrec; keep every rank busy."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{prepare,gen-log,gen-data,train,launch,lighthouse,simulate,report,checkpoint}")
    from freescale.cli_prepare import add_parsers

    add_parsers(sub, _int, _float)

    gen = sub.add_parser("gen-data", help="write a synthetic Parquet dataset with a learnable signal")
    gen.add_argument("--out", required=True, help="output directory (dataset.json + Parquet files)")
    gen.add_argument("--rows", type=_int, default=40_000, help="training rows (default 40000)")
    gen.add_argument("--eval-rows", type=_int, default=8_192, help="evaluation (test) rows (default 8192)")
    gen.add_argument("--valid-rows", type=_int, default=0, help="validation rows, for validation during training "
                     "(default 0: no validation split)")
    gen.add_argument("--num-items", type=_int, default=2_000, help="item vocabulary (default 2000)")
    gen.add_argument("--num-users", type=_int, default=5_000, help="user vocabulary (default 5000)")
    gen.add_argument("--num-categories", type=_int, default=16, help="hidden item categories (default 16)")
    gen.add_argument("--dense-dim", type=_int, default=8, help="dense features per sample (default 8)")
    gen.add_argument("--max-len", type=_int, default=64, help="longest history (default 64)")
    gen.add_argument("--lengths", default="ml-20m", help="history lengths: ml-1m, ml-20m, zipf or uniform (default ml-20m)")
    gen.add_argument("--zipf-alpha", type=_float, default=1.1, help="exponent for --lengths zipf (default 1.1)")
    gen.add_argument("--seed", type=_natural, default=0)
    gen.add_argument("--row-group-size", type=_int, default=8_192)

    lh = sub.add_parser("lighthouse", help="serve quorums for fault-tolerant replica groups (freescale.ft)")
    lh.add_argument("--bind", default="127.0.0.1:29510", help="host:port to serve HTTP on (default 127.0.0.1:29510)")
    lh.add_argument("--min-replicas", type=_int, default=1, help="smallest quorum (default 1)")
    lh.add_argument("--join-timeout", type=_float, default=1.0, help="seconds to wait for joiners when membership changes")
    lh.add_argument("--heartbeat-timeout", type=_float, default=1.0, help="seconds without a heartbeat before a replica is dead")
    lh.add_argument("--state", default="", help="durable state file (run, quorum ids, progress, holders): a restarted "
                    "lighthouse keeps them, so no step is committed twice and restarted groups catch up (recommended)")
    lh.add_argument("--max-request-bytes", type=_int, default=64 * 1024)
    lh.add_argument("--body-timeout", type=_float, default=5.0, help="seconds for a request body to arrive (else 408)")
    lh.add_argument("--max-beats-per-s", type=_float, default=2000.0, help="heartbeats a second to ask for at most: "
                    "past 100 voices (groups, through their agents) each beats less often than every 50 ms (default 2000)")
    # The shared token comes from the environment: a command line is visible to every user.

    sim = sub.add_parser("simulate", help="ETTR at scale by simulation: validation gates, then sync vs torchft-like vs freescale")
    sim.add_argument("--gpus", type=_int, default=16_384, help="GPUs of the simulated job (default 16384)")
    sim.add_argument("--replicas", type=_int, default=None, help="replica groups, a divisor of --gpus (default: the divisor nearest 16 up to 16K GPUs, then nearest 8K-GPU groups)")
    sim.add_argument("--failures", type=_int, default=1_000, help="crash/hang failures to simulate (default 1000)")
    sim.add_argument("--seed", type=_natural, default=0)
    sim.add_argument("--results", default="benchmarks/results", help="measured FT benchmark JSONs (default benchmarks/results: run from the repository root)")
    sim.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override an input (names in the inputs table)")
    sim.add_argument("--project", action="store_true", help="also project at 1K, 16K and 100K GPUs")
    sim.add_argument("--plot", help="write ETTR vs GPU count (1K..100K) to this PNG")
    sim.add_argument("--json", help="write gates, inputs and results to this JSON file")
    sim.add_argument("--quick", action="store_true", help="validation gates with fewer simulated failures")
    sim.add_argument("--fresh-gates", action="store_true", help="run the gates even if this simulator source's result is cached")

    rep = sub.add_parser("report", help="one HTML page with plots from a run's logs (train_log.jsonl, replica<g>/)")
    rep.add_argument("run_dir", help="the run's train.output_dir")
    rep.add_argument("--out", help="the page to write (default RUN_DIR/report.html)")

    ck = sub.add_parser("checkpoint", help="look into checkpoints (no model, no process group)")
    ck_sub = ck.add_subparsers(dest="action", required=True, metavar="{inspect}")
    ins = ck_sub.add_parser("inspect", help="step, shape, plan per table, sizes, config digest; checks the files")
    ins.add_argument("path", help="a checkpoint (step_N) or a checkpoint directory (its latest)")
    ins.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ins.add_argument("--verify", action="store_true", help="read every byte and check it against the checksums written with it")

    keys_help = None
    if with_config_keys:  # imports torchrec: only worth it when help is asked for
        keys_help = "config keys (override any as --section.key VALUE):\n" + "\n".join(
            _config_keys(_trainer_config_cls())
        )
    for name, helptext in (("train", "train on this process (one rank; run under torchrun for more)"),
                           ("launch", "start N local ranks of `train`, or of your own loop after -- (torchrun's elastic agent)")):
        usage = _LAUNCH_USAGE if name == "launch" else None
        p = sub.add_parser(name, help=helptext, epilog=keys_help, usage=usage,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", help="TOML config file (e.g. configs/tiny_hstu.toml)")
        p.add_argument("--resume", action="store_true", help="resume from the latest complete checkpoint")
        if name == "launch":
            p.add_argument("--nproc-per-node", "--ranks-per-replica", dest="nproc_per_node", type=_int, default=2,
                           help="local ranks (of each replica group with --replicas; default 2)")
            p.add_argument("--lighthouse", default="", help="with --replicas: use this lighthouse URL (a `freescale lighthouse` process) instead of one in the launcher")
            p.add_argument("--replicas", type=_int, default=1, help="fault-tolerant replica groups of --nproc-per-node ranks each, with a lighthouse in this process (freescale.ft; default 1: no fault tolerance)")
            p.add_argument("--max-restarts", type=_natural, default=0, help="restart the group this often when a rank fails; it resumes from its latest checkpoint (default 0)")
            p.add_argument("--standby", action="store_true",
                           help="with --replicas and --nproc-per-node 1: a warm standby beside each group's rank (imported, its model built) takes over the moment the rank dies; --max-restarts counts the standbys started after one took over")
            p.add_argument("--on-rank-loss", choices=("restart", "shrink"), default=None,
                           help="with --replicas: when a rank fails, restart its group (default; `train` reads [ft] on_rank_loss) or shrink it: it continues on the ranks it has left, at a proportional share")
            p.add_argument("--grow-back-after", type=float, default=None, metavar="S",
                           help="with --on-rank-loss shrink: a group on fewer ranks re-forms at its size after S seconds (default 0: never; `train` reads [ft] grow_back_after_s)")
            p.add_argument("--min-group-ranks", type=_int, default=None,
                           help="with --on-rank-loss shrink: the fewest ranks a group keeps training on (default 1; `train` reads [ft] min_group_ranks)")
    parser.commands = sub.choices
    return parser
