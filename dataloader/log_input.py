"""An interaction log as ``freescale prepare`` reads it: files, columns, checked batches.

A log is Parquet or CSV (``.csv``, ``.tsv``, optionally compressed), one file,
a directory (every such file under it) or a glob, on any pyarrow filesystem
(local, ``s3://``, ``gs://``, ``hdfs://``).  The user names the columns; this
module checks each file's schema at open, then streams the named columns one
file at a time, normalized and checked batch by batch:

    user, item   the log's own ids (integers or strings), never null
    ts           int64 seconds (integers in ``time_unit``, timestamps, dates,
                 or strings parsed as ISO 8601 or with ``time_format``)
    ts_fine      the same time at its own resolution (nanoseconds, or the raw
                 integer): only to order a user's interactions within a second
    label        float32 0/1 (a 0/1 or boolean column, ``rating >= threshold``,
                 or 1 for every row of an implicit-feedback log)
    d0, d1, ...  float32 dense features of the interaction, finite

Every problem is one ``DataError`` line naming the file, the row within it and
the column.  The checks are vectorized pyarrow compute on batches of up to
``BATCH_ROWS`` rows, so they cost little next to the engine's own work.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from freescale.dataloader.schema import DataError
from freescale.dataloader.source import resolve

BATCH_ROWS = 1 << 17
READ_AHEAD_BATCHES = 2
"""Batches the scanner decodes ahead of the engine: reading keeps pace, and holds a few MB, not a file."""
"""Rows per checked batch: the engine reads several ahead, so this bounds what the read holds in memory
(at 30M interactions under a 256 MB engine bound the load's peak was 1.66 GB with 1M-row batches, 1.08 GB
with 128K-row ones, at the same speed)."""
PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".tsv", ".csv.gz", ".tsv.gz", ".csv.bz2", ".tsv.bz2", ".csv.zst", ".tsv.zst")
TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


@dataclass(frozen=True)
class LogColumns:
    """Which column of the log is what (the user's ``--user``, ``--item`` ... flags)."""

    user: str
    item: str
    time: str
    label: str | None = None
    rating_threshold: float | None = None
    dense: tuple[str, ...] = ()
    time_unit: str = "s"
    time_format: str | None = None

    def named(self) -> list[str]:
        return [self.user, self.item, self.time, *([self.label] if self.label else []), *self.dense]

    @property
    def label_rule(self) -> str:
        if self.label is None:
            return "implicit (every interaction a positive)"
        if self.rating_threshold is None:
            return f"{self.label} (0/1)"
        return f"{self.label} >= {self.rating_threshold:g}"


def normalized_schema(dense_dim: int, user_type: pa.DataType, item_type: pa.DataType) -> pa.Schema:
    """The batches ``InteractionLog.batches`` yields."""
    return pa.schema(
        [("user", user_type), ("item", item_type), ("ts", pa.int64()), ("ts_fine", pa.int64()),
         ("label", pa.float32())]
        + [(f"d{i}", pa.float32()) for i in range(dense_dim)]
    )


@dataclass
class _File:
    path: str
    shown: str
    fragment: ds.Fragment
    rows: int | None = None  # known up front for Parquet


@dataclass
class InteractionLog:
    uri: str
    columns: LogColumns
    files: list[_File] = field(default_factory=list)
    format: str = "parquet"

    @classmethod
    def open(cls, uri: str, columns: LogColumns, fmt: str = "auto") -> InteractionLog:
        """Find the log's files and check that each has the named columns with usable types."""
        if columns.time_unit not in TIME_UNITS:
            raise DataError(f"--time-unit must be one of {', '.join(TIME_UNITS)}, got {columns.time_unit!r}")
        fs, path = resolve(uri)
        paths = _discover(fs, path, uri)
        fmt = _format_of(paths, uri) if fmt == "auto" else fmt
        if fmt not in ("parquet", "csv"):
            raise DataError(f"--format must be parquet, csv or auto, got {fmt!r}")
        log = cls(uri=uri, columns=columns, format=fmt)
        shown_base = uri.rstrip("/")
        for p in paths:
            shown = p if p == path else f"{shown_base}/{p[len(path.rstrip('/')) + 1:]}" if p.startswith(path) else p
            log.files.append(_open_file(fs, p, shown, fmt))
        log._check_columns()
        return log

    @property
    def total_rows(self) -> int | None:
        """Rows of every file when the format says so up front (Parquet), else None."""
        counts = [f.rows for f in self.files]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)

    def _check_columns(self) -> None:
        first: dict[str, tuple[pa.DataType, str]] = {}
        for f in self.files:
            schema = f.fragment.physical_schema
            for name in self.columns.named():
                idx = schema.get_field_index(name)
                if idx < 0:
                    has = ", ".join(schema.names[:12]) + (" ..." if len(schema.names) > 12 else "")
                    raise DataError(f"{f.shown}: no column '{name}' (it has: {has})")
                kind = kind_of(schema.field(idx).type)
                check_column_kind(name, kind, schema.field(idx).type, self.columns, f.shown)
                if name in first and first[name][0] != kind:
                    raise DataError(
                        f"{f.shown}: column '{name}' holds {kind} values, {first[name][1]} holds {first[name][0]}"
                    )
                first.setdefault(name, (kind, f.shown))

    def id_types(self) -> tuple[pa.DataType, pa.DataType]:
        """Arrow types of the user and item ids (int64 or string) as batches carry them."""
        schema = self.files[0].fragment.physical_schema
        return tuple(
            pa.int64() if kind_of(schema.field(schema.get_field_index(c)).type) == "integer" else pa.string()
            for c in (self.columns.user, self.columns.item)
        )

    def batches(self, on_rows: Callable[[int], None] = lambda n: None) -> Iterator[pa.RecordBatch]:
        """Every row, normalized and checked, file by file (``on_rows`` after each batch)."""
        user_type, item_type = self.id_types()
        schema = normalized_schema(len(self.columns.dense), user_type, item_type)
        for f in self.files:
            done = 0
            try:
                scanner = f.fragment.to_batches(columns=self.columns.named(), batch_size=BATCH_ROWS,
                                                batch_readahead=READ_AHEAD_BATCHES, **_streaming(f.fragment))
                for batch in scanner:
                    if batch.num_rows:
                        yield normalize_batch(batch, self.columns, schema, f"{f.shown}", done)
                    done += batch.num_rows
                    on_rows(batch.num_rows)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise DataError(f"{f.shown}: cannot read it past row {done} ({first_line})") from None


def _streaming(fragment: ds.Fragment) -> dict[str, Any]:
    """Scan options that keep a file's read bounded: pyarrow pre-buffers every selected row group of a
    Parquet file by default (the whole file in memory: 373 MB held while streaming a 30M-row log)."""
    if isinstance(fragment, ds.ParquetFileFragment):
        return {"fragment_scan_options": ds.ParquetFragmentScanOptions(pre_buffer=False)}
    return {}


def _discover(fs: pafs.FileSystem, path: str, shown: str) -> list[str]:
    """The files a path names: itself, every log file under a directory, or a glob's matches."""
    if any(ch in path for ch in "*?["):
        prefix = path[: min(path.find(ch) for ch in "*?[" if ch in path)]
        parent = posixpath.dirname(prefix) or "."
        try:
            infos = fs.get_file_info(pafs.FileSelector(parent, recursive=True))
        except OSError as exc:
            raise DataError(f"{shown}: cannot list {parent} ({exc})") from None
        # The selector names files under "." as "./name"; ``*`` stays within one directory level, as in a shell.
        pattern = f"./{path}" if parent == "." and not path.startswith("./") else path
        found = sorted(i.path for i in infos if i.type == pafs.FileType.File
                       and i.path.count("/") == pattern.count("/") and fnmatch.fnmatch(i.path, pattern))
        if not found:
            raise DataError(f"{shown}: no file matches this pattern")
        return found
    try:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{shown}: no such file or directory")
        if info.type == pafs.FileType.File:
            return [path]
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    except OSError as exc:
        raise DataError(f"{shown}: cannot list it ({exc})") from None
    found = sorted(
        i.path for i in infos
        if i.type == pafs.FileType.File and i.path.lower().endswith(PARQUET_SUFFIXES + CSV_SUFFIXES)
        and not i.base_name.startswith((".", "_"))
    )
    if not found:
        raise DataError(f"{shown}: no Parquet or CSV files in this directory")
    return found


def _format_of(paths: list[str], shown: str) -> str:
    kinds = {"parquet" if p.lower().endswith(PARQUET_SUFFIXES) else
             "csv" if p.lower().endswith(CSV_SUFFIXES) else "?" for p in paths}
    if kinds == {"?"} or len(kinds) > 1:
        raise DataError(f"{shown}: cannot tell the format from the file names; give --format parquet or --format csv")
    return kinds.pop()


def _open_file(fs: pafs.FileSystem, path: str, shown: str, fmt: str) -> _File:
    try:
        if fmt == "parquet":
            fragment = ds.ParquetFileFormat().make_fragment(path, filesystem=fs)
            fragment.ensure_complete_metadata()
            return _File(path, shown, fragment, rows=fragment.metadata.num_rows)
        tab = ".tsv" in path.lower()
        csv_format = ds.CsvFileFormat(parse_options=pacsv.ParseOptions(delimiter="\t" if tab else ","))
        fragment = csv_format.make_fragment(path, filesystem=fs)
        fragment.physical_schema  # noqa: B018  infer the columns now (reads the first block)
        return _File(path, shown, fragment)
    except (pa.ArrowInvalid, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{shown}: not a readable {fmt} file ({first_line})") from None


def kind_of(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "float"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time"
    return str(t)


def check_column_kind(name: str, kind: str, t: pa.DataType, cols: LogColumns, where: str) -> None:
    if name in (cols.user, cols.item):
        if kind not in ("integer", "string"):
            raise DataError(f"{where}: column '{name}' has type {t}; ids must be integers or strings")
    elif name == cols.time:
        if kind not in ("integer", "float", "string", "time"):
            raise DataError(f"{where}: column '{name}' has type {t}; timestamps must be numbers, dates or text")
    elif kind not in ("integer", "float", "boolean"):
        what = "label" if name == cols.label else "dense feature"
        raise DataError(f"{where}: column '{name}' has type {t}; a {what} column must be numeric (non-numeric values)")


def _first_bad(mask: np.ndarray, column: pa.Array) -> tuple[int, str]:
    i = int(np.flatnonzero(mask)[0])
    value = column[i].as_py()
    return i, "null" if value is None else repr(value)


def normalize_batch(batch: pa.RecordBatch, cols: LogColumns, schema: pa.Schema, shown: str, offset: int) -> pa.RecordBatch:
    """The batch in the normalized schema, or a DataError naming file, row and column."""

    def fail(name: str, mask: np.ndarray, column: pa.Array, what: str) -> DataError:
        i, value = _first_bad(mask, column)
        return DataError(f"{shown}: row {offset + i}: column '{name}': {what} ({value})")

    out: list[pa.Array] = []
    for name, target in ((cols.user, schema.field("user").type), (cols.item, schema.field("item").type)):
        column = batch.column(name)
        if column.null_count:
            raise fail(name, pc.is_null(column).to_numpy(zero_copy_only=False), column, "null id")
        out.append(column.cast(target))
    out.extend(_seconds(batch.column(cols.time), cols, fail))
    out.append(_labels(batch, cols, fail))
    for name in cols.dense:
        column = batch.column(name)
        values = pc.cast(column, pa.float32(), safe=False).to_numpy(zero_copy_only=False) if not column.null_count else None
        if values is None or not np.isfinite(values).all():
            mask = pc.is_null(column).to_numpy(zero_copy_only=False) if values is None else ~np.isfinite(values)
            raise fail(name, mask, column, "not a finite number")
        out.append(pa.array(values, pa.float32()))
    return pa.RecordBatch.from_arrays(out, schema=schema)


NS_PER = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


def _seconds(column: pa.Array, cols: LogColumns, fail: Callable[..., DataError]) -> tuple[pa.Array, pa.Array]:
    """int64 seconds since the epoch, and the time at its own resolution (to order ties within a second)."""
    name = cols.time
    if column.null_count:
        raise fail(name, pc.is_null(column).to_numpy(zero_copy_only=False), column, "null timestamp")
    t = column.type
    if pa.types.is_date(t):
        column = pc.cast(column, pa.timestamp("s"))
        t = column.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        column = _parse_text(column, cols, fail)
        t = column.type
    if pa.types.is_timestamp(t):
        ns = pc.cast(column, pa.int64()).to_numpy(zero_copy_only=False) * NS_PER[t.unit]
        return pa.array(np.floor_divide(ns, NS_PER["s"])), pa.array(ns)
    if pa.types.is_integer(t):
        raw = pc.cast(column, pa.int64()).to_numpy(zero_copy_only=False)
        return pa.array(np.floor_divide(raw, TIME_UNITS[cols.time_unit])), pa.array(raw)
    values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    if not np.isfinite(values).all():
        raise fail(name, ~np.isfinite(values), column, "not a finite number")
    seconds = values / TIME_UNITS[cols.time_unit]
    return pa.array(np.floor(seconds).astype(np.int64)), pa.array(np.rint(seconds * 1e9).astype(np.int64))


def _parse_text(column: pa.Array, cols: LogColumns, fail: Callable[..., DataError]) -> pa.Array:
    """Text -> timestamp[ns]: ``time_format``, or ISO 8601 (date; date and time, with fractions of a
    second, with or without a zone: zoned times are taken in UTC)."""
    if cols.time_format:
        parsed = pc.strptime(column, format=cols.time_format, unit="ns", error_is_null=True)
    else:
        for kind in (pa.timestamp("ns"), pa.timestamp("ns", tz="UTC")):
            try:
                return pc.cast(pc.cast(column, kind), pa.timestamp("ns"))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        attempts = [pc.strptime(column, format=f, unit="ns", error_is_null=True)
                    for f in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d")]
        parsed = pc.coalesce(*attempts)
    if parsed.null_count:
        hint = f"with --time-format {cols.time_format!r}" if cols.time_format else "as ISO 8601; give --time-format"
        raise fail(cols.time, pc.is_null(parsed).to_numpy(zero_copy_only=False), column, f"unparseable timestamp {hint}")
    return parsed


def _labels(batch: pa.RecordBatch, cols: LogColumns, fail: Callable[..., DataError]) -> pa.Array:
    if cols.label is None:
        return pa.array(np.ones(batch.num_rows, dtype=np.float32))
    column = batch.column(cols.label)
    if column.null_count:
        raise fail(cols.label, pc.is_null(column).to_numpy(zero_copy_only=False), column, "null label")
    values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    if not np.isfinite(values).all():
        raise fail(cols.label, ~np.isfinite(values), column, "not a finite number")
    if cols.rating_threshold is not None:
        return pa.array((values >= cols.rating_threshold).astype(np.float32))
    bad = ~np.isin(values, (0.0, 1.0))
    if bad.any():
        raise fail(cols.label, bad, column, "a label must be 0 or 1; for ratings give --rating-threshold")
    return pa.array(values.astype(np.float32))
