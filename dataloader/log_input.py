"""An interaction log as ``freescale prepare`` reads it: files, columns, checked batches.

A log is Parquet or CSV (``.csv``, ``.tsv``, optionally compressed), one file,
a directory (every such file under it) or a glob, on any pyarrow filesystem
(local, ``s3://``, ``gs://``, ``hdfs://``).  A CSV file's delimiter (tab, comma,
semicolon or pipe) is sniffed from its first lines unless the user names one,
since a file's suffix often says ``.csv`` of a tab-separated export.  The user
names the columns; this module checks each file's schema at open, then streams
the named columns one file at a time, normalized and checked batch by batch:

    user, item   the log's own ids (integers or strings), never null
    ts           int64 seconds (integers in ``time_unit``, timestamps, dates,
                 or strings parsed as ISO 8601 or with ``time_format``)
    ts_fine      the same time at its own resolution (nanoseconds, or the raw
                 integer): only to order a user's interactions within a second
    label        float32 0/1 (a 0/1 or boolean column, ``rating >= threshold``,
                 or 1 for every row of an implicit-feedback log)
    d0, d1, ...  float32 dense features of the interaction, finite
    pos          int64 the row's position in the log (files in order, then rows):
                 ties in time keep the log's own order, whatever the engine does
    tie          the ``--tie-break`` column (int64, float64 or string; nulls
                 allowed), only when one is named: the order within a time
                 before ``pos``

Every problem is one ``DataError`` line naming the file, the row within it and
the column.  The checks are vectorized pyarrow compute on batches of up to
``BATCH_ROWS`` rows, so they cost little next to the engine's own work.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from freescale.dataloader.log_rows import (
    TIME_UNITS,
    LogColumns,
    check_column_kind,
    kind_of,
    normalize_batch,
    row_name,
    schema_for,
)
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
DELIMITERS = ("\t", ",", ";", "|")
"""What a CSV file's delimiter is sniffed among, the first of equals winning."""
SNIFF_BYTES = 1 << 16


@dataclass
class _File:
    path: str
    shown: str
    fragment: ds.Fragment
    rows: int | None = None  # known up front for Parquet
    lines: bool = False
    """A CSV file: its rows are named by line (``log_rows.row_name``)."""


@dataclass
class InteractionLog:
    uri: str
    columns: LogColumns
    files: list[_File] = field(default_factory=list)
    format: str = "parquet"

    @classmethod
    def open(cls, uri: str, columns: LogColumns, fmt: str = "auto", delimiter: str | None = None) -> InteractionLog:
        """Find the log's files and check that each has the named columns with usable types
        (``delimiter``: a CSV log's, instead of sniffing each file's)."""
        if columns.time_unit not in TIME_UNITS:
            raise DataError(f"--time-unit must be one of {', '.join(TIME_UNITS)}, got {columns.time_unit!r}")
        fs, path = resolve(uri)
        paths = _discover(fs, path, uri)
        fmt = _format_of(paths, uri) if fmt == "auto" else fmt
        if fmt not in ("parquet", "csv"):
            raise DataError(f"--format must be parquet, csv or auto, got {fmt!r}")
        if delimiter is not None and fmt != "csv":
            raise DataError(f"{uri}: --delimiter is for CSV logs; this one is {fmt}")
        log = cls(uri=uri, columns=columns, format=fmt)
        shown_base = uri.rstrip("/")
        for p in paths:
            shown = p if p == path else f"{shown_base}/{p[len(path.rstrip('/')) + 1:]}" if p.startswith(path) else p
            numbers = [*columns.dense, *([columns.label] if columns.label else [])]
            log.files.append(_open_file(fs, p, shown, fmt, delimiter, numbers))
        log._drop_header_only()
        log._check_columns()
        return log

    def _drop_header_only(self) -> None:
        """A CSV file with a header and no row has no types to check (pyarrow says null): it adds nothing, so
        it is left out; a log of only such files has no rows, which is what the user is told."""
        if self.format != "csv":
            return
        kept = [f for f in self.files if not _header_only(f, self.columns)]
        if not kept:
            where = self.files[0].shown if len(self.files) == 1 else f"{self.uri} ({len(self.files)} files)"
            raise DataError(f"{where}: the log has no rows (only a header)")
        self.files = kept

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
                    raise DataError(f"{f.shown}: no column '{name}' (it has: {has}){_delimiter_hint(schema)}")
                if pa.types.is_null(schema.field(idx).type):
                    raise DataError(f"{f.shown}: {row_name(0, f.lines)}: column '{name}': empty, as in every row the "
                                    "reader looked at to tell the column's type")
                kind = kind_of(schema.field(idx).type)
                try:
                    check_column_kind(name, kind, schema.field(idx).type, self.columns, f.shown)
                except DataError:
                    if kind == "string" and (name == self.columns.label or name in self.columns.dense):
                        _name_the_text(f, name)
                    raise
                if name in first and first[name][0] != kind:
                    raise DataError(
                        f"{f.shown}: column '{name}' holds {kind} values, {first[name][1]} holds {first[name][0]}"
                    )
                first.setdefault(name, (kind, f.shown))

    def schema(self) -> pa.Schema:
        """The normalized schema of the batches (ids int64 or string, as the first file has them)."""
        return schema_for(self.files[0].fragment.physical_schema, self.columns)

    def batches(self, on_rows: Callable[[int], None] = lambda n: None) -> Iterator[pa.RecordBatch]:
        """Every row, normalized and checked, file by file (``on_rows`` after each batch); ``pos`` counts the
        rows of the whole log, so ties in time can keep the order the files are read in."""
        schema = self.schema()
        position = 0
        for f in self.files:
            done = 0
            try:
                scanner = f.fragment.to_batches(columns=self.columns.named(), batch_size=BATCH_ROWS,
                                                batch_readahead=READ_AHEAD_BATCHES, **_streaming(f.fragment))
                for batch in scanner:
                    if batch.num_rows:
                        yield normalize_batch(batch, self.columns, schema, f"{f.shown}", done, position + done,
                                              lines=f.lines)
                    done += batch.num_rows
                    on_rows(batch.num_rows)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
                raise _read_error(exc, f, done) from None
            position += done


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


def _open_file(fs: pafs.FileSystem, path: str, shown: str, fmt: str, delimiter: str | None = None,
               numbers: Sequence[str] = ()) -> _File:
    """One file of the log.  A CSV's label and dense columns (``numbers``) are read as float64 in every block:
    the reader would take their type from the first block, and refuse a half-star rating (``4.5``) far down a log
    whose first block held whole ones."""
    try:
        if fmt == "parquet":
            fragment = ds.ParquetFileFormat().make_fragment(path, filesystem=fs)
            fragment.ensure_complete_metadata()
            return _File(path, shown, fragment, rows=fragment.metadata.num_rows)
        sep = delimiter or sniff_delimiter(fs, path)
        numeric = pacsv.ConvertOptions(column_types={name: pa.float64() for name in numbers})
        csv_format = ds.CsvFileFormat(parse_options=pacsv.ParseOptions(delimiter=sep), convert_options=numeric)
        fragment = csv_format.make_fragment(path, filesystem=fs)
        try:
            fragment.physical_schema  # noqa: B018  infer the columns now (reads the first block)
        except pa.ArrowInvalid as exc:  # a word in a number column within the first block: named by its line
            names = ds.CsvFileFormat(parse_options=pacsv.ParseOptions(delimiter=sep)).make_fragment(
                path, filesystem=fs).physical_schema.names
            raise _conversion_error(str(exc), names, shown) or exc from None
        return _File(path, shown, fragment, lines=True)
    except (pa.ArrowInvalid, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Empty CSV file" in first_line:
            raise DataError(f"{shown}: the log has no rows (the file is empty)") from None
        raise DataError(f"{shown}: not a readable {fmt} file ({first_line})") from None


def sniff_delimiter(fs: pafs.FileSystem, path: str) -> str:
    """A CSV file's delimiter, from its header and the line after it: among ``DELIMITERS``, the one that splits
    the header into the most fields (more than one) and the next line into as many.  A file's suffix is no
    guide (tab-separated exports are often named .csv); with no such candidate, the suffix's default."""
    import csv
    import io

    default = "\t" if ".tsv" in path.lower() else ","
    with fs.open_input_stream(path, compression="detect") as stream:
        head = stream.read(SNIFF_BYTES)
    text = head.decode("utf-8", errors="replace")
    if len(head) == SNIFF_BYTES and "\n" in text:
        text = text[: text.rindex("\n") + 1]  # whole lines only: a cut one would count fewer fields
    best, best_fields = default, 1
    for sep in DELIMITERS:
        rows = [row for _, row in zip(range(2), csv.reader(io.StringIO(text), delimiter=sep)) if row]
        if rows and (len(rows) == 1 or len(rows[1]) == len(rows[0])) and len(rows[0]) > best_fields:
            best, best_fields = sep, len(rows[0])
    return best


def csv_delimiter(uri: str, delimiter: str | None = None) -> str:
    """The delimiter of a CSV log (its first file's, sniffed), for a reader that takes one for every file."""
    if delimiter is not None:
        return delimiter
    fs, path = resolve(uri)
    try:
        return sniff_delimiter(fs, _discover(fs, path, uri)[0])
    except OSError as exc:
        raise DataError(f"{uri}: cannot read it ({exc})") from None


def _delimiter_hint(schema: pa.Schema) -> str:
    """When a CSV file's one column name holds a delimiter, the file was split on another one: say so."""
    if len(schema.names) != 1:
        return ""
    inside = [sep for sep in DELIMITERS if sep in schema.names[0]]
    return f"; is the delimiter {inside[0]!r}? (--delimiter)" if inside else ""


def _header_only(f: _File, cols: LogColumns) -> bool:
    """True for a CSV file with a header and no row (its columns' types are null: there was nothing to infer)."""
    schema = f.fragment.physical_schema
    nulls = [n for n in cols.named() if n in schema.names and pa.types.is_null(schema.field(n).type)]
    return bool(nulls) and f.fragment.head(1, columns=nulls).num_rows == 0


_CSV_CONVERSION = re.compile(r"In CSV column #(\d+): Row #(\d+): CSV conversion error to (\w+): invalid value (.*)")


def _read_error(exc: BaseException, f: _File, done: int) -> DataError:
    """A read failure as one line.  A CSV value that does not fit the type the reader inferred from the file's
    first block (a text value in a numeric column, far down) names its row and column: pyarrow's message
    counts lines from 1 with the header, our rows from 0 without."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    named = _conversion_error(first_line, f.fragment.physical_schema.names, f.shown)
    return named or DataError(f"{f.shown}: cannot read it from {row_name(done, f.lines)} on ({first_line})")


def _conversion_error(message: str, names: list[str], shown: str) -> DataError | None:
    """pyarrow's message on a CSV value its column's type refuses, as one line naming the line and column (pyarrow
    counts lines from 1 with the header, our rows from 0 without); None for any other message."""
    found = _CSV_CONVERSION.search(message)
    if found is None:
        return None
    column, line, kind, value = int(found.group(1)), int(found.group(2)), found.group(3), found.group(4)
    name = names[column] if column < len(names) else f"#{column}"
    if kind == "double":  # a label or dense column (read as numbers throughout), or a time inferred as one
        return DataError(f"{shown}: {row_name(line - 2, True)}: column '{name}': not a number ({value})")
    return DataError(f"{shown}: {row_name(line - 2, True)}: column '{name}': not {kind} like the rows before it "
                     f"({value})")


_NUMBER = r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$"
"""What reads as a number (no padding: a value padded with spaces is what made the reader take the column as text)."""


def _name_the_text(f: _File, name: str) -> None:
    """A label or dense column read as text: the first value that is not a number (an empty one included: it is
    missing), named by its row (a CSV's line), as a DataError; nothing when every value reads as one or the file
    cannot be read again (the caller's message on the type stands)."""
    done = 0
    try:
        for batch in f.fragment.to_batches(columns=[name], batch_size=BATCH_ROWS):
            column = batch.column(0)
            text = ~pc.fill_null(pc.match_substring_regex(column, _NUMBER), True).to_numpy(zero_copy_only=False)
            if text.any():
                i = int(np.flatnonzero(text)[0])
                break
            done += batch.num_rows
        else:
            return
    except (pa.ArrowInvalid, OSError):
        return
    raise DataError(f"{f.shown}: {row_name(done + i, f.lines)}: column '{name}': not a number ({column[i].as_py()!r})")

