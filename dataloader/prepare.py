"""``freescale prepare``: an interaction log in, a format-2 freescale dataset out.

    log files ──(log_input: find, check, normalize; one file at a time)──► DuckDB table ``log``
      ──(prepare_sql: item/user filters, vocabularies, sorted stream)──► sequence_writer
      ──► users-*.parquet, vocab/{user_id,item_id}.parquet, dataset.json (written last)

The engine is DuckDB, in process: it holds the log in its own columnar file in
``work_dir`` and spills joins, aggregates and the final sort there when they
outgrow ``memory`` (its buffer bound; the writer adds about one row group and
one batch, and the vocabularies are fetched whole at the end: 16 bytes an id
plus the log's own ids).  Nothing here is a hand-written external sort.  Reading is the only
phase whose progress we can count row by row (the engine runs the rest as one
query), so the progress bar shows rows read per second, then interactions
written.  Every user-fixable problem is a ``DataError`` of one line.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from freescale.dataloader import prepare_sql as sql
from freescale.dataloader.log_input import DELIMITERS, InteractionLog, LogColumns
from freescale.dataloader.schema import MANIFEST_NAME, SEQUENCE_FORMAT_VERSION, DataError, DatasetManifest
from freescale.dataloader.sequence_writer import SequenceWriter, SplitRule, WriteResult
from freescale.dataloader.source import resolve

FETCH_ROWS = 1 << 18
DUPLICATES = "exact duplicate rows"


class Engine(Protocol):
    """Where the SQL of ``prepare_sql`` runs: DuckDB in this process (``DuckEngine``), or Spark
    (``prepare_spark.SparkEngine``); the steps around it are the same for both."""

    def run(self, statement: str) -> None: ...

    def rows(self, query: str) -> list[tuple[Any, ...]]: ...

    def arrow(self, query: str) -> pa.Table: ...


@dataclass
class DuckEngine:
    con: Any

    def run(self, statement: str) -> None:
        self.con.execute(statement).fetchall()  # DuckDB wants every result finished before the next

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        return list(self.con.execute(query).fetchall())

    def arrow(self, query: str) -> pa.Table:
        return self.con.sql(query).to_arrow_table()


@dataclass
class PrepareSpec:
    """Everything ``freescale prepare`` takes (its flags, one for one)."""

    input: str
    out: str
    columns: LogColumns
    format: str = "auto"
    split: str = "leave-last-out"
    """``leave-last-out`` | ``time:<ISO date or epoch seconds>`` | ``time-quantile:<q in (0, 1)>``: the test part."""
    validation: str = "last"
    """The validation part, before the test part: ``last`` (each user's interaction just before it), ``none``, or
    with a time split an earlier cut, ``time:<...>`` | ``time-quantile:<q>``."""
    min_user_count: int = 5
    min_item_count: int = 1
    memory: str = "4GB"
    threads: int = 0
    """Engine threads (0: every core)."""
    work_dir: str = ""
    """Where the engine keeps the log and spills (default: a new directory under the system temp)."""
    seed: int = 0
    row_group_interactions: int = 4_096
    """Interactions per Parquet row group: about 80 KB, so a rank's share of a planning window at 1,024
    ranks decodes little more than it trains on (benchmarks/bench_reads.py)."""
    overwrite: bool = False
    dedupe: bool = False
    """Drop exact duplicate rows (equal in every column read), keeping the first; they are counted either way."""
    delimiter: str | None = None
    """A CSV log's field delimiter (default: sniffed from each file's first lines)."""

    def validate(self) -> None:
        if self.min_user_count < 1 or self.min_item_count < 1:
            raise DataError("--min-user-count and --min-item-count must be >= 1")
        if self.row_group_interactions < 1:
            raise DataError("--row-group-interactions must be >= 1")
        if self.delimiter is not None and (len(self.delimiter) != 1 or self.delimiter in "\"\r\n"):
            raise DataError(f"--delimiter must be one character (such as {', '.join(map(repr, DELIMITERS))}), "
                            f"got {self.delimiter!r}")
        parse_validation(self.validation, parse_split(self.split)[0])

    def layout(self) -> sql.Layout:
        """The engine's log table as the SQL reads it (``unique_log`` once duplicates are dropped)."""
        return sql.Layout(len(self.columns.dense), tie=self.columns.tie_break is not None,
                          table="unique_log" if self.dedupe else "log")


@dataclass
class PrepareReport:
    """What a preparation read, dropped and wrote (the summary table, and the manifest's ``preparation``)."""

    interactions_read: int = 0
    duplicates: int = 0
    """Rows equal in every column read to an earlier row (dropped with ``dedupe``, else kept and counted)."""
    dropped: dict[str, int] = field(default_factory=dict)
    users: int = 0
    items: int = 0
    interactions_kept: int = 0
    samples: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    wall_s: float = 0.0
    time_cut: int | None = None
    valid_cut: int | None = None

    def rows(self) -> list[dict[str, Any]]:
        out = [{"what": "interactions read", "count": self.interactions_read}]
        if not any(reason.startswith(DUPLICATES) for reason in self.dropped):
            out += [{"what": f"{DUPLICATES} (kept; --dedupe drops them)", "count": self.duplicates}]
        out += [{"what": f"dropped: {reason}", "count": n} for reason, n in self.dropped.items()]
        out += [{"what": "users", "count": self.users}, {"what": "items", "count": self.items},
                {"what": "history only (each user's first interaction: never a target)", "count": self.users}]
        out += [{"what": f"samples: {split}", "count": n} for split, n in self.samples.items()]
        out += [{"what": "bytes written", "count": self.bytes_written},
                {"what": "wall time (s)", "count": round(self.wall_s, 2)}]
        return out


def parse_split(text: str) -> tuple[str, str]:
    kind, _, value = text.partition(":")
    if kind == "leave-last-out" and not value:
        return kind, ""
    if kind in ("time", "time-quantile") and value:
        if kind == "time-quantile":
            try:
                q = float(value)
            except ValueError:
                q = -1.0
            if not 0.0 < q < 1.0:
                raise DataError(f"--split time-quantile:Q needs 0 < Q < 1, got {value!r}")
        else:
            time_cut(value)
        return kind, value
    raise DataError(f"--split must be leave-last-out, time:<ISO date or epoch seconds> or time-quantile:<Q>, got {text!r}")


def time_cut(value: str) -> int:
    """``--split time:VALUE`` as epoch seconds: an integer, or an ISO date/time (UTC unless it says)."""
    import datetime as dt

    try:
        return int(value)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise DataError(f"--split time:{value}: not an ISO date/time or epoch seconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return int(moment.timestamp())


def prepare(spec: PrepareSpec, progress: Callable[[str, int, int | None], None] | None = None) -> PrepareReport:
    """Run the whole preparation; ``progress(phase, rows_done_delta, total)`` is called as it goes."""
    import duckdb

    spec.validate()
    start = time.perf_counter()
    report_progress = progress or (lambda phase, n, total: None)
    log = InteractionLog.open(spec.input, spec.columns, spec.format, spec.delimiter)
    out_fs, out_base, old_files = output_dir(spec)
    if spec.work_dir:
        Path(spec.work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="freescale-prepare-", dir=spec.work_dir or None))
    con = None
    try:
        con = duckdb.connect(str(work / "prepare.duckdb"))
        engine = DuckEngine(con)
        engine.run(f"SET memory_limit = '{_memory(spec.memory)}'")
        engine.run(f"SET temp_directory = '{work / 'spill'}'")
        engine.run("SET preserve_insertion_order = false")
        if spec.threads:
            engine.run(f"SET threads = {int(spec.threads)}")
        _load(con, log, lambda n: report_progress("read", n, log.total_rows))
        report = filter_and_count(engine, spec)
        if spec.dedupe:
            engine.run("DROP TABLE log")  # its unique rows are in unique_log now: free the engine's disk
        rule = split_rule(engine, spec, report)
        clear_output(spec, out_fs, out_base, old_files)
        result = _write(con, spec, out_fs, out_base, rule, report, report_progress)
        write_vocab(engine, out_fs, out_base)
    except duckdb.OutOfMemoryException as exc:
        raise DataError(f"prepare: --memory {spec.memory} is too small for the engine ({str(exc).splitlines()[0]}); "
                        "give it more") from None
    except duckdb.Error as exc:
        raise DataError(f"prepare: the engine failed: {str(exc).splitlines()[0]}") from None
    except OSError as exc:
        raise DataError(f"{spec.out}: cannot write the dataset ({exc})") from None
    finally:
        if con is not None:
            con.close()
        shutil.rmtree(work, ignore_errors=True)
    finish(out_fs, out_base, spec, len(log.files), report, result, start)
    return report


def _memory(text: str) -> str:
    import re

    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*(KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*", text, flags=re.IGNORECASE):
        raise DataError(f"--memory must be a size such as 512MB or 4GB, got {text!r}")
    return text.strip()


def output_dir(spec: PrepareSpec) -> tuple[pafs.FileSystem, str, list[str]]:
    """Before the log is read: the output directory's file system and path, and the files of the dataset already
    there (``overwrite``; without it, a dataset there is refused).  Nothing is removed yet (``clear_output``)."""
    fs, base = resolve(spec.out)
    base = base.rstrip("/") or "/"
    try:
        old_files: list[str] = []
        if fs.get_file_info(f"{base}/{MANIFEST_NAME}").type == pafs.FileType.File:
            if not spec.overwrite:
                raise DataError(f"{spec.out}: already holds a dataset ({MANIFEST_NAME}); choose another --out or "
                                "pass --overwrite")
            old = DatasetManifest.read_from(fs, base, spec.out)
            old_files = [MANIFEST_NAME, *sorted({f for names in old.splits.values() for f in names}
                                                | set(old.vocab.values()))]
        if fs.get_file_info(base).type == pafs.FileType.File:
            raise DataError(f"{spec.out}: is a file; --out names a directory")
    except OSError as exc:
        raise DataError(f"{spec.out}: cannot prepare the output directory ({exc})") from None
    return fs, base, old_files


def clear_output(spec: PrepareSpec, fs: pafs.FileSystem, base: str, old_files: list[str]) -> None:
    """Once the whole log is read and checked, before the first file is written: the old dataset goes, its
    manifest first (a run that fails from here never leaves it pointing at half-new files), then the files it
    listed (never a file of the user's); the directory is made.  A log refused while it is read loses nothing."""
    try:
        for name in old_files:
            if fs.get_file_info(f"{base}/{name}").type == pafs.FileType.File:
                fs.delete_file(f"{base}/{name}")
        fs.create_dir(f"{base}/vocab", recursive=True)
    except OSError as exc:
        raise DataError(f"{spec.out}: cannot prepare the output directory ({exc})") from None


def _load(con: Any, log: InteractionLog, on_rows: Callable[[int], None]) -> None:
    """Stream the log's checked batches into the engine's table ``log``.  A DataError raised inside the
    stream reaches us wrapped by the engine: keep it, and raise it as it was."""
    failure: list[DataError] = []

    pool = pa.default_memory_pool()

    def batches() -> Any:
        try:
            for batch in log.batches(on_rows):
                yield batch
                # The engine copies each batch and frees it on its own threads; pyarrow's allocator keeps
                # such freed pages unless asked (at 100M interactions the process held 10 GB of them).
                pool.release_unused()
        except DataError as exc:
            failure.append(exc)
            raise

    reader = pa.RecordBatchReader.from_batches(log.schema(), batches())
    con.register("normalized_log", reader)
    try:
        DuckEngine(con).run("CREATE TABLE log AS SELECT * FROM normalized_log")
    except Exception:
        if failure:
            raise failure[0] from None
        raise
    finally:
        con.unregister("normalized_log")
        pool.release_unused()  # from this thread too: it reaches pages the engine's threads freed


def filter_and_count(engine: Engine, spec: PrepareSpec) -> PrepareReport:
    """Duplicates, filters and vocabularies (tables in the engine), counted; a log that keeps nothing is an
    error."""
    loaded = replace(spec.layout(), table="log")
    duplicates = int(engine.rows(sql.duplicates_query(loaded))[0][0] or 0)
    if spec.dedupe:
        engine.run(sql.dedupe_statement(loaded))
    filters = sql.Filters(spec.min_item_count, spec.min_user_count, spec.seed, table=spec.layout().table)
    for statement in sql.vocabulary_statements(filters):
        engine.run(statement)
    names = ["interactions", "rows_rare_items", "rare_items", "rows_rare_users", "rare_users",
             "kept", "users", "items", "positives"]
    counts = dict(zip(names, (int(v or 0) for v in engine.rows(sql.counts_query(filters))[0])))
    if counts["interactions"] == 0:
        raise DataError(f"{spec.input}: the log has no rows")
    c = spec.columns
    if c.rating_threshold is not None and counts["positives"] == 0:
        raise DataError(f"{spec.input}: --rating-threshold {c.rating_threshold:g} matches no row of column '{c.label}'")
    if counts["users"] == 0:
        raise DataError(
            f"{spec.input}: no user is left after the filters ({counts['rare_users']:,} users have fewer than "
            f"--min-user-count {spec.min_user_count} interactions)"
        )
    dropped = {f"{DUPLICATES} (--dedupe)": duplicates} if spec.dedupe else {}
    dropped[f"item seen < {spec.min_item_count} times ({counts['rare_items']:,} items)"] = counts["rows_rare_items"]
    dropped[f"user with < {spec.min_user_count} interactions ({counts['rare_users']:,} users)"] = counts["rows_rare_users"]
    return PrepareReport(
        interactions_read=counts["interactions"] + (duplicates if spec.dedupe else 0), duplicates=duplicates,
        dropped=dropped, users=counts["users"], items=counts["items"], interactions_kept=counts["kept"],
    )


def split_rule(engine: Engine, spec: PrepareSpec, report: PrepareReport) -> SplitRule:
    kind, value = parse_split(spec.split)
    valid, valid_cut = parse_validation(spec.validation, kind), None
    if valid.startswith("time"):
        valid_cut = _cut(engine, spec, *parse_split(spec.validation))
        report.valid_cut = valid_cut
        valid = "time"
    if kind == "leave-last-out":
        return SplitRule("leave-last-out", valid=valid, valid_cut=valid_cut)
    cut = report.time_cut = _cut(engine, spec, kind, value)
    if valid_cut is not None and valid_cut >= cut:
        raise DataError(f"--validation {spec.validation} cuts at {valid_cut}, not before the test cut "
                        f"--split {spec.split} ({cut}): no validation interaction would be left")
    return SplitRule("time", cut, valid, valid_cut)


def _cut(engine: Engine, spec: PrepareSpec, kind: str, value: str) -> int:
    """A time cut in epoch seconds (``time:`` as given; ``time-quantile:`` from the log's timestamps)."""
    if kind == "time-quantile":
        return int(engine.rows(sql.time_quantile_query(float(value), spec.layout().table))[0][0])
    return time_cut(value)


def parse_validation(text: str, split_kind: str) -> str:
    """``--validation`` checked against the split: ``last``, ``none``, or a time cut with a time split."""
    if text in ("last", "none"):
        return text
    kind, _, value = text.partition(":")
    if kind in ("time", "time-quantile") and value:
        if split_kind == "leave-last-out":
            raise DataError(f"--validation {text}: a time cut for validation needs a time split "
                            "(--split time:... or time-quantile:...); with leave-last-out use --validation last")
        parse_split(text)
        return kind
    raise DataError(f"--validation must be last, none, time:<ISO date or epoch seconds> or time-quantile:<Q>, "
                    f"got {text!r}")


def _write(con: Any, spec: PrepareSpec, fs: pafs.FileSystem, base: str, rule: SplitRule, report: PrepareReport,
           progress: Callable[[str, int, int | None], None]) -> WriteResult:
    writer = SequenceWriter(fs, base, dense_dim=len(spec.columns.dense), rule=rule,
                            row_group_interactions=spec.row_group_interactions)
    stream = con.sql(sql.sequences_query(spec.layout())).to_arrow_reader(FETCH_ROWS)
    try:
        for batch in stream:
            writer.add(batch)
            progress("write", batch.num_rows, report.interactions_kept)
            pa.default_memory_pool().release_unused()  # as in ``_load``
        return writer.close()
    except BaseException:
        writer.discard()
        raise


def write_vocab(engine: Engine, fs: pafs.FileSystem, base: str) -> None:
    for feature in ("user_id", "item_id"):
        pq.write_table(engine.arrow(sql.vocab_query(feature)), f"{base}/vocab/{feature}.parquet", filesystem=fs)


def finish(fs: pafs.FileSystem, base: str, spec: PrepareSpec, files_read: int | None, report: PrepareReport,
           result: WriteResult, start: float, engine: str = "duckdb") -> None:
    """The report completed from what was written, then the manifest (last: it makes the dataset)."""
    report.samples = {"train": result.train_samples, "valid": result.valid_samples, "eval": result.eval_samples}
    report.bytes_written = result.bytes_written
    report.wall_s = time.perf_counter() - start
    params = {k: v for k, v in asdict(spec).items() if k not in ("columns", "overwrite", "work_dir", "threads")}
    params["columns"] = {k: v for k, v in asdict(spec.columns).items() if v not in (None, ())}
    params["label_rule"] = spec.columns.label_rule
    params["engine"] = engine
    if files_read is not None:
        params["files_read"] = files_read
    report_fields = asdict(report)
    manifest = DatasetManifest(
        num_items=report.items, num_users=report.users, dense_dim=len(spec.columns.dense),
        max_len=result.max_length, splits={split: list(result.files) for split in ("train", "valid", "eval")},
        rows={split: result.users for split in ("train", "valid", "eval")}, format_version=SEQUENCE_FORMAT_VERSION,
        samples=dict(report.samples), vocab={"user_id": "vocab/user_id.parquet", "item_id": "vocab/item_id.parquet"},
        preparation={"tool": "freescale prepare", **params, "report": report_fields,
                     "written": {"interactions": result.interactions, "row_groups": result.row_groups,
                                 "files": len(result.files)}},
    )
    manifest.write_to(fs, base)
