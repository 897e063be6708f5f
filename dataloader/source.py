"""Row-group-granular Parquet access for the balanced loader.

``ParquetSource`` opens one split of a dataset directory on any pyarrow
filesystem (a local path, or ``s3://``, ``gs://``, ``hdfs://`` URIs where the
user has them) and offers two things:

- ``lengths``: the history length of every row of the split, read at open from
  the small ``history_length`` column (or, for datasets without it, from the
  list column's offsets).  This is all the planner needs: 4 bytes per row.
- ``read(rows)``: the projected columns of the given global rows, decoded one
  row group at a time.  Decoded, validated row groups stay in a small LRU cache:
  consecutive steps draw their rows from the same shuffle window of row groups,
  so each row group is decoded about once per epoch per rank.

Rows are checked when their row group is first decoded, against the manifest's
table sizes (``row_checks.py``): nulls (also inside lists), ids out of range,
empty histories, list lengths that disagree, timestamps that go back in time,
labels that are not 0/1, dense features that are NaN or infinite.  ``on_bad_rows="error"`` raises a
``DataError`` naming file, row group, row and column; ``"skip"`` drops such rows
from every batch and counts them per reason (``skipped``).  Nothing is clamped.

Cost of the "no sample crosses the network" design: every rank decodes the row
groups its rows live in, and with a global shuffle that is most row groups of the
shuffle window, so decoding (not network) grows with the number of ranks.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from freescale.dataloader import row_checks as rc
from freescale.dataloader.read_ahead import ReadAhead
from freescale.dataloader.row_checks import list_lengths
from freescale.dataloader.row_gather import gather_rows
from freescale.dataloader.schema import (
    CANDIDATE_ITEM,
    DENSE,
    HISTORY_ITEMS,
    HISTORY_LENGTH,
    HISTORY_TIMESTAMPS,
    LABEL,
    USER_ID,
    DataError,
    DatasetManifest,
    check_schema,
)

BadRows = Literal["error", "skip"]
_OPEN_FILES = 16
"""Parquet files a source keeps open for row-group reads (past this the least recently read is let go: it closes
once no read holds it)."""


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for a local path or a URI."""
    if "://" in uri:
        try:
            return pafs.FileSystem.from_uri(uri)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
            raise DataError(f"{uri}: cannot open this filesystem URI ({exc})") from None
    return pafs.LocalFileSystem(), uri


@dataclass
class _RowGroup:
    arrays: dict[str, np.ndarray]  # the kept columns' numpy buffers (``RowGroupFiles.arrays_of``)
    bad: np.ndarray | None  # bool per row when on_bad_rows == "skip"


class RowGroupFiles(ABC):
    """One split's Parquet files, row group by row group: what both layouts' sources share.

    Opens the manifest and every file of the split (``check_schema(schema, where)`` per file),
    numbers the row groups globally (``rg_file``, ``rg_id``; ``stored_rows``/``stored_start``: the
    Parquet rows of each, which are samples in format 1 and users in format 2), and
    decodes a row group (``_decode``) through its file held open, checked by ``row_problems(table)`` on
    the way in (error: raise; skip: a bad-row mask, counted); each layout keeps the decoded row groups
    its own way (format 1: a small LRU cache; format 2: ``user_slots``).
    """

    def __init__(self, uri: str, split: str, *, on_bad_rows: BadRows, manifest: DatasetManifest | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.fs, base = resolve(self.uri)
        self.manifest = manifest if manifest is not None else DatasetManifest.read_from(self.fs, base, self.uri)
        self.on_bad_rows = on_bad_rows
        names = self.manifest.split_files(split, self.uri)
        self.file_names = [f"{self.uri}/{name}" for name in names]
        self.fragments: list[ds.ParquetFileFragment] = []
        rg_file, rg_id, stored = [], [], []
        for file_index, (name, shown) in enumerate(zip(names, self.file_names)):
            path = f"{base}/{name}"
            try:
                if self.fs.get_file_info(path).type != pafs.FileType.File:
                    raise DataError(f"{shown}: listed in dataset.json split '{split}' but missing")
                fragment = ds.ParquetFileFormat().make_fragment(path, filesystem=self.fs)
                fragment.ensure_complete_metadata()
                schema = fragment.physical_schema
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"{shown}: not a readable Parquet file ({exc})") from None
            self.check_schema(schema, shown)
            self.fragments.append(fragment)
            for rg in fragment.row_groups:
                rg_file.append(file_index)
                rg_id.append(rg.id)
                stored.append(rg.num_rows)
        self.rg_file = np.array(rg_file, dtype=np.int64)
        self.rg_id = np.array(rg_id, dtype=np.int64)
        self.stored_rows = np.array(stored, dtype=np.int64)
        self.stored_start = np.concatenate([[0], np.cumsum(self.stored_rows)]).astype(np.int64)
        self.skipped: Counter[str] = Counter()
        self.decoded_bytes = 0
        """Arrow bytes of every row group decoded so far (cache misses only): the read's real cost (the size of the
        buffers a decode made, ``get_total_buffer_size``)."""
        self._readers: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._ahead: ReadAhead[pa.Table] | None = None
        self._ahead_readers: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        """The files the read-ahead's thread reads through (its own: a ``ParquetFile`` is not shared by threads)."""
        self._reading = threading.RLock()
        """Held by a read (and by ``close``): the decoded row groups (a cache, or format 2's slots) and the open
        files are shared state, and the prefetch thread's reads may meet a caller's (``BalancedLoader.batch_of``).
        Re-entrant: a caller holds it across a read whose answer points into those buffers (``read_lock``)."""

    @abstractmethod
    def check_schema(self, schema: pa.Schema, where: str) -> None:
        """Raise DataError naming ``where`` and the column if a file's schema is not this layout's."""

    @abstractmethod
    def row_problems(self, table: pa.Table) -> list[rc.Problem]:
        """Every check of a decoded row group, in reporting order."""

    @abstractmethod
    def arrays_of(self, table: pa.Table) -> dict[str, np.ndarray]:
        """The numpy buffers a source reads from, kept with the decoded row group (not the table)."""

    @abstractmethod
    def read_arrays(self, rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Rows (global ids, any order) as numpy, ascending: per column its values, a list column ``name``'s
        lengths as ``name@``; and the rows returned (``skip`` mode drops bad ones)."""

    @abstractmethod
    def read_runs(self, runs: list[np.ndarray], uncut: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``read_arrays`` of each of ``runs`` (several steps' rows), back to back: the columns, the rows kept
        and how many of them each run kept.  ``uncut``: the history items may be left where they lie (``HISTORY_ITEMS
        + "@src"``: one buffer, or an object array of them, one per piece of the samples from ``"@from"`` on;
        ``"@end"``: where each sample's history ends in its buffer), for the caller to copy once, straight into its
        batches, holding ``read_lock()`` until then."""

    def read_lock(self) -> threading.RLock:
        """The lock every read holds: held across an ``uncut`` read and the use of its answer, no other read (a
        caller's ``read_arrays`` on another thread) replaces the buffers that answer points into meanwhile."""
        return self._reading

    def read_column_per_file(self, columns: list[str]) -> list[pa.Table]:
        """Small columns of every file (lengths for the planner), each file's in one table."""
        return [self._small_columns(fragment, shown, columns) for fragment, shown in zip(self.fragments, self.file_names)]

    @staticmethod
    def _small_columns(fragment: ds.ParquetFileFragment, shown: str, columns: list[str]) -> pa.Table:
        try:
            return fragment.to_table(columns=columns)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{shown}: corrupt or truncated Parquet data ({exc})") from None

    rg_start: np.ndarray
    """Each row group's first sample id, and the number of samples at the end."""
    decode_columns: list[str]
    """What a row group's decode reads (the subclass's columns and what its checks need)."""
    keep_columns: list[str]
    """What the cache keeps of it."""

    def _decode(self, rg: int) -> _RowGroup:
        """Row group ``rg`` (global index), decoded (or taken from the read-ahead, which decodes it to Arrow on its
        thread) and checked here (``decoded_bytes`` and ``skipped`` count it).  Called within a read (``_reading``
        held)."""
        table = self._ahead.take(rg) if self._ahead is not None else None
        if table is None:
            table = self.read_table(rg, self._readers)
        self.decoded_bytes += table.get_total_buffer_size()  # (``nbytes`` walks the buffers: 13 against 0.4 us)
        arrays = self.clean_arrays(table)
        if arrays is not None:
            return _RowGroup(arrays=arrays, bad=None)
        bad = self._validate(table, f"{self.file_names[int(self.rg_file[rg])]}: row group {int(self.rg_id[rg])}")
        return _RowGroup(arrays=self.arrays_of(table.select(self.keep_columns)), bad=bad)

    def read_table(self, rg: int, readers: OrderedDict[int, pq.ParquetFile]) -> pa.Table:
        """Row group ``rg``'s columns read through ``readers`` (the caller's open files) and decoded to Arrow, in one
        call that releases the GIL, changing nothing of the source: the read-ahead's thread calls it with files of
        its own."""
        file_index, rg_id = int(self.rg_file[rg]), int(self.rg_id[rg])
        try:
            return self._open(readers, file_index).read_row_group(rg_id, columns=self.decode_columns, use_threads=False)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{self.file_names[file_index]}: row group {rg_id}: corrupt or truncated Parquet data "
                            f"({exc})") from None

    def read_ahead(self, step_rows: int, depth: int) -> ReadAhead[pa.Table]:
        """A ``ReadAhead`` that reads and decodes this source's row groups to Arrow on a thread of its own, its reads
        taking them from it (``step_rows``: rows a step plans; ``depth``: row groups waiting at most); ``close`` stops
        it (a second call replaces the first)."""
        if self._ahead is not None:
            self._ahead.close()
        readers = self._ahead_readers
        self._ahead = ReadAhead(lambda rg: self.read_table(rg, readers), self.rg_start, step_rows, depth,
                                self.holds)
        return self._ahead

    @abstractmethod
    def holds(self, rg: int) -> bool:
        """Whether row group ``rg`` is held decoded (read without the read lock: an answer may be stale)."""

    @abstractmethod
    def forget_decoded(self) -> None:
        """Hold no decoded row group any more: the next reads decode them again (format 2 keeps its slots' buffers;
        called after ``close``, the read-ahead decodes them again too, else the reads do)."""

    def close(self) -> None:
        """Let go of the files held open and stop the read-ahead (a later read opens them again)."""
        if self._ahead is not None:
            self._ahead.close()  # (its thread joined: its files are let go of too)
            self._ahead_readers.clear()
        with self._reading:
            self._readers.clear()

    def _open(self, readers: OrderedDict[int, pq.ParquetFile], file_index: int) -> pq.ParquetFile:
        """File ``file_index`` held open in ``readers`` (its footer as read at open), the ``_OPEN_FILES`` most
        recently used.

        A row group read this way costs about a third of the dataset scanner's (``fragment.to_table``: its
        scan machinery per call, ~0.5 ms, dominates a row group of a few thousand interactions), single
        threaded (a row group's few columns leave a second thread nothing to do but hand-offs)."""
        reader = readers.get(file_index)
        if reader is not None:
            readers.move_to_end(file_index)
            return reader
        fragment = self.fragments[file_index]
        reader = pq.ParquetFile(self.fs.open_input_file(fragment.path), metadata=fragment.metadata)
        readers[file_index] = reader
        if len(readers) > _OPEN_FILES:
            readers.popitem(last=False)  # (the file closes with its last reference)
        return reader

    def passes_checks(self, table: pa.Table) -> bool:
        """True when ``row_problems(table)`` is certainly empty, decided cheaper than it (False: not known)."""
        return False

    def clean_arrays(self, table: pa.Table) -> dict[str, np.ndarray] | None:
        """The kept columns' buffers (``arrays_of``) when ``passes_checks(table)``, else None (the checks decide)."""
        return self.arrays_of(table.select(self.keep_columns)) if self.passes_checks(table) else None

    def _validate(self, table: pa.Table, where: str) -> np.ndarray | None:
        """Per-row problems; raise on the first (error mode) or return the bad-row mask (skip; None: none bad)."""
        bad_any = np.zeros(table.num_rows, dtype=bool)
        for problem in self.row_problems(table):
            if not problem.rows.any():
                continue
            if self.on_bad_rows == "error":
                row = int(np.flatnonzero(problem.rows)[0])
                raise DataError(f"{where}: row {row}: column '{problem.column}': {problem.reason}")
            self.skipped[f"{problem.column}: {problem.reason.split(' (')[0]}"] += int((problem.rows & ~bad_any).sum())
            bad_any |= problem.rows
        return bad_any if self.on_bad_rows == "skip" else None


class ParquetSource(RowGroupFiles):
    """Format 1: one row per sample; a sample id is a global row id.

    What the planner and loader use of a source (``SequenceSource`` offers the same):
    ``num_rows`` (samples), ``lengths`` (history length per sample), ``rg_rows`` and
    ``rg_start`` (samples per row group: the shuffle's unit of locality), ``read(samples)``,
    ``skipped``, ``manifest``, ``uri``.
    """

    def __init__(
        self, uri: str, split: str, columns: list[str], *, on_bad_rows: BadRows = "error", cache_row_groups: int = 32,
        max_seq_len: int | None = None, manifest: DatasetManifest | None = None,
    ) -> None:
        super().__init__(uri, split, on_bad_rows=on_bad_rows, manifest=manifest)
        self._cache: OrderedDict[int, _RowGroup] = OrderedDict()
        self._cache_size = max(1, cache_row_groups)
        self.columns = self.keep_columns = list(columns)
        self.max_seq_len = max_seq_len
        """Values kept of each list column, the most recent (None: all)."""
        self.has_length_column = all(f.physical_schema.get_field_index(HISTORY_LENGTH) >= 0 for f in self.fragments)
        self.decode_columns = sorted(set(columns) | _CHECK_COLUMNS | ({HISTORY_LENGTH} if self.has_length_column else set()))
        self.rg_rows, self.rg_start = self.stored_rows, self.stored_start
        self.num_rows = int(self.rg_start[-1])
        self.lengths = self._read_lengths()

    def check_schema(self, schema: pa.Schema, where: str) -> None:
        check_schema(schema, self.manifest.dense_dim, where)

    def row_problems(self, table: pa.Table) -> list[rc.Problem]:
        return _row_checks(table, self.manifest)

    def passes_checks(self, table: pa.Table) -> bool:
        """True when no row of ``table`` fails any of ``row_problems``, decided on the flat buffers without
        building their masks (``row_checks``' screen)."""
        if not rc.without_nulls(table, [HISTORY_ITEMS, HISTORY_TIMESTAMPS, DENSE]):
            return False
        m = self.manifest
        history, times = rc.one_chunk(table.column(HISTORY_ITEMS)), rc.one_chunk(table.column(HISTORY_TIMESTAMPS))
        starts = rc.list_starts(history)
        lengths = np.diff(starts)
        if not lengths.all() or not np.array_equal(rc.list_starts(times), starts):  # (an empty history is bad)
            return False
        if HISTORY_LENGTH in table.column_names and not np.array_equal(table.column(HISTORY_LENGTH).to_numpy(), lengths):
            return False
        return (rc.in_range(rc.held(history), m.num_items) and rc.in_range(table.column(CANDIDATE_ITEM).to_numpy(), m.num_items)
                and rc.in_range(table.column(USER_ID).to_numpy(), m.num_users) and rc.ordered_within(rc.held(times), starts)
                and rc.binary(table.column(LABEL).to_numpy()) and rc.finite(rc.held(rc.one_chunk(table.column(DENSE)))))

    def holds(self, rg: int) -> bool:
        """Whether row group ``rg`` is in the cache (read without the read lock: may be stale)."""
        return rg in self._cache

    def forget_decoded(self) -> None:
        with self._reading:
            self._cache.clear()

    # ----- lengths (for planning) ---------------------------------------------------------
    def _read_lengths(self) -> np.ndarray:
        """int64 per row; -1 where the history is null (planned at cost 0, rejected on read)."""
        column = HISTORY_LENGTH if self.has_length_column else HISTORY_ITEMS
        parts = []
        for table in self.read_column_per_file([column]):
            values = table.column(column)
            lengths = pc.fill_null(values if self.has_length_column else pc.list_value_length(values), -1)
            parts.append(lengths.to_numpy().astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    # ----- rows ---------------------------------------------------------------------------------
    def arrays_of(self, table: pa.Table) -> dict[str, np.ndarray]:
        """Each kept column's flat numpy buffer (lists: ``name`` values and ``name@`` offsets)."""
        arrays: dict[str, np.ndarray] = {}
        for name in self.columns:
            column = rc.one_chunk(table.column(name))
            if pa.types.is_list(column.type):
                arrays[name + "@"] = column.offsets.to_numpy().astype(np.int64)
                arrays[name] = _flat_values(column.values)
            elif pa.types.is_fixed_size_list(column.type):
                arrays[name] = _flat_values(column.values).reshape(len(column), column.type.list_size)
            else:
                arrays[name] = _flat_values(column)
        return arrays

    def _row_group(self, rg: int) -> _RowGroup:
        """Row group ``rg`` (global index), decoded, checked and cached (an LRU of ``cache_row_groups``)."""
        entry = self._cache.get(rg)
        if entry is not None:
            self._cache.move_to_end(rg)
            return entry
        entry = self._decode(rg)
        self._cache[rg] = entry
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def read(self, rows: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        """The projected columns of ``rows`` (global row ids, any order) in ascending row
        order, and the row ids actually returned (in ``skip`` mode bad rows are dropped)."""
        arrays, kept = self.read_arrays(rows)
        return (self._table(arrays) if kept.size else self._empty()), kept

    def read_arrays(self, rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """What ``read`` returns, as numpy (the loader's path: no Arrow table in between): per
        column its values (a fixed-size list as a 2-D array), and for a list column ``name@``
        its lengths, each list cut to its ``max_seq_len`` most recent values when the source has
        one.  Gathered from each row group's cached buffers."""
        with self._reading:
            return self._read_sorted(np.sort(np.asarray(rows, dtype=np.int64)))

    def read_runs(self, runs: list[np.ndarray], uncut: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``read_arrays`` of each of ``runs`` (several steps' rows) back to back, in one gather per column for them
        all (``row_gather.py``).  ``uncut``: the history items are left in their row groups' buffers (``HISTORY_ITEMS
        + "@src"``, one buffer per piece of rows of one row group, ``"@from"`` the first sample of each piece and
        ``"@end"`` where each sample's history ends in its piece's buffer, instead of ``HISTORY_ITEMS``), for the
        caller to copy once, straight into its batches (``assemble.py``)."""
        sorted_runs = [np.sort(np.asarray(run, dtype=np.int64)) for run in runs]
        rows = np.concatenate(sorted_runs) if sorted_runs else np.zeros(0, dtype=np.int64)
        with self._reading:
            arrays, ok = self._gather_rows(rows, uncut)
        sizes = np.array([run.size for run in sorted_runs], dtype=np.int64)
        return arrays, rows if ok is None else rows[ok], kept_per_run(sizes, ok)

    def _read_sorted(self, rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        arrays, ok = self._gather_rows(rows)
        return arrays, rows if ok is None else rows[ok]

    def _gather_rows(self, rows: np.ndarray, uncut: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """``row_gather.gather_rows`` of ``rows`` from this source's cached row groups."""
        cap = self.max_seq_len if self.max_seq_len is not None else np.iinfo(np.int64).max
        return gather_rows(rows, self.rg_start, self._row_group, self.columns, cap, HISTORY_ITEMS if uncut else "")

    def _table(self, arrays: dict[str, np.ndarray]) -> pa.Table:
        schema = self.fragments[0].physical_schema
        return pa.table({name: arrow_column(arrays, name, schema.field(name).type) for name in self.columns})

    def _empty(self) -> pa.Table:
        schema = self.fragments[0].physical_schema
        return pa.table({c: pa.array([], type=schema.field(c).type) for c in self.columns})


def kept_per_run(sizes: np.ndarray, ok: np.ndarray | None) -> np.ndarray:
    """Samples each run of a read kept: runs of ``sizes`` back to back, ``ok`` which samples were (None: all)."""
    if ok is None:
        return sizes
    return np.bincount(np.repeat(np.arange(sizes.size), sizes)[ok], minlength=sizes.size).astype(np.int64)


def _flat_values(values: pa.Array) -> np.ndarray:
    """Numpy of a flat Arrow array; nulls (only in rows ``skip`` mode drops) as 0."""
    return (pc.fill_null(values, 0) if values.null_count else values).to_numpy(zero_copy_only=False)


def arrow_column(arrays: dict[str, np.ndarray], name: str, kind: pa.DataType) -> pa.Array:
    """Column ``name`` of a read's arrays as Arrow of type ``kind``."""
    if pa.types.is_list(kind):
        offsets = pa.array(np.concatenate([[0], np.cumsum(arrays[name + "@"])]).astype(np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(arrays[name], kind.value_type))
    if pa.types.is_fixed_size_list(kind):
        if kind.list_size == 0:
            return pa.array([[]] * len(arrays[name]), kind)
        return pa.FixedSizeListArray.from_arrays(pa.array(arrays[name].ravel(), kind.value_type), kind.list_size)
    return pa.array(arrays[name], kind)


_CHECK_COLUMNS = {USER_ID, HISTORY_ITEMS, HISTORY_TIMESTAMPS, CANDIDATE_ITEM, DENSE, LABEL}


def _row_checks(table: pa.Table, manifest: DatasetManifest) -> list[rc.Problem]:
    """Every check of a format-1 row group, in reporting order."""
    history = table.column(HISTORY_ITEMS)
    lengths = list_lengths(history)
    problems = rc.null_values(table)
    for name in (HISTORY_ITEMS, HISTORY_TIMESTAMPS, DENSE):
        problems += rc.null_elements(table, name)
    empty = (lengths == 0) & history.is_valid().to_numpy(zero_copy_only=False)
    problems += [rc.Problem(HISTORY_ITEMS, "empty history", empty)] if empty.any() else []
    problems += rc.ids_in_range(table, HISTORY_ITEMS, manifest.num_items, "num_items")
    problems += rc.ids_in_range(table, CANDIDATE_ITEM, manifest.num_items, "num_items")
    problems += rc.ids_in_range(table, USER_ID, manifest.num_users, "num_users")
    problems += rc.equal_lengths(table, HISTORY_TIMESTAMPS, lengths, HISTORY_ITEMS)
    problems += rc.decreasing(table, HISTORY_TIMESTAMPS)
    if HISTORY_LENGTH in table.column_names:
        declared = pc.fill_null(table.column(HISTORY_LENGTH), 0).to_numpy()
        if (declared != lengths).any():
            problems.append(rc.Problem(HISTORY_LENGTH, f"differs from the length of {HISTORY_ITEMS}", declared != lengths))
    problems += rc.binary_labels(table, LABEL)
    problems += rc.non_finite(table, DENSE)
    return problems
