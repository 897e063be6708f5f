"""``freescale prepare`` on Spark, for a log that outgrows one machine: the same checks, SQL and writer.

    spark.read (Parquet or CSV), or the caller's DataFrame
      ──mapInArrow(log_input's per-batch normalize + checks)──► temporary view ``log``
      ──prepare_sql's statements (temporary views, cached)──► counts and vocabularies
      ──repartitionByRange(user_id), sortWithinPartitions(sequence order)
      ──mapInArrow(one SequenceWriter per partition: users-pNNNNN-NNNNN.parquet)──► driver
      ──► vocab/*.parquet, dataset.json (written last; files in partition order = user order)

Nothing here re-implements a step of the DuckDB path: every interaction goes through
``log_rows.normalize_batch`` (the same time units, label rule and one-line errors, naming the
partition and its row), the statements are ``prepare_sql``'s text, and the files come from
``SequenceWriter``.  What differs: Spark's ``hash`` is another function, so users are stored in
another order (the same sequences, the same item ids); a row's place in the log (``pos``, which
orders interactions at the same time) is ``(file, split's byte offset, row within the partition)``
from Spark's file metadata, not one running count, yet orders the rows as the DuckDB path's does
(files in path order, rows in file order); of a caller's DataFrame, its partitions' order;
the vocabularies' ``row_number()`` windows
run on one partition (one row per user or item: small next to the log); the vocabularies reach
the driver through pandas (``pyspark[sql]``).

``out`` must be a filesystem both the driver and every executor reach (``s3://``, ``gs://``,
``hdfs://`` or a shared mount).  A retried task rewrites its partition's same files.

    from freescale.dataloader.prepare_spark import prepare_on_spark
    report = prepare_on_spark(spark, PrepareSpec(input="s3://logs/clicks/", out="s3://data/clicks", columns=...))
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from freescale.dataloader import prepare_sql as sql
from freescale.dataloader.log_input import CSV_SUFFIXES, csv_delimiter
from freescale.dataloader.log_rows import LogColumns, check_column_kind, kind_of, normalize_batch, schema_for
from freescale.dataloader.prepare import (
    PrepareReport,
    PrepareSpec,
    clear_output,
    filter_and_count,
    finish,
    output_dir,
    split_rule,
    write_vocab,
)
from freescale.dataloader.schema import DataError
from freescale.dataloader.sequence_writer import SequenceWriter, SplitRule, WriteResult
from freescale.dataloader.source import resolve


@dataclass
class SparkEngine:
    """``prepare.Engine`` on a SparkSession: ``CREATE TABLE x AS`` becomes a cached temporary view."""

    spark: Any
    views: list[str] = field(default_factory=list)

    def run(self, statement: str) -> None:
        match = re.match(r"\s*CREATE TABLE (\w+) AS", statement)
        if match is None:
            self.spark.sql(statement)
            return
        name = match.group(1)
        self.spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW {name} AS {statement[match.end():]}")
        self.spark.sql(f"CACHE TABLE {name}")
        self.views.append(name)

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self.spark.sql(query).collect()]

    def arrow(self, query: str) -> pa.Table:
        return pa.Table.from_pandas(self.spark.sql(query).toPandas(), preserve_index=False)

    def drop(self) -> None:
        for name in reversed(self.views):
            self.spark.sql(f"UNCACHE TABLE IF EXISTS {name}")
            self.spark.catalog.dropTempView(name)
        self.spark.catalog.dropTempView("log")


def prepare_on_spark(spark: Any, spec: PrepareSpec, log: Any = None, partitions: int = 0) -> PrepareReport:
    """``prepare(spec)`` run by ``spark``; ``log`` (a DataFrame with the columns ``spec.columns`` names)
    instead of reading ``spec.input``; ``partitions``: writers (default: Spark's default parallelism).
    ``spec.memory``, ``threads`` and ``work_dir`` are the cluster's business here and are ignored."""
    spec.validate()
    start = time.perf_counter()
    frame = log if log is not None else _read(spark, spec)
    engine = SparkEngine(spark)
    try:
        _normalized(frame, spec.columns, spec.input).createOrReplaceTempView("log")
        fs, base, old_files = output_dir(spec)
        report = _on_executors(lambda: filter_and_count(engine, spec))
        rule = _on_executors(lambda: split_rule(engine, spec, report))
        clear_output(spec, fs, base, old_files)
        result = _on_executors(lambda: _write_sequences(spark, spec, rule, partitions))
        write_vocab(engine, fs, base)
        finish(fs, base, spec, None, report, result, start, engine="spark")
    finally:
        engine.drop()
    return report


SOURCE_FILE, SOURCE_BLOCK = "__freescale_file", "__freescale_block"
"""Columns ``_read`` adds from Spark's file metadata: where each row came from, to order ties as read."""


def _read(spark: Any, spec: PrepareSpec) -> Any:
    fmt = spec.format
    if fmt == "auto":
        fmt = "csv" if spec.input.lower().rstrip("/").endswith(CSV_SUFFIXES) else "parquet"
    if spec.delimiter is not None and fmt != "csv":
        raise DataError(f"{spec.input}: --delimiter is for CSV logs; this one is {fmt}")
    try:
        if fmt == "csv":
            sep = csv_delimiter(spec.input, spec.delimiter)
            frame = spark.read.option("header", True).option("inferSchema", True).option("sep", sep).csv(spec.input)
        else:
            frame = spark.read.parquet(spec.input)
        return frame.selectExpr("*", f"_metadata.file_path AS {SOURCE_FILE}",
                                f"_metadata.file_block_start AS {SOURCE_BLOCK}")
    except Exception as exc:  # Spark's AnalysisException: path not found, not Parquet ...
        raise DataError(f"{spec.input}: Spark cannot read it ({_first_line(exc)})") from None


def _normalized(frame: Any, columns: LogColumns, shown: str) -> Any:
    """``frame`` as the engine's ``log`` table, each Arrow batch normalized and checked on its executor;
    ``pos`` the struct ``(file, block, row)`` that orders rows as they were read (``SOURCE_FILE``)."""
    from pyspark import TaskContext
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

    missing = [name for name in columns.named() if name not in frame.columns]
    if missing:
        has = ", ".join(c for c in frame.columns[:12] if c not in (SOURCE_FILE, SOURCE_BLOCK))
        raise DataError(f"{shown}: no column '{missing[0]}' (it has: {has}{' ...' if len(frame.columns) > 12 else ''})")
    sourced = SOURCE_FILE in frame.columns
    selected = frame.select(*columns.named(), *([SOURCE_FILE, SOURCE_BLOCK] if sourced else []))
    types = to_arrow_schema(selected.schema)
    for name in columns.named():
        kind = types.field(name).type
        check_column_kind(name, kind_of(kind), kind, columns, shown)
    schema = schema_for(types, columns)
    out_schema = schema.append(pa.field(SOURCE_FILE, pa.string())).append(pa.field(SOURCE_BLOCK, pa.int64()))

    def normalize(batches: Any) -> Any:
        partition, done = TaskContext.get().partitionId(), 0
        where = f"{shown} (partition {partition})"
        for batch in batches:
            if batch.num_rows:
                out = normalize_batch(batch, columns, schema, where, done, (partition << 40) + done)
                source = ([batch.column(SOURCE_FILE), batch.column(SOURCE_BLOCK).cast(pa.int64())] if sourced else
                          [pa.nulls(batch.num_rows, pa.string()), pa.nulls(batch.num_rows, pa.int64())])
                yield pa.RecordBatch.from_arrays([*out.columns, *source], schema=out_schema)
            done += batch.num_rows

    # Each split of a file is read by one task, in order, so (file, split, row in the partition) is the order read.
    position = f"named_struct('file', {SOURCE_FILE}, 'block', {SOURCE_BLOCK}, 'row', pos) AS pos"
    return (selected.mapInArrow(normalize, from_arrow_schema(out_schema))
            .selectExpr(*(position if n == "pos" else n for n in schema.names)))


def _write_sequences(spark: Any, spec: PrepareSpec, rule: SplitRule, partitions: int) -> WriteResult:
    """One ``SequenceWriter`` per range of users, on the executors; their results merged in user order."""
    from pyspark import TaskContext
    from pyspark.sql import functions as F

    dense_dim, layout = len(spec.columns.dense), spec.layout()
    out, row_group = spec.out, spec.row_group_interactions
    count = partitions or spark.sparkContext.defaultParallelism
    order = [F.col(c).asc_nulls_last() for c in sql.sequence_order(layout)]
    kept = (spark.sql(sql.kept_query(layout)).repartitionByRange(count, "user_id")
            .sortWithinPartitions(*order).select(*sql.sequence_columns(dense_dim)))

    def write(batches: Any) -> Any:
        partition = TaskContext.get().partitionId()
        fs, base = resolve(out)
        writer = SequenceWriter(fs, base, dense_dim=dense_dim, rule=rule, row_group_interactions=row_group,
                                file_prefix=f"users-p{partition:05d}")
        try:
            for batch in batches:
                writer.add(batch)
            result = writer.close()
        except BaseException:
            writer.discard()
            raise
        yield pa.RecordBatch.from_pylist([{"partition": partition, "result": json.dumps(asdict(result))}])

    rows = kept.mapInArrow(write, "partition long, result string").collect()
    merged = WriteResult()
    for row in sorted(rows, key=lambda r: r["partition"]):
        part = WriteResult(**json.loads(row["result"]))
        merged.files += part.files
        merged.max_length = max(merged.max_length, part.max_length)
        for name in ("users", "interactions", "train_samples", "valid_samples", "eval_samples", "bytes_written", "row_groups"):
            setattr(merged, name, getattr(merged, name) + getattr(part, name))
    return merged


def _on_executors(step: Any) -> Any:
    """Run ``step``; a DataError raised on an executor reaches the driver inside Spark's exception,
    traceback and all: raise it here as the one line it was."""
    try:
        return step()
    except DataError:
        raise
    except Exception as exc:
        found = re.search(r"DataError: (.+)", str(exc))
        if found is None:
            raise
        raise DataError(found.group(1).strip()) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["SparkEngine", "prepare_on_spark"]
