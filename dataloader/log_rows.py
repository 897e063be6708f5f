"""One batch of an interaction log, normalized and checked (``freescale prepare``; ``log_input`` reads the
files and hands each batch here).  What each normalized column holds, and the one-line errors, are in
``log_input``'s docstring; ``prepare_spark`` applies the same functions on Spark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from freescale.dataloader.schema import DataError

TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
EARLIEST_S, LATEST_S = 0, 7_258_118_400
"""Plausible times, 1970-01-01 to 2200-01-01 UTC: a number outside them is almost always a time in another
unit (milliseconds read as seconds land near the year 55,000), so it is refused, not stored."""


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
    tie_break: str | None = None
    """A column that orders interactions at the same time (before the log's own order)."""

    def named(self) -> list[str]:
        """Every column read, once each (a tie-break column may also be another role's)."""
        names = [self.user, self.item, self.time, *([self.label] if self.label else []), *self.dense,
                 *([self.tie_break] if self.tie_break else [])]
        return list(dict.fromkeys(names))

    @property
    def label_rule(self) -> str:
        if self.label is None:
            return "implicit (every interaction a positive)"
        if self.rating_threshold is None:
            return f"{self.label} (0/1)"
        return f"{self.label} >= {self.rating_threshold:g}"


def normalized_schema(dense_dim: int, user_type: pa.DataType, item_type: pa.DataType,
                      tie_type: pa.DataType | None = None) -> pa.Schema:
    """The batches ``InteractionLog.batches`` yields."""
    return pa.schema(
        [("user", user_type), ("item", item_type), ("ts", pa.int64()), ("ts_fine", pa.int64()),
         ("label", pa.float32())]
        + [(f"d{i}", pa.float32()) for i in range(dense_dim)]
        + [("pos", pa.int64())] + ([("tie", tie_type)] if tie_type is not None else [])
    )


def schema_for(types: pa.Schema, cols: LogColumns) -> pa.Schema:
    """The normalized schema of a log whose named columns have ``types`` (checked by ``check_column_kind``):
    ids stay integers or become text; a tie-break column keeps its kind, widened."""
    def kind(name: str) -> str:
        return kind_of(types.field(types.get_field_index(name)).type)

    user_type, item_type = (pa.int64() if kind(c) == "integer" else pa.string() for c in (cols.user, cols.item))
    tie_type = None
    if cols.tie_break:
        tie_type = {"integer": pa.int64(), "boolean": pa.int64(), "float": pa.float64()}.get(kind(cols.tie_break),
                                                                                             pa.string())
    return normalized_schema(len(cols.dense), user_type, item_type, tie_type)


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
    elif name == cols.tie_break and name != cols.label and name not in cols.dense:
        if kind not in ("integer", "float", "boolean", "string"):
            raise DataError(f"{where}: column '{name}' has type {t}; a --tie-break column must hold numbers or text")
    elif kind not in ("integer", "float", "boolean"):
        what = "label" if name == cols.label else "dense feature"
        raise DataError(f"{where}: column '{name}' has type {t}; a {what} column must be numeric (non-numeric values)")


def _first_bad(mask: np.ndarray, column: pa.Array) -> tuple[int, str]:
    i = int(np.flatnonzero(mask)[0])
    value = column[i].as_py()
    return i, "null" if value is None else repr(value)


def row_name(i: int, lines: bool) -> str:
    """A row of a file as a user finds it: a CSV's line (the header is line 1), else its row counted from 0."""
    return f"line {i + 2}" if lines else f"row {i}"


def normalize_batch(batch: pa.RecordBatch, cols: LogColumns, schema: pa.Schema, shown: str, offset: int,
                    position: int = 0, lines: bool = False) -> pa.RecordBatch:
    """The batch in the normalized schema, or a DataError naming file, row and column (``offset``: the batch's
    first row within its file; ``position``: within the log, the row order ties in time keep; ``lines``: a CSV
    file's, named by line)."""

    def fail(name: str, mask: np.ndarray, column: pa.Array, what: str) -> DataError:
        i, value = _first_bad(mask, column)
        return DataError(f"{shown}: {row_name(offset + i, lines)}: column '{name}': {what} ({value})")

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
    out.append(pa.array(np.arange(position, position + batch.num_rows, dtype=np.int64)))
    if cols.tie_break:
        out.append(_tie(batch.column(cols.tie_break), schema.field("tie").type, cols.tie_break, fail))
    return pa.RecordBatch.from_arrays(out, schema=schema)


def _tie(column: pa.Array, target: pa.DataType, name: str, fail: Callable[..., DataError]) -> pa.Array:
    """The tie-break column in its normalized type; nulls are kept (they sort last), NaN is refused (the engines
    would agree where it sorts, a reader of the data might not)."""
    values = column.cast(target)
    if pa.types.is_floating(target):
        nan = pc.fill_null(pc.is_nan(values), False).to_numpy(zero_copy_only=False)
        if nan.any():
            raise fail(name, nan, column, "not a number (NaN) in the --tie-break column")
    return values


NS_PER = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
_INTEGER_TEXT = r"^\s*[-+]?\d+\s*$"
_NUMBER_TEXT = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$"


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
        column = _text_time(column, cols, fail)
        t = column.type
    if pa.types.is_timestamp(t):
        ns = pc.cast(column, pa.int64()).to_numpy(zero_copy_only=False) * NS_PER[t.unit]
        return pa.array(np.floor_divide(ns, NS_PER["s"])), pa.array(ns)
    return _numeric_seconds(column, cols, fail)


def _numeric_seconds(column: pa.Array, cols: LogColumns, fail: Callable[..., DataError]) -> tuple[pa.Array, pa.Array]:
    """Numbers in ``time_unit`` -> seconds and the fine time, refused outside 1970..2200 (``_plausible``)."""
    unit = TIME_UNITS[cols.time_unit]
    if pa.types.is_integer(column.type):
        raw = pc.cast(column, pa.int64()).to_numpy(zero_copy_only=False)
        seconds = np.floor_divide(raw, unit)
        _plausible(seconds, column, cols, fail)
        return pa.array(seconds), pa.array(raw)
    values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    if not np.isfinite(values).all():
        raise fail(cols.time, ~np.isfinite(values), column, "not a finite number")
    exact = values / unit
    _plausible(np.floor(exact), column, cols, fail)
    return pa.array(np.floor(exact).astype(np.int64)), pa.array(np.rint(exact * 1e9).astype(np.int64))


def _plausible(seconds: np.ndarray, column: pa.Array, cols: LogColumns, fail: Callable[..., DataError]) -> None:
    """Refuse a time before 1970 or after 2200 as seconds: a number in the wrong unit, almost always (an epoch
    in milliseconds read as seconds lands near the year 55,000); the hint names the unit that would fit."""
    bad = (seconds < EARLIEST_S) | (seconds >= LATEST_S)
    if not bad.any():
        return
    raw = float(column[int(np.flatnonzero(bad)[0])].as_py())
    scale = TIME_UNITS[cols.time_unit]
    fits = [u for u, n in TIME_UNITS.items() if n > scale and EARLIEST_S <= raw / n < LATEST_S]
    unit_name = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}[cols.time_unit]
    if raw < 0:
        raise fail(cols.time, bad, column, f"as {unit_name} this is before 1970; a time must fall in 1970..2200")
    hint = f"give --time-unit {fits[0]}" if fits else "and in --time-unit ms, us and ns too"
    raise fail(cols.time, bad, column, f"as {unit_name} this is after the year 2200; {hint}")


def _text_time(column: pa.Array, cols: LogColumns, fail: Callable[..., DataError]) -> pa.Array:
    """A text time column: numbers (a numeric column the CSV reader saw some text in) or dates and times.
    If the batch's first value is a number, the column is numbers, and the first one that is not is named."""
    if cols.time_format is None:
        numbers = pc.match_substring_regex(column, _NUMBER_TEXT).to_numpy(zero_copy_only=False)
        if numbers.all():
            integers = pc.all(pc.match_substring_regex(column, _INTEGER_TEXT)).as_py()
            return pc.cast(pc.utf8_trim_whitespace(column), pa.int64() if integers else pa.float64())
        if numbers[0]:
            raise fail(cols.time, ~numbers, column, "not a number, as the column's first values are")
    return _parse_text(column, cols, fail)


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
                continue  # not ISO 8601 of this kind (naive, then zoned): the formats below
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
