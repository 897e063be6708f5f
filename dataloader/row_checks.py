"""Vectorized per-row checks of decoded Arrow columns, shared by both dataset layouts.

Each check returns a boolean mask over the table's rows (``True`` = the row is
bad) and the value that makes the first bad row bad, so a reader can say
exactly what is wrong with it (``source.py`` for one row per sample,
``sequence_source.py`` for one row per user).  A list column's row is bad when
any of its elements is; nothing here loops over rows in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Problem:
    """Rows of one column that fail one check; ``reason`` describes the first of them."""

    column: str
    reason: str
    rows: np.ndarray  # bool per row


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Elements per row of a list column, int64 (0 for a null list)."""
    return pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _levels(column: pa.ChunkedArray | pa.Array) -> list[tuple[pa.Array, np.ndarray | int]]:
    """Each nesting level below the rows of a list column, outermost first, with how many elements
    each entry of the level above holds (an int for a fixed-size list: its width).  A fixed-size
    list's null entries keep their slots (``values``, not ``flatten``), so every level stays aligned."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    levels: list[tuple[pa.Array, np.ndarray | int]] = []
    while pa.types.is_fixed_size_list(array.type) or pa.types.is_list(array.type):
        if pa.types.is_fixed_size_list(array.type):
            width = array.type.list_size
            child, counts = array.values.slice(array.offset * width, len(array) * width), width
        else:
            child, counts = array.flatten(), list_lengths(array)
        levels.append((child, counts))
        array = child
    return levels


def _flat(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A list column's elements, nested lists flattened to scalars."""
    return _levels(column)[-1][0]


def _owner(column: pa.ChunkedArray | pa.Array, depth: int = -1) -> np.ndarray:
    """The row of each element of level ``depth`` (default: the scalars): computed only once a check
    has found a bad element."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    owner = np.arange(len(array))
    levels = _levels(array)
    for _, counts in levels[: len(levels) if depth == -1 else depth + 1]:
        owner = np.repeat(owner, counts)
    return owner


def _numpy(values: pa.Array, fill: float | int) -> np.ndarray:
    return (pc.fill_null(values, fill) if values.null_count else values).to_numpy(zero_copy_only=False)


def _rows_of(owner: np.ndarray, bad_values: np.ndarray, num_rows: int) -> np.ndarray:
    return np.bincount(owner[bad_values], minlength=num_rows) > 0


def null_values(table: pa.Table) -> list[Problem]:
    """Rows whose value is null, per column."""
    return [
        Problem(name, "null value", pc.is_null(table.column(name)).to_numpy(zero_copy_only=False))
        for name in table.column_names
        if table.column(name).null_count
    ]


def null_elements(table: pa.Table, name: str) -> list[Problem]:
    """Rows of list column ``name`` holding a null element at any nesting depth (a null inner list too)."""
    for depth, (level, _) in enumerate(_levels(table.column(name))):
        if not level.null_count:
            continue
        bad = pc.is_null(level).to_numpy(zero_copy_only=False)
        owner = _owner(table.column(name), depth)
        position = int(np.flatnonzero(bad)[0]) - int(np.flatnonzero(owner == owner[bad][0])[0])
        return [Problem(name, f"null element (at position {position} of the list)", _rows_of(owner, bad, table.num_rows))]
    return []


def non_finite(table: pa.Table, name: str) -> list[Problem]:
    """Rows of float column ``name`` (plain or list) holding NaN or +-inf."""
    column = table.column(name)
    nested = pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type)
    values = _flat(column) if nested else column.combine_chunks()
    data = _numpy(values, 0.0)
    bad = ~np.isfinite(data)
    if not bad.any():
        return []
    owner = _owner(column) if nested else np.arange(table.num_rows)
    return [Problem(name, f"is {float(data[bad][0])} (not finite)", _rows_of(owner, bad, table.num_rows))]


def decreasing(table: pa.Table, name: str) -> list[Problem]:
    """Rows of list column ``name`` whose elements are not in non-decreasing order."""
    column = table.column(name).combine_chunks()
    data = _numpy(_flat(column), 0)
    if data.size < 2:
        return []
    drop = np.diff(data) < 0
    starts = np.cumsum(list_lengths(column))[:-1]  # where each next row's elements begin
    drop[starts[(starts > 0) & (starts < data.size)] - 1] = False  # a drop across two rows is no problem
    if not drop.any():
        return []
    owner = _owner(column)
    i = int(np.flatnonzero(drop)[0])
    reason = f"timestamps go back in time ({int(data[i])} then {int(data[i + 1])}); they must be oldest first"
    return [Problem(name, reason, _rows_of(owner[1:], drop, table.num_rows))]


def ids_in_range(table: pa.Table, name: str, limit: int, vocab: str) -> list[Problem]:
    """Rows of id column ``name`` (plain or list) with an id < 0 or >= ``limit``."""
    column = table.column(name)
    nested = pa.types.is_list(column.type)
    ids = _numpy(_flat(column) if nested else column.combine_chunks(), 0)
    if ids.size == 0 or (ids.min() >= 0 and ids.max() < limit):
        return []
    owner = _owner(column) if nested else np.arange(table.num_rows)
    problems = []
    for bad, reason in (
        (ids < 0, lambda v: f"negative id {v}"),
        (ids >= limit, lambda v: f"id {v} is >= the table size {vocab}={limit} (dataset.json)"),
    ):
        if bad.any():
            problems.append(Problem(name, reason(int(ids[bad][0])), _rows_of(owner, bad, table.num_rows)))
    return problems


def binary_labels(table: pa.Table, name: str) -> list[Problem]:
    """Rows of label column ``name`` (plain or list) holding a value other than 0 or 1."""
    column = table.column(name)
    nested = pa.types.is_list(column.type)
    labels = _numpy(_flat(column) if nested else column.combine_chunks(), 0.0)
    bad = (labels != 0.0) & (labels != 1.0)
    if not bad.any():
        return []
    owner = _owner(column) if nested else np.arange(table.num_rows)
    return [Problem(name, f"is {float(labels[bad][0])}; labels must be 0 or 1", _rows_of(owner, bad, table.num_rows))]


def equal_lengths(table: pa.Table, name: str, expected: np.ndarray, against: str) -> list[Problem]:
    """Rows of list column ``name`` whose length differs from ``expected`` (named ``against``)."""
    bad = list_lengths(table.column(name)) != expected
    return [Problem(name, f"length differs from {against}", bad)] if bad.any() else []


# ----- the screen: whether a row group passes every check, without building the masks -----------------------
# A source's ``passes_checks`` runs these over a decoded row group's buffers (a dozen numpy calls where the masks
# take dozens of Arrow and numpy calls per column); only a row group that fails goes through the checks above,
# for its bad rows and messages.  Each answers True only where the corresponding check finds nothing.


def without_nulls(table: pa.Table, lists: list[str], combined: dict[str, pa.Array] | None = None) -> bool:
    """No null in any column nor among the values the rows of the list columns ``lists`` hold, at any nesting
    level (``combined``: those columns already in one chunk, ``one_chunk``, where the caller has them)."""
    if any(column.null_count for column in table.columns):
        return False
    return all(_nested_without_nulls(combined[name] if combined else one_chunk(table.column(name))) for name in lists)


def one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """``column`` as one array: its only chunk as it is when nothing in it is sliced (a decoded row group's:
    ``combine_chunks`` copies even a single chunk, ~1 ms for a row group of 8,192 histories), else the chunks
    combined (which starts every level at 0: the buffers' readers take a list's ``values`` whole)."""
    if column.num_chunks == 1 and _unsliced(column.chunk(0)):
        return column.chunk(0)
    return column.combine_chunks()


def _unsliced(array: pa.Array) -> bool:
    """Whether every level of ``array`` starts at its buffers' start and its lists' values are exactly the ones
    its rows hold."""
    while True:
        if array.offset:
            return False
        if pa.types.is_fixed_size_list(array.type):
            if len(array.values) != len(array) * array.type.list_size:
                return False
        elif pa.types.is_list(array.type):
            offsets = array.offsets
            if len(array) and (offsets[0].as_py() != 0 or offsets[len(array)].as_py() != len(array.values)):
                return False
        else:
            return True
        array = array.values


def _nested_without_nulls(array: pa.Array) -> bool:
    """No null among the values the rows of list column ``array`` hold, at any nesting level.  ``array`` is
    ``one_chunk``'s, unsliced: its ``values`` at every level are exactly the ones its rows hold, so each level's null
    count is read as it is (``flatten`` would build each level anew: ~3 us a step of format 2's reads)."""
    while pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type):
        array = array.values
        if array.null_count:
            return False
    return True


def held(array: pa.Array) -> np.ndarray:
    """The scalars the rows of list column ``array`` hold, nested lists flattened (after ``without_nulls``)."""
    while pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type):
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False)


def list_starts(array: pa.Array) -> np.ndarray:
    """Where each row of list column ``array`` starts in ``held(array)``, and its end (rows + 1 entries)."""
    offsets = array.offsets.to_numpy()
    return offsets - offsets[0]


def in_range(values: np.ndarray, limit: int) -> bool:
    return not values.size or bool(_in_range(values, limit))


def binary(values: np.ndarray) -> bool:
    return not values.size or bool(_binary(values))


def finite(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).all())


def ordered_within(values: np.ndarray, starts: np.ndarray) -> bool:
    """``values`` non-decreasing inside each list (``starts``: ``list_starts``); across two lists anything goes."""
    return values.size < 2 or bool(_ordered_within(values, starts.astype(np.int64, copy=False)))


# One compiled pass each, stopping at the first value that fails (numpy took two to four passes and as many calls
# for each; a row group's few thousand values made the calls most of the screen's time).
@numba.njit(nogil=True, cache=True)
def _in_range(values: np.ndarray, limit: int) -> bool:
    for v in values:
        if v < 0 or v >= limit:
            return False
    return True


@numba.njit(nogil=True, cache=True)
def _binary(values: np.ndarray) -> bool:
    for v in values:
        if v != 0.0 and v != 1.0:
            return False
    return True


@numba.njit(nogil=True, cache=True)
def _ordered_within(values: np.ndarray, starts: np.ndarray) -> bool:
    for row in range(starts.size - 1):
        for i in range(starts[row] + 1, starts[row + 1]):
            if values[i] < values[i - 1]:
                return False
    return True


def sequences_pass(user_ids: np.ndarray, num_users: int, items: np.ndarray, num_items: int, labels: np.ndarray,
                   timestamps: np.ndarray, offsets: tuple[np.ndarray, np.ndarray, np.ndarray], lengths: np.ndarray) -> bool:
    """Format 2's screen over one row group's buffers in one compiled pass: every user id in ``[0, num_users)``;
    the item, label and timestamp lists alike in length (``offsets``: each list's, into its own values) and equal
    to the declared ``lengths``; every item id in ``[0, num_items)``, every label 0 or 1, each user's timestamps
    non-decreasing (the values the rows hold, as ``held``)."""
    item_at, label_at, time_at = offsets
    if not (item_at.size == label_at.size == time_at.size == lengths.size + 1 == user_ids.size + 1):
        return False
    return bool(_sequences_pass(user_ids, num_users, items, num_items, labels, timestamps, item_at, label_at, time_at,
                                lengths))


@numba.njit(nogil=True, cache=True)
def _sequences_pass(user_ids: np.ndarray, num_users: int, items: np.ndarray, num_items: int, labels: np.ndarray,
                    timestamps: np.ndarray, item_at: np.ndarray, label_at: np.ndarray, time_at: np.ndarray,
                    lengths: np.ndarray) -> bool:
    for row in range(user_ids.size):
        if user_ids[row] < 0 or user_ids[row] >= num_users:
            return False
        size = item_at[row + 1] - item_at[row]
        if lengths[row] != size or label_at[row + 1] - label_at[row] != size or time_at[row + 1] - time_at[row] != size:
            return False
        for i in range(item_at[row], item_at[row + 1]):
            if items[i] < 0 or items[i] >= num_items:
                return False
        for i in range(label_at[row], label_at[row + 1]):
            if labels[i] != 0 and labels[i] != 1:
                return False
        for i in range(time_at[row] + 1, time_at[row + 1]):
            if timestamps[i] < timestamps[i - 1]:
                return False
    return True


def warm_up() -> None:
    """Compile (or load from numba's cache) the screen's passes for the dtypes ids, labels and timestamps come in,
    before any prefetch thread."""
    starts = np.array([0, 1], dtype=np.int64)
    for dtype in (np.int64, np.int32, np.float32, np.float64):
        for writeable in (True, False):  # (pyarrow's zero-copy arrays are read-only: another type to numba)
            values = np.zeros(2, dtype=dtype)
            values.flags.writeable = writeable
            _in_range(values, 1)
            _binary(values)
            _ordered_within(values, starts)
    # Format 2's pass, with the buffers as a row group of its schema gives them (values read-only, from Arrow).
    ids, labels, lengths = _read_only(np.zeros(1, np.int64)), _read_only(np.zeros(1, np.float32)), _read_only(
        np.ones(1, np.int32))
    _sequences_pass(ids, 1, ids, 1, labels, ids, starts, starts, starts, lengths)


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values
