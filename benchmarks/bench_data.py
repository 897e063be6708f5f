"""Datasets the benchmarks share: a prepared log (format 2) and the same samples one per row (format 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from freescale.dataloader.schema import HISTORY_ITEMS, HISTORY_LENGTH, DatasetManifest, sample_schema

SAMPLE_COLUMNS = ["user_id", "history_item_ids", "history_timestamps", "candidate_item_id", "dense_features", "label"]


def prepared(root: Path, samples: int, row_group: int = 4_096, lengths: str = "ml-20m") -> Path:
    """``freescale prepare`` over a synthetic MovieLens-shaped log of about ``samples`` training samples."""
    from freescale.dataloader.log_input import LogColumns
    from freescale.dataloader.prepare import PrepareSpec, prepare
    from freescale.dataloader.synthetic_log import LogSpec, interactions

    log = root / "log.parquet"
    users = samples // 150 + 1
    pq.write_table(interactions(LogSpec(users=users, items=20_000, lengths=lengths, min_per_user=2)), log)
    out = root / "format2"
    prepare(PrepareSpec(input=str(log), out=str(out), columns=LogColumns(user="userId", item="movieId",
            time="timestamp", label="rating", rating_threshold=4.0), min_user_count=2,
            row_group_interactions=row_group))
    return out


def format1_twin(format2: Path, out: Path, max_len: int, row_group: int = 8_192) -> Path:
    """The same training samples, one row per sample (histories cut at ``max_len``), ``row_group`` rows per row
    group, with one dense feature of 0.0 (Parquet does not round-trip a zero-width fixed-size list)."""
    from freescale.dataloader.sequence_source import SequenceSource

    source = SequenceSource(str(format2), "train", SAMPLE_COLUMNS, max_seq_len=max_len)
    schema = sample_schema(1).append(pa.field(HISTORY_LENGTH, pa.int32(), nullable=False))
    out.mkdir()
    with pq.ParquetWriter(out / "train-00000.parquet", schema) as writer:
        for start in range(0, source.num_rows, 262_144):
            table, _ = source.read(np.arange(start, min(start + 262_144, source.num_rows)))
            lengths = pc.list_value_length(table.column(HISTORY_ITEMS)).cast(pa.int32())
            zeros = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(table.num_rows, dtype=np.float32)), 1)
            table = table.set_column(table.schema.get_field_index("dense_features"), "dense_features", zeros)
            writer.write_table(table.select(SAMPLE_COLUMNS).append_column(HISTORY_LENGTH, lengths).cast(schema),
                               row_group_size=row_group)
    m = source.manifest
    DatasetManifest(num_items=m.num_items, num_users=m.num_users, dense_dim=1, max_len=max_len,
                    splits={"train": ["train-00000.parquet"]}, rows={"train": source.num_rows}).write(out)
    return out
