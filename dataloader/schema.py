"""The two dataset layouts (Arrow schemas) and the dataset manifest.

A dataset is a directory::

    dataset.json             manifest: vocabulary sizes, dense width, files per split, format_version
    train-00000.parquet      format 1: one row per sample (``freescale gen-data``)
    eval-00000.parquet
    users-00000.parquet      format 2: one row per user, the whole time-ordered sequence
    vocab/item_id.parquet    format 2: dense id -> the log's own id, with counts (``freescale prepare``)
    vocab/user_id.parquet

**Format 1** (per sample).  One row is one (user history, candidate item) pair:

| column               | Arrow type                | meaning                                      |
|----------------------|---------------------------|----------------------------------------------|
| user_id              | int64                     | in [0, num_users)                            |
| history_item_ids     | list<int64>               | past items, oldest first, in [0, num_items)  |
| history_timestamps   | list<int64>               | seconds, same length as history_item_ids     |
| candidate_item_id    | int64                     | the item to score, in [0, num_items)         |
| dense_features       | fixed_size_list<float32>  | ``dense_dim`` floats                         |
| label                | float32                   | 0 or 1 (click)                               |
| history_length       | int32 (optional)          | len(history_item_ids); lets the planner read |
|                      |                           | 4 bytes per row instead of the whole list    |

Other columns are ignored.  ``freescale gen-data`` writes all of the above.

**Format 2** (per user, ``freescale prepare``).  One row is one user's whole
interaction sequence, oldest first, and every split's samples are cut out of it
at read time (``sequence_source.py``): the sample ``(user, p)`` has the
interaction at position ``p`` as its candidate and label, and positions
``p - max_seq_len .. p - 1`` as its history.  A user with N interactions costs
O(N) bytes instead of the O(N x L) of format 1.

| column          | Arrow type                             | meaning                                   |
|-----------------|----------------------------------------|-------------------------------------------|
| user_id         | int64                                  | in [0, num_users)                         |
| item_ids        | list<int64>                            | in [0, num_items), oldest first           |
| timestamps      | list<int64>                            | seconds, non-decreasing                   |
| labels          | list<float32>                          | 0 or 1 per interaction                    |
| dense_features  | list<fixed_size_list<float32>>         | ``dense_dim`` floats per interaction      |
|                 | (only when dense_dim > 0)              | (context of the interaction)              |
| length          | int32                                  | interactions of the user                  |
| train_end       | int32                                  | positions [1, train_end) are training     |
|                 |                                        | samples                                   |
| valid_end       | int32                                  | [max(1, train_end), valid_end) validation,|
|                 | (absent in older data: = train_end)    | [max(1, valid_end), length) test (eval)   |

The planner reads only ``length``, ``train_end`` and ``valid_end`` (12 bytes a user); each
sample's history length is its position, clipped to ``max_seq_len``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

MANIFEST_NAME = "dataset.json"
FORMAT_VERSION = 1
SEQUENCE_FORMAT_VERSION = 2
SUPPORTED_FORMATS = (FORMAT_VERSION, SEQUENCE_FORMAT_VERSION)

USER_ID = "user_id"
HISTORY_ITEMS = "history_item_ids"
HISTORY_TIMESTAMPS = "history_timestamps"
CANDIDATE_ITEM = "candidate_item_id"
DENSE = "dense_features"
LABEL = "label"
HISTORY_LENGTH = "history_length"
SAMPLED_ITEMS = "sampled_item_ids"
"""Not a column either: item ids the loader draws uniformly for a retrieval model's sampled softmax."""
CANDIDATE_TIMESTAMP = "candidate_timestamp"
"""Not a stored column: format 2 reads it at the sample's own position (the time of the interaction
it predicts); format 1 has no such time, and a model that asks gets the newest history timestamp."""

# Format 2 (one row per user).
ITEM_IDS = "item_ids"
TIMESTAMPS = "timestamps"
LABELS = "labels"
LENGTH = "length"
TRAIN_END = "train_end"
VALID_END = "valid_end"


class DataError(ValueError):
    """Bad input data, phrased for the user: names the file, and the column or key."""


def sample_schema(dense_dim: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field(USER_ID, pa.int64(), nullable=False),
            pa.field(HISTORY_ITEMS, pa.list_(pa.int64()), nullable=False),
            pa.field(HISTORY_TIMESTAMPS, pa.list_(pa.int64()), nullable=False),
            pa.field(CANDIDATE_ITEM, pa.int64(), nullable=False),
            pa.field(DENSE, pa.list_(pa.float32(), dense_dim), nullable=False),
            pa.field(LABEL, pa.float32(), nullable=False),
        ]
    )


def check_schema(schema: pa.Schema, dense_dim: int, where: str) -> None:
    """Raise DataError naming ``where`` and the column if ``schema`` lacks or mistypes one."""
    expected = sample_schema(dense_dim)
    idx = schema.get_field_index(HISTORY_LENGTH)
    if idx >= 0 and not schema.field(idx).type.equals(pa.int32()):
        raise DataError(f"{where}: column '{HISTORY_LENGTH}' has type {schema.field(idx).type}, expected int32")
    _check_columns(schema, expected, where)


def _check_columns(schema: pa.Schema, expected: pa.Schema, where: str) -> None:
    """Raise DataError naming ``where`` and the first column of ``expected`` that ``schema`` lacks or mistypes."""
    for want in expected:
        idx = schema.get_field_index(want.name)
        if idx < 0:
            raise DataError(f"{where}: missing column '{want.name}' (expected {want.type})")
        got = schema.field(idx).type
        if not got.equals(want.type):
            raise DataError(f"{where}: column '{want.name}' has type {got}, expected {want.type}")


def sequence_schema(dense_dim: int) -> pa.Schema:
    """Format 2: one row per user (see the module docstring)."""
    fields = [
        pa.field(USER_ID, pa.int64(), nullable=False),
        pa.field(ITEM_IDS, pa.list_(pa.int64()), nullable=False),
        pa.field(TIMESTAMPS, pa.list_(pa.int64()), nullable=False),
        pa.field(LABELS, pa.list_(pa.float32()), nullable=False),
    ]
    if dense_dim > 0:
        fields.append(pa.field(DENSE, pa.list_(pa.list_(pa.float32(), dense_dim)), nullable=False))
    fields += [pa.field(LENGTH, pa.int32(), nullable=False), pa.field(TRAIN_END, pa.int32(), nullable=False),
               pa.field(VALID_END, pa.int32(), nullable=False)]
    return pa.schema(fields)


def check_sequence_schema(schema: pa.Schema, dense_dim: int, where: str) -> None:
    """Raise DataError naming ``where`` and the column if a format-2 file lacks or mistypes one (``valid_end``
    may be absent: data prepared before validation splits, read as having none)."""
    expected = sequence_schema(dense_dim)
    if schema.get_field_index(VALID_END) < 0:
        expected = expected.remove(expected.get_field_index(VALID_END))
    _check_columns(schema, expected, where)


@dataclass
class DatasetManifest:
    """What a reader and a model need to know about a dataset before reading rows."""

    num_items: int
    num_users: int
    dense_dim: int
    max_len: int
    splits: dict[str, list[str]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    generator: dict[str, object] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    samples: dict[str, int] = field(default_factory=dict)
    """Format 2: samples per split (``rows`` then counts users per split's files)."""
    vocab: dict[str, str] = field(default_factory=dict)
    """Format 2: feature -> its id mapping file (dense id, the log's own id, count)."""
    preparation: dict[str, object] = field(default_factory=dict)
    """Format 2: how ``freescale prepare`` made it: input, columns, filters, split, counts."""

    def write(self, directory: Path) -> None:
        self.write_to(pafs.LocalFileSystem(), str(directory))

    def write_to(self, fs: pafs.FileSystem, base: str) -> None:
        """Write ``dataset.json`` under ``base`` on ``fs`` (a temporary name, then a move: readers never
        see half a manifest; on object stores the move is a copy, still after the data files)."""
        tmp, path = f"{base}/{MANIFEST_NAME}.tmp", f"{base}/{MANIFEST_NAME}"
        with fs.open_output_stream(tmp) as fh:
            fh.write((json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode())
        fs.move(tmp, path)

    @classmethod
    def read(cls, uri: str | Path) -> DatasetManifest:
        """The manifest of the dataset at a local path or filesystem URI."""
        from freescale.dataloader.source import resolve

        fs, base = resolve(str(uri))
        return cls.read_from(fs, base, str(uri))

    @classmethod
    def read_from(cls, fs: pafs.FileSystem, base: str, shown: str) -> DatasetManifest:
        path = f"{shown.rstrip('/')}/{MANIFEST_NAME}"
        if fs.get_file_info(f"{base}/{MANIFEST_NAME}").type != pafs.FileType.File:
            if fs.get_file_info(base).type == pafs.FileType.NotFound:
                raise DataError(f"data path not found: {shown} (create one with `freescale gen-data --out {shown}`)")
            if fs.get_file_info(base).type == pafs.FileType.File:  # an interaction log given as the dataset
                raise DataError(f"{shown}: a file, not a dataset directory; an interaction log (Parquet or CSV) "
                                f"becomes one with `freescale prepare {shown} --out DIR ...`")
            raise DataError(f"{shown}: no {MANIFEST_NAME}; is this a dataset written by `freescale gen-data` "
                            "or `freescale prepare`?")
        try:
            with fs.open_input_stream(f"{base}/{MANIFEST_NAME}") as fh:
                raw = json.loads(fh.read().decode())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{path}: invalid JSON: {exc}") from None
        required = ("num_items", "num_users", "dense_dim", "max_len", "splits")
        for key in required:
            if key not in raw:
                raise DataError(f"{path}: missing key '{key}'")
        for key in ("num_items", "num_users", "dense_dim", "max_len"):
            if not isinstance(raw[key], int) or raw[key] < 0:
                raise DataError(f"{path}: key '{key}' must be a non-negative integer, got {raw[key]!r}")
        version = raw.get("format_version", FORMAT_VERSION)
        if version not in SUPPORTED_FORMATS:
            raise DataError(
                f"{path}: format_version {version} is not supported by this freescale (it reads "
                f"{' and '.join(map(str, SUPPORTED_FORMATS))}); upgrade freescale or re-run `freescale prepare`"
            )
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def split_files(self, split: str, shown: str) -> list[str]:
        """File names of ``split`` (relative to the dataset directory)."""
        if split not in self.splits:
            raise DataError(
                f"{shown}/{MANIFEST_NAME}: no split '{split}' (has: {', '.join(sorted(self.splits)) or 'none'})"
            )
        return list(self.splits[split])
