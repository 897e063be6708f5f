"""Format 2 reads: samples ``(user, position)`` cut out of per-user sequences at read time.

A split's samples are numbered user by user in storage order: user ``u``
contributes positions ``first[u] .. first[u] + count[u] - 1`` (training:
``[1, train_end)``, validation: ``[max(1, train_end), valid_end)``, evaluation (the test split):
``[max(1, valid_end), length)``; data without ``valid_end`` has no validation samples), so sample ids
are contiguous per user and per row group, and the planner sees the same
things as for format 1: ``lengths`` (each sample's history length: its position; the
planner clips it to ``max_seq_len``), ``rg_rows`` (samples per row group), ``num_rows``.
Opening reads only the ``length``, ``train_end`` and ``valid_end`` columns (12 bytes a user).

``read(samples)`` decodes each row group its samples live in once (checked on
the way in: ``row_checks.py``) into a slot of one buffer per column
(``user_slots.py``: an LRU over row groups), then, per sample, takes the
``max_seq_len`` interactions before its position as the history and the one
at its position as the candidate, label and dense features: one numpy gather
per column over those buffers for the whole read, whatever row groups it
draws from, no per-sample Python.  The result has the
columns and types of a format-1 table, so the loader turns it into a batch the
same way.  A bad user row (``on_bad_rows = "skip"``) drops all of its samples (``skipped``
counts users); a ``train_end`` outside ``[0, length]``, or a ``valid_end`` outside ``[train_end, length]``, is an
error at open in either mode.
"""

from __future__ import annotations

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from freescale.dataloader import row_checks as rc
from freescale.dataloader.gather import gather_tails
from freescale.dataloader.schema import (
    CANDIDATE_ITEM,
    CANDIDATE_TIMESTAMP,
    DENSE,
    HISTORY_ITEMS,
    HISTORY_TIMESTAMPS,
    ITEM_IDS,
    LABEL,
    LABELS,
    LENGTH,
    TIMESTAMPS,
    TRAIN_END,
    USER_ID,
    VALID_END,
    DataError,
    DatasetManifest,
    check_sequence_schema,
    sample_schema,
)
from freescale.dataloader.source import BadRows, RowGroupFiles, arrow_column, kept_per_run
from freescale.dataloader.user_slots import LoadedRowGroup, UserSlots

SPLITS = ("train", "valid", "eval")
"""Format 2's splits, each a range of positions of every user (the module docstring); ``eval`` is the test split."""


class SequenceSource(RowGroupFiles):
    def __init__(
        self, uri: str, split: str, columns: list[str], *, max_seq_len: int, on_bad_rows: BadRows = "error",
        cache_row_groups: int = 32, manifest: DatasetManifest | None = None,
    ) -> None:
        super().__init__(uri, split, on_bad_rows=on_bad_rows, manifest=manifest)
        if split not in SPLITS:
            raise DataError(f"{self.uri}: format 2 has the splits {', '.join(SPLITS)}, not '{split}'")
        self.columns = list(columns)
        self.max_seq_len = max_seq_len
        dense = [DENSE] if self.manifest.dense_dim else []
        self._lists = [ITEM_IDS, TIMESTAMPS, LABELS, *dense]
        self.decode_columns = [USER_ID, ITEM_IDS, TIMESTAMPS, LABELS, *dense, LENGTH]
        self.keep_columns = [USER_ID, ITEM_IDS, TIMESTAMPS, LABELS, *dense]
        length, train_end, valid_end = self._read_lengths()
        first, end = {"train": (np.ones_like(length), train_end), "valid": (np.maximum(train_end, 1), valid_end),
                      "eval": (np.maximum(valid_end, 1), length)}[split]
        self.first, self.count = first, np.maximum(end - first, 0)
        self.user_start = np.concatenate([[0], np.cumsum(self.count)]).astype(np.int64)
        self.num_rows = int(self.user_start[-1])
        self.rg_start = self.user_start[self.stored_start]
        self.rg_rows = np.diff(self.rg_start)
        owner = np.repeat(np.arange(self.count.size), self.count)
        self.lengths = (np.arange(self.num_rows, dtype=np.int64) - self.user_start[owner] + self.first[owner])
        per_group = np.diff(np.concatenate([[0], np.cumsum(length)])[self.stored_start])  # declared interactions
        self._slots = UserSlots(cache_row_groups, self.stored_rows.size, int(self.stored_rows.max(initial=1)),
                                int(per_group.max(initial=1)), self._lists, USER_ID)
        self._output_schema = sample_schema(self.manifest.dense_dim).append(pa.field(CANDIDATE_TIMESTAMP, pa.int64()))

    def check_schema(self, schema: pa.Schema, where: str) -> None:
        check_sequence_schema(schema, self.manifest.dense_dim, where)

    def _read_lengths(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each user's ``length``, ``train_end`` and ``valid_end`` (``train_end`` where the data has none)."""
        lengths, ends, valid_ends = [], [], []
        for fragment, shown in zip(self.fragments, self.file_names):
            has_valid = fragment.physical_schema.get_field_index(VALID_END) >= 0
            table = self._small_columns(fragment, shown, [LENGTH, TRAIN_END, *([VALID_END] if has_valid else [])])
            length = pc.fill_null(table.column(LENGTH), 0).to_numpy().astype(np.int64)
            end = pc.fill_null(table.column(TRAIN_END), 0).to_numpy().astype(np.int64)
            valid = pc.fill_null(table.column(VALID_END), 0).to_numpy().astype(np.int64) if has_valid else end
            for column, value, low in ((TRAIN_END, end, np.zeros_like(end)), (VALID_END, valid, end)):
                bad = (length < 0) | (value < low) | (value > length)
                if bad.any():
                    row = int(np.flatnonzero(bad)[0])
                    floor = f"{TRAIN_END}={low[row]}" if column == VALID_END else "0"
                    raise DataError(f"{shown}: row {row}: column '{column}': {value[row]} is outside "
                                    f"[{floor}, length={length[row]}]")
            lengths.append(length)
            ends.append(end)
            valid_ends.append(valid)
        if not lengths:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(lengths), np.concatenate(ends), np.concatenate(valid_ends)

    def row_problems(self, table: pa.Table) -> list[rc.Problem]:
        m = self.manifest
        lengths = rc.list_lengths(table.column(ITEM_IDS))
        lists = [ITEM_IDS, TIMESTAMPS, LABELS, *([DENSE] if m.dense_dim else [])]
        problems = rc.null_values(table)
        for name in lists:
            problems += rc.null_elements(table, name)
        problems += rc.ids_in_range(table, USER_ID, m.num_users, "num_users")
        problems += rc.ids_in_range(table, ITEM_IDS, m.num_items, "num_items")
        for name in lists[1:]:
            problems += rc.equal_lengths(table, name, lengths, ITEM_IDS)
        declared = pc.fill_null(table.column(LENGTH), 0).to_numpy().astype(np.int64)
        if (declared != lengths).any():
            problems.append(rc.Problem(LENGTH, f"differs from the length of {ITEM_IDS}", declared != lengths))
        problems += rc.decreasing(table, TIMESTAMPS)
        problems += rc.binary_labels(table, LABELS)
        if m.dense_dim:
            problems += rc.non_finite(table, DENSE)
        return problems

    def passes_checks(self, table: pa.Table) -> bool:
        """True when no row of ``table`` fails any of ``row_problems`` (``clean_arrays``' screen)."""
        return self.clean_arrays(table) is not None

    def clean_arrays(self, table: pa.Table) -> dict[str, np.ndarray] | None:
        """The row group's buffers (``arrays_of``) when no row of ``table`` fails any of ``row_problems``, decided
        on those buffers in one compiled pass (``row_checks.sequences_pass``) without building the checks' masks;
        None: not known (the checks decide)."""
        m = self.manifest
        columns = {name: rc.one_chunk(table.column(name)) for name in (USER_ID, *self._lists)}
        if not rc.without_nulls(table, self._lists, columns):
            return None
        if m.dense_dim and not (np.array_equal(rc.list_starts(columns[DENSE]), rc.list_starts(columns[ITEM_IDS]))
                                and rc.finite(rc.held(columns[DENSE]))):
            return None
        arrays = self._arrays(columns)
        offsets = (arrays[ITEM_IDS + "@"], arrays[LABELS + "@"], arrays[TIMESTAMPS + "@"])
        if not rc.sequences_pass(arrays[USER_ID], m.num_users, arrays[ITEM_IDS], m.num_items, arrays[LABELS],
                                 arrays[TIMESTAMPS], offsets, table.column(LENGTH).to_numpy()):
            return None
        return arrays

    def arrays_of(self, table: pa.Table) -> dict[str, np.ndarray]:
        """The row group's flat buffers, once: every read of it gathers from these.  Each list keeps
        its own offsets (``name@``): a bad row masked in ``skip`` mode may have lists of other
        lengths, and must not shift where the good rows after it are read."""
        return self._arrays({name: rc.one_chunk(table.column(name)) for name in (USER_ID, *self._lists)})

    def _arrays(self, columns: dict[str, pa.Array]) -> dict[str, np.ndarray]:
        """``arrays_of`` from its columns, each in one chunk."""
        arrays = {USER_ID: _values(columns[USER_ID])}
        for name in self._lists:
            column = columns[name]
            arrays[name + "@"] = column.offsets.to_numpy().astype(np.int64)
            if name == DENSE:
                arrays[name] = _values(column.values.values).reshape(-1, self.manifest.dense_dim)
            else:
                arrays[name] = _values(column.values)
        return arrays

    def read(self, samples: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        """The format-1 columns of ``samples`` (ids, any order) in ascending id order, and the ids
        actually returned (``skip`` mode drops the samples of bad users)."""
        arrays, kept = self.read_arrays(samples)
        if not kept.size:
            return self._output_schema.empty_table().select(self.columns), kept
        return pa.table({c: arrow_column(arrays, c, self._output_schema.field(c).type) for c in self.columns}), kept

    def read_arrays(self, samples: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """What ``read`` returns, as numpy (the loader's path; keys as ``ParquetSource.read_arrays``): the row
        groups the samples live in held in the slots (``user_slots``), then one gather per column for all of
        them (in parts of at most as many row groups as there are slots)."""
        with self._reading:  # (the slots are shared state: the prefetch thread and a caller's reads take turns)
            return self._read_sorted(np.sort(np.asarray(samples, dtype=np.int64)))

    def read_runs(self, runs: list[np.ndarray], uncut: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """``read_arrays`` of each of ``runs`` (several steps' samples) back to back, as ``RowGroupFiles.read_runs``:
        one gather per column for them all when their row groups fit in the slots together (consecutive steps
        share their shuffle window's row groups), else run by run.

        ``uncut``: the history items may be left where they are, in the slots (``HISTORY_ITEMS + "@src"``, the
        buffer, and ``"@end"``, where each sample's history ends in it, instead of ``HISTORY_ITEMS``), for the
        caller to copy once, straight into its batches (``assemble.py``): hold ``read_lock()`` from the read to
        that copy (a later read may load other row groups into those slots)."""
        sorted_runs = [np.sort(np.asarray(run, dtype=np.int64)) for run in runs]
        samples = np.concatenate(sorted_runs) if sorted_runs else np.zeros(0, dtype=np.int64)
        with self._reading:
            user, group, needed = self._located(samples)
            if needed.size > self._slots.count:
                return concatenated([self._read_sorted(run) for run in sorted_runs])
            arrays, kept, ok = self._read_held(samples, user, group, needed, uncut)
        return arrays, kept, kept_per_run(np.array([run.size for run in runs], dtype=np.int64), ok)

    def _located(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each sample's user and row group, and the distinct row groups (ascending)."""
        return _locate(samples, self.user_start, self.stored_start)

    def _read_sorted(self, samples: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        user, group, needed = self._located(samples)
        if needed.size <= self._slots.count:
            return self._read_held(samples, user, group, needed)[:2]
        parts = []
        for first in range(0, needed.size, self._slots.count):  # samples are sorted: each part's are one run
            block = needed[first:first + self._slots.count]
            a, b = int(np.searchsorted(group, block[0], "left")), int(np.searchsorted(group, block[-1], "right"))
            parts.append(self._read_held(samples[a:b], user[a:b], group[a:b], block)[:2])
        arrays, kept, _ = concatenated(parts)
        return arrays, kept

    def _read_held(self, samples: np.ndarray, user: np.ndarray, group: np.ndarray, needed: np.ndarray,
                   uncut: bool = False) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray | None]:
        """``samples`` (any order), their row groups ``needed`` at most as many as the slots: their columns, the
        samples kept (in the same order) and which were (None: all); ``uncut`` as in ``read_runs``."""
        slots = self._slots
        slot = slots.ensure(needed, self._load)[np.searchsorted(needed, group)]
        row = slot * slots.users + (user - self.stored_start[group])
        position = samples - self.user_start[user] + self.first[user]
        ok = None
        if self.on_bad_rows == "skip":
            ok = ~slots.bad[row]
            if ok.all():
                ok = None
            else:
                samples, row, position = samples[ok], row[ok], position[ok]
        if not samples.size:
            return {}, samples, ok
        return self._gather(row, position, uncut), samples, ok

    def holds(self, rg: int) -> bool:
        """Whether row group ``rg`` is in a slot (read without the read lock: may be stale)."""
        return bool(self._slots.slot_of[rg] >= 0)

    def forget_decoded(self) -> None:
        with self._reading:
            self._slots.forget()

    def _load(self, rg: int) -> LoadedRowGroup:
        entry = self._decode(rg)
        return entry.arrays, entry.bad

    def _gather(self, row: np.ndarray, position: np.ndarray, uncut: bool = False) -> dict[str, np.ndarray]:
        """Samples ``(row, position)`` (a user's row in the slots, a position in its sequence): in each list,
        the sample's own interaction (at its target) and its history (the ``max_seq_len`` before it,
        ``gather_tails``; ``uncut``: where it lies, as in ``read_runs``)."""
        slots = self._slots
        history = np.minimum(position, self.max_seq_len)
        target = {name: slots.starts[name][row] + position for name in self._lists}
        items = slots.flat(ITEM_IDS)
        out = {
            USER_ID: slots.user_ids[row], HISTORY_ITEMS + "@": history,
            CANDIDATE_ITEM: items[target[ITEM_IDS]], LABEL: slots.flat(LABELS)[target[LABELS]],
        }
        if uncut:
            out[HISTORY_ITEMS + "@src"], out[HISTORY_ITEMS + "@end"] = items, target[ITEM_IDS]
        else:
            out[HISTORY_ITEMS] = gather_tails([(items, target[ITEM_IDS], history)])
        if HISTORY_TIMESTAMPS in self.columns:
            out[HISTORY_TIMESTAMPS] = gather_tails([(slots.flat(TIMESTAMPS), target[TIMESTAMPS], history)])
            out[HISTORY_TIMESTAMPS + "@"] = history
        if CANDIDATE_TIMESTAMP in self.columns:
            out[CANDIDATE_TIMESTAMP] = slots.flat(TIMESTAMPS)[target[TIMESTAMPS]]
        if DENSE in self.columns:
            out[DENSE] = (slots.flat(DENSE)[target[DENSE]] if self.manifest.dense_dim
                          else np.zeros((history.size, 0), dtype=np.float32))
        return out


def concatenated(reads: list[tuple[dict[str, np.ndarray], np.ndarray]]) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Reads (``read_arrays``' answers) back to back, as ``read_runs`` answers."""
    sizes = np.array([kept.size for _, kept in reads], dtype=np.int64)
    kept = np.concatenate([kept for _, kept in reads]) if reads else np.zeros(0, dtype=np.int64)
    filled = [arrays for arrays, rows in reads if rows.size]
    if not filled:
        return {}, kept, sizes
    return {key: np.concatenate([arrays[key] for arrays in filled]) for key in filled[0]}, kept, sizes


_WALK = 8
"""Users ``_locate`` walks on before it searches instead."""


@numba.njit(nogil=True, cache=True)
def _locate(samples: np.ndarray, user_start: np.ndarray,
            stored_start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``SequenceSource._located``: a read's samples come in ascending runs (a step's), so each sample's user is
    the last one's or a few after it (a step's samples spread over its shuffle window's users): found by walking on
    from it, a binary search only at a run's start or past a few users; numpy searched twice per sample and sorted
    the row groups to find the distinct ones."""
    user, group = np.empty(samples.size, dtype=np.int64), np.empty(samples.size, dtype=np.int64)
    seen = np.zeros(stored_start.size, dtype=np.bool_)
    u, g = -1, -1
    for i in range(samples.size):
        sample = samples[i]
        if u < 0 or sample < user_start[u]:
            u = -1
        else:
            walked = 0
            while u >= 0 and sample >= user_start[u + 1]:
                u += 1
                walked += 1
                if walked == _WALK:
                    u = -1
        if u < 0:
            u = np.searchsorted(user_start, sample, side="right") - 1
            g = np.searchsorted(stored_start, u, side="right") - 1
        while u >= stored_start[g + 1]:
            g += 1
        user[i], group[i] = u, g
        seen[g] = True
    return user, group, np.flatnonzero(seen)


def warm_up() -> None:
    """Compile (or load from numba's cache) ``_locate`` before any prefetch thread."""
    starts = np.array([0, 2, 4], dtype=np.int64)
    _locate(np.array([0, 3], dtype=np.int64), starts, starts)


def _values(values: pa.Array) -> np.ndarray:
    """A list column's flat values as numpy; nulls (only in rows ``skip`` mode drops) as 0."""
    return (pc.fill_null(values, 0) if values.null_count else values).to_numpy()
