"""The data-in commands of ``freescale``: ``prepare`` (a log -> a dataset) and ``gen-log`` (a log to try it on).

    freescale gen-log --out data/ratings.csv                       # MovieLens-1M-shaped, made up
    freescale prepare data/ratings.csv --out data/ml --user userId --item movieId \\
        --time timestamp --label rating --rating-threshold 4

Neither imports torch: preparing a log is a data job that may run where no
trainer does.  A problem with the log or the flags is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def add_parsers(sub: Any, as_int: Any, as_float: Any) -> None:
    prep = sub.add_parser("prepare", help="turn an interaction log (Parquet or CSV) into a freescale dataset")
    prep.add_argument("input", help="a file, a directory or a glob, local or on any pyarrow filesystem (s3://, gs://, hdfs://)")
    prep.add_argument("--out", required=True, help="dataset directory to write (local or a filesystem URI)")
    prep.add_argument("--user", required=True, help="the user id column")
    prep.add_argument("--item", required=True, help="the item id column")
    prep.add_argument("--time", required=True, help="the timestamp column (numbers, dates, or text)")
    prep.add_argument("--label", default=None, help="a 0/1 (click) column, or the rating column with --rating-threshold; "
                      "without it every interaction is a positive (implicit feedback)")
    prep.add_argument("--rating-threshold", type=as_float, default=None, help="label = (--label column >= this)")
    prep.add_argument("--dense", default="", help="numeric columns of each interaction, comma separated (dense features)")
    prep.add_argument("--split", default="leave-last-out", help="leave-last-out (default: each user's last interaction "
                      "is held out), time:<ISO date or epoch s> or time-quantile:<Q> (a global time cut)")
    prep.add_argument("--validation", default="last", help="the validation part, before the test part: last (default: "
                      "each user's interaction just before it), none, or with a time split an earlier cut "
                      "time:<ISO date or epoch s> / time-quantile:<Q>")
    prep.add_argument("--min-user-count", type=as_int, default=5, help="drop users with fewer interactions (default 5)")
    prep.add_argument("--min-item-count", type=as_int, default=1, help="drop items seen fewer times, first (default 1)")
    prep.add_argument("--memory", default="4GB", help="the engine's memory bound; it spills to --work-dir beyond it (default 4GB)")
    prep.add_argument("--threads", type=as_int, default=0, help="engine threads (default: every core)")
    prep.add_argument("--work-dir", default="", help="where the engine keeps the log and spills (default: a temp dir)")
    prep.add_argument("--format", default="auto", choices=["auto", "parquet", "csv"], help="input format (default: by suffix)")
    prep.add_argument("--time-unit", default="s", choices=["s", "ms", "us", "ns"], help="unit of a numeric time column (default s)")
    prep.add_argument("--time-format", default=None, help="strptime format of a text time column (default: ISO 8601)")
    prep.add_argument("--tie-break", default=None, metavar="COLUMN",
                      help="a column (numbers or text) that orders a user's interactions at the same time; after it, "
                           "and without it, they keep the log's order (files, then rows)")
    prep.add_argument("--dedupe", action="store_true",
                      help="drop exact duplicate rows (equal in every column read), keeping the first; "
                           "without it they are kept, and counted in the summary either way")
    prep.add_argument("--delimiter", default=None, metavar="CHAR",
                      help="a CSV log's field delimiter (\\t or tab for a tab; default: sniffed among tab, comma, "
                           "semicolon and pipe from each file's header)")
    prep.add_argument("--row-group-interactions", type=as_int, default=4_096, help="interactions per Parquet row group (default 4096)")
    prep.add_argument("--seed", type=as_int, default=0, help="storage order of users (a seeded hash)")
    prep.add_argument("--overwrite", action="store_true", help="replace a dataset already at --out")
    prep.add_argument("--engine", default="duckdb", choices=["duckdb", "spark"],
                      help="duckdb (default: in this process, within --memory) or spark (the SparkSession of "
                           "spark-submit or a local one; --out must be reachable by every executor)")
    prep.add_argument("--partitions", type=as_int, default=0,
                      help="with --engine spark: parallel writers (default: Spark's default parallelism)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when stderr is not a terminal)")

    gen = sub.add_parser("gen-log", help="write a MovieLens-shaped interaction log with a learnable signal")
    gen.add_argument("--out", required=True, help="the log file to write: .csv or .parquet")
    gen.add_argument("--users", type=as_int, default=6_040, help="users (default 6040, as MovieLens 1M)")
    gen.add_argument("--items", type=as_int, default=3_706, help="items (default 3706, as MovieLens 1M)")
    gen.add_argument("--lengths", default="ml-1m", help="interactions per user: ml-1m or ml-20m fits (default ml-1m)")
    gen.add_argument("--successor", type=as_float, default=0.0,
                     help="within a session, the chance the next item is the last one's fixed successor (default 0: "
                          "no order, no sessions)")
    gen.add_argument("--new-session", type=as_float, default=0.2,
                     help="with --successor: the chance an interaction starts a new session, days later (default 0.2)")
    gen.add_argument("--tastes", type=as_int, default=1,
                     help="item categories each user prefers (default 1; more: the last item's category is one of "
                          "them, only the history names them all)")
    gen.add_argument("--seed", type=as_int, default=0)


def cmd_gen_log(args: argparse.Namespace) -> int:
    from freescale.dataloader.synthetic_log import LogSpec, write_log

    start = time.perf_counter()
    path, rows = write_log(args.out, LogSpec(users=args.users, items=args.items, lengths=args.lengths, seed=args.seed,
                                                 successor=args.successor, new_session=args.new_session,
                                                 tastes=args.tastes))
    print(f"wrote {rows:,} interactions of {args.users:,} users to {path} in {time.perf_counter() - start:.1f}s "
          "(columns userId, movieId, rating, timestamp)")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from freescale.dataloader.log_input import LogColumns
    from freescale.dataloader.prepare import PrepareSpec, prepare
    from freescale.tables import print_table

    if args.rating_threshold is not None and args.label is None:
        from freescale.dataloader.schema import DataError

        raise DataError("--rating-threshold needs --label (the rating column)")
    columns = LogColumns(
        user=args.user, item=args.item, time=args.time, label=args.label, rating_threshold=args.rating_threshold,
        dense=tuple(c.strip() for c in args.dense.split(",") if c.strip()), time_unit=args.time_unit,
        time_format=args.time_format, tie_break=args.tie_break,
    )
    spec = PrepareSpec(
        input=args.input, out=args.out, columns=columns, format=args.format, split=args.split,
        validation=args.validation,
        min_user_count=args.min_user_count, min_item_count=args.min_item_count, memory=args.memory,
        threads=args.threads, work_dir=args.work_dir, seed=args.seed,
        row_group_interactions=args.row_group_interactions, overwrite=args.overwrite, dedupe=args.dedupe,
        delimiter=_delimiter(args.delimiter),
    )
    if args.engine == "spark":
        report = _prepare_on_spark(spec, args.partitions)
    else:
        with _Progress(enabled=not args.no_progress and sys.stderr.isatty()) as progress:
            report = prepare(spec, progress.advance)
    print(f"prepared {args.input} -> {args.out} (format 2: one row per user; label {columns.label_rule}; "
          f"split {args.split}{'' if report.time_cut is None else f', cut at {report.time_cut} s'}; validation "
          f"{args.validation}{'' if report.valid_cut is None else f', cut at {report.valid_cut} s'})")
    print_table(report.rows(), ["what", "count"], align="left")
    return 0


def _delimiter(text: str | None) -> str | None:
    """``--delimiter``: a character, or a tab spelled so a shell passes it (``\\t``, ``tab``)."""
    return "\t" if text is not None and text.lower() in ("\\t", "tab") else text


def _prepare_on_spark(spec: Any, partitions: int) -> Any:
    from freescale.dataloader.schema import DataError

    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise DataError("--engine spark needs pyspark: pip install 'freescale[spark]'") from None
    from freescale.dataloader.prepare_spark import prepare_on_spark

    spark = SparkSession.builder.appName("freescale prepare").getOrCreate()
    return prepare_on_spark(spark, spec, partitions=partitions)


class _Progress:
    """A rich progress bar per phase (read, write) with rows/s; silent when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), transient=False)
            self._bar.__enter__()
        return self

    def advance(self, phase: str, rows: int, total: int | None) -> None:
        if self._bar is None:
            return
        if phase not in self._tasks:
            label = {"read": "reading the log", "write": "writing sequences"}.get(phase, phase)
            self._tasks[phase] = (self._bar.add_task(label, total=total, rate=""), time.perf_counter())
        task, started = self._tasks[phase]
        self._bar.advance(task, rows)
        done = self._bar.tasks[task].completed
        self._bar.update(task, rate=f"{done / max(time.perf_counter() - started, 1e-9):,.0f} rows/s")

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
