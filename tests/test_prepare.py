"""``freescale prepare`` and format 2: round trips, splits, the memory bound, bad input, same batches as format 1."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from freescale.cli import main
from freescale.config import ConfigError
from freescale.dataloader.cost import CostModel
from freescale.dataloader.log_input import LogColumns
from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.prepare import PrepareSpec, prepare
from freescale.dataloader.schema import HISTORY_ITEMS, HISTORY_LENGTH, DataError, DatasetManifest, sample_schema
from freescale.dataloader.sequence_source import SequenceSource

FEATURES = ["history_item_ids", "candidate_item_id", "user_id"]
COLUMNS = LogColumns(user="who", item="what", time="when", label="stars", rating_threshold=4.0, dense=("price",))


def make_log(n: int = 3_000, seed: int = 0) -> pa.Table:
    """Users with 1..40 interactions, string user ids, repeated timestamps, a few rare items."""
    rng = np.random.default_rng(seed)
    users = np.where(rng.random(n) < 0.98, rng.integers(0, 120, n), 500 + rng.integers(0, 200, n))
    items = np.where(rng.random(n) < 0.97, rng.integers(0, 60, n), 1_000 + rng.integers(0, 400, n))
    return pa.table({
        "who": pa.array([f"u{u}" for u in users]),
        "what": pa.array(items),
        "when": pa.array(rng.integers(0, 40, n) * 1_000 + 1_500_000_000),
        "stars": pa.array(rng.integers(1, 6, n).astype(np.float64)),
        "price": pa.array(rng.random(n)),
    })


def run(tmp: Path, log: pa.Table, name: str = "out", **spec: object) -> tuple[Path, object]:
    src = tmp / f"{name}.csv"
    pacsv.write_csv(log, src)
    out = tmp / name
    options = {"min_user_count": 3, "min_item_count": 2, "row_group_interactions": 256, **spec}
    report = prepare(PrepareSpec(input=str(src), out=str(out), columns=COLUMNS, **options))  # type: ignore[arg-type]
    return out, report


def users_table(out: Path) -> pa.Table:
    manifest = DatasetManifest.read(out)
    return pa.concat_tables(pq.read_table(out / f) for f in manifest.splits["train"])


def vocab(out: Path, feature: str) -> np.ndarray:
    return pq.read_table(out / "vocab" / f"{feature}.parquet").column("raw").to_numpy(zero_copy_only=False)


def test_every_interaction_lands_in_one_sample_or_is_dropped_with_its_reason(tmp_path: Path) -> None:
    log = make_log()
    out, report = run(tmp_path, log)
    users, items = vocab(out, "user_id"), vocab(out, "item_id")
    table = users_table(out)
    rows = table.to_pylist()
    seen: Counter[tuple[object, ...]] = Counter()
    targets = {"train": 0, "valid": 0, "eval": 0}
    for row in rows:
        assert row["timestamps"] == sorted(row["timestamps"]) and row["length"] == len(row["item_ids"])
        # leave-last-out: the last one held out for the test, the one before it for validation
        assert row["valid_end"] == row["length"] - 1 and row["train_end"] == row["length"] - 2
        for p, (item, ts, label, dense) in enumerate(zip(row["item_ids"], row["timestamps"], row["labels"], row["dense_features"])):
            seen[(users[row["user_id"]], int(items[item]), ts, label, float(np.float32(dense[0])))] += 1
            if p:
                targets["train" if p < row["train_end"] else "valid" if p < row["valid_end"] else "eval"] += 1
    counts = Counter(log.column("what").to_pylist())
    per_user = Counter(u for u, i in zip(log.column("who").to_pylist(), log.column("what").to_pylist()) if counts[i] >= 2)
    expected: Counter[tuple[object, ...]] = Counter()
    rare_items = rare_users = 0
    for u, i, t, s, d in zip(*(log.column(c).to_pylist() for c in ("who", "what", "when", "stars", "price"))):
        if counts[i] < 2:
            rare_items += 1
        elif per_user[u] < 3:
            rare_users += 1
        else:
            expected[(u, i, t, float(s >= 4), float(np.float32(d)))] += 1
    assert seen == expected
    assert rare_items > 0 and rare_users > 0
    dropped = list(report.dropped.values())  # type: ignore[attr-defined]
    assert dropped == [rare_items, rare_users]
    assert report.samples == targets and targets["eval"] == targets["valid"] == len(rows)  # type: ignore[attr-defined]
    assert report.interactions_read == log.num_rows  # type: ignore[attr-defined]
    assert sum(dropped) + len(rows) + sum(targets.values()) == log.num_rows  # + history only
    # Each split reads its own positions: no sample in two splits, no held-out item in a training history.
    splits = {split: SequenceSource(str(out), split, ["user_id", "candidate_timestamp", "history_item_ids"], max_seq_len=64)
              for split in targets}
    tables = {split: source.read(np.arange(source.num_rows))[0] for split, source in splits.items()}
    assert {split: t.num_rows for split, t in tables.items()} == targets
    lengths = {row["user_id"]: row["length"] for row in rows}  # (histories are whole here: max_seq_len 64 > 40)
    for user, history in zip(tables["train"].column("user_id").to_pylist(),
                             tables["train"].column("history_item_ids").to_pylist()):
        assert len(history) <= lengths[user] - 3, "a training history reaches a held-out position"
    for split, held in (("valid", 2), ("eval", 1)):  # the one position of each user: its history is all before it
        for user, history in zip(tables[split].column("user_id").to_pylist(),
                                 tables[split].column("history_item_ids").to_pylist()):
            assert len(history) == lengths[user] - held
    manifest = DatasetManifest.read(out)
    assert manifest.format_version == 2 and manifest.samples == targets
    assert manifest.num_users == len(users) and manifest.num_items == len(items)
    assert manifest.preparation["report"]["interactions_read"] == log.num_rows
    # Items in frequency order; the mapping inverts (dense id -> the log's id -> the same dense id).
    item_counts = pq.read_table(out / "vocab" / "item_id.parquet").column("count").to_numpy()
    assert (np.diff(item_counts) <= 0).all()
    assert {raw: i for i, raw in enumerate(items)}[items[5]] == 5 and len(set(users)) == len(users)


def test_a_time_cut_leaks_nothing_from_after_it_into_training(tmp_path: Path) -> None:
    """The test part after a time cut, the validation part after an earlier one, training before both."""
    out, report = run(tmp_path, make_log(seed=1), split="time-quantile:0.7", validation="time-quantile:0.5")
    cut, valid_cut = report.time_cut, report.valid_cut  # type: ignore[attr-defined]
    assert cut is not None and valid_cut is not None and valid_cut < cut
    for row in users_table(out).to_pylist():
        ts, end, test = row["timestamps"], row["train_end"], row["valid_end"]
        assert all(t < valid_cut for t in ts[:end]) and all(valid_cut <= t < cut for t in ts[end:test])
        assert all(t >= cut for t in ts[test:])
    assert report.samples["valid"] > 0  # type: ignore[attr-defined]
    source = SequenceSource(str(out), "train", ["candidate_item_id", "candidate_timestamp", "history_timestamps"],
                            max_seq_len=8)
    table, _ = source.read(np.arange(source.num_rows))
    assert max(max(h) for h in table.column("history_timestamps").to_pylist()) < valid_cut
    # Each sample's own time (what a time-aware model asks for): after its history, before the cut.
    for history, own in zip(table.column("history_timestamps").to_pylist(), table.column("candidate_timestamp").to_pylist()):
        assert max(history, default=own) <= own < valid_cut
    cfg = DataConfig(path=str(out), batch_size=64, max_seq_len=8, prefetch=0)
    batch = build_loader(cfg, "train", rank=0, world_size=1, sparse_features=FEATURES, derived_cost=CostModel(1, 1, 1),
                         seed=0, timestamps=True).next_batch()
    lengths = batch.sparse[HISTORY_ITEMS].lengths()
    newest = batch.history_timestamps[torch.cumsum(lengths, 0)[lengths > 0] - 1]
    assert bool((batch.candidate_timestamps[lengths > 0] >= newest).all()) and int(batch.candidate_timestamps.max()) < valid_cut
    evaluation = SequenceSource(str(out), "eval", ["history_timestamps"], max_seq_len=8)
    assert evaluation.num_rows == report.samples["eval"] > 0  # type: ignore[attr-defined]


def test_a_log_larger_than_the_memory_bound_gives_the_same_dataset(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    n = 1_250_000  # 40 MB of columns, twice the bound below
    log = pa.table({"u": rng.integers(0, 20_000, n), "i": rng.integers(0, 50_000, n), "t": rng.integers(0, 10**6, n),
                    "c": rng.integers(0, 2, n)})
    pq.write_table(log, tmp_path / "log.parquet")
    cols = LogColumns(user="u", item="i", time="t", label="c")
    outs = []
    for memory, threads in (("20MB", 1), ("2GB", 0)):
        out = tmp_path / memory
        prepare(PrepareSpec(input=str(tmp_path / "log.parquet"), out=str(out), columns=cols, memory=memory,
                            threads=threads, min_user_count=2))
        outs.append(out)
    assert users_table(outs[0]).equals(users_table(outs[1]))
    assert pq.read_table(outs[0] / "vocab" / "item_id.parquet").equals(pq.read_table(outs[1] / "vocab" / "item_id.parquet"))


def _write_v1_twin(source: SequenceSource, out: Path) -> None:
    """The same samples in format 1, row group for row group (so the epoch order is the same)."""
    out.mkdir()
    columns = ["user_id", "history_item_ids", "history_timestamps", "candidate_item_id", "dense_features", "label"]
    table, _ = source.read(np.arange(source.num_rows))
    table = table.select(columns)
    lengths = pa.compute.list_value_length(table.column(HISTORY_ITEMS)).cast(pa.int32())
    table = table.append_column(HISTORY_LENGTH, lengths)
    schema = sample_schema(source.manifest.dense_dim).append(pa.field(HISTORY_LENGTH, pa.int32(), nullable=False))
    with pq.ParquetWriter(out / "train-00000.parquet", schema) as writer:
        for start, rows in zip(source.rg_start[:-1], source.rg_rows):
            writer.write_table(table.slice(int(start), int(rows)).cast(schema), row_group_size=max(int(rows), 1))
    m = source.manifest
    DatasetManifest(num_items=m.num_items, num_users=m.num_users, dense_dim=m.dense_dim, max_len=m.max_len,
                    splits={"train": ["train-00000.parquet"]}, rows={"train": source.num_rows}).write(out)


def test_per_user_storage_trains_like_the_same_samples_stored_one_per_row(tmp_path: Path) -> None:
    from freescale.models.hstu import HSTUConfig, HSTUModel

    out, _ = run(tmp_path, make_log(n=6_000, seed=2))
    sequences = SequenceSource(str(out), "train", FEATURES + ["history_timestamps", "dense_features", "label"],
                               max_seq_len=8)
    _write_v1_twin(sequences, tmp_path / "v1")
    m = sequences.manifest
    losses = []
    for path in (out, tmp_path / "v1"):
        torch.manual_seed(0)
        model = HSTUModel(HSTUConfig(embedding_dim=8, num_blocks=1, num_heads=1, attention_dim=4, value_dim=4,
                                     head_layers=[8]), num_items=m.num_items, num_users=m.num_users,
                          dense_dim=m.dense_dim, max_seq_len=8, embedding_device=torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = DataConfig(path=str(path), batch_size=32, max_seq_len=8, window=4, shuffle_row_groups=2, prefetch=1)
        loaders = [build_loader(cfg, "train", rank=r, world_size=2, sparse_features=FEATURES,
                                derived_cost=CostModel(1.0, 2.0, 8.0), seed=5) for r in (0, 1)]
        run_losses = []
        for _ in range(6):
            for loader in loaders:  # both ranks' batches through one model: the same update either way
                loss, _ = model(loader.next_batch())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                run_losses.append(float(loss))
        losses.append(run_losses)
        for loader in loaders:
            loader.close()
    assert losses[0] == losses[1]


def write_v2(directory: Path, **changes: pa.Array) -> Path:
    """Four users in format 2 (one row group each); ``changes`` replace columns."""
    items = [[1, 2, 3], [3, 4], [5, 6, 7, 8], [2, 9]]
    columns = {
        "user_id": pa.array([0, 1, 2, 3], pa.int64()),
        "item_ids": pa.array(items, pa.list_(pa.int64())),
        "timestamps": pa.array([[10 * j for j in range(len(i))] for i in items], pa.list_(pa.int64())),
        "labels": pa.array([[1.0] * len(i) for i in items], pa.list_(pa.float32())),
        "length": pa.array([len(i) for i in items], pa.int32()),
        "train_end": pa.array([len(i) for i in items], pa.int32()),  # every position a training sample
        **changes,
    }
    directory.mkdir()
    pq.write_table(pa.table(columns), directory / "users-00000.parquet", row_group_size=1)
    DatasetManifest(num_items=10, num_users=4, dense_dim=0, max_len=4, format_version=2,
                    splits={"train": ["users-00000.parquet"], "eval": ["users-00000.parquet"]}).write(directory)
    return directory


@pytest.mark.parametrize(("changes", "needle"), [
    ({"item_ids": pa.array([[1, 2, 3], [3, 4], [5, None, 7, 8], [2, 9]], pa.list_(pa.int64()))},
     "row group 2: row 0: column 'item_ids': null element (at position 1 of the list)"),
    ({"timestamps": pa.array([[0, 1, 2], [0, 1], [0, 5, 4, 6], [0, 1]], pa.list_(pa.int64()))},
     "row group 2: row 0: column 'timestamps': timestamps go back in time (5 then 4); they must be oldest first"),
    ({"labels": pa.array([[1, 1, 1], [1, 1], [1, 0.5, 1, 1], [1, 1]], pa.list_(pa.float32()))},
     "row group 2: row 0: column 'labels': is 0.5; labels must be 0 or 1"),
    ({"item_ids": pa.array([[1, 2, 3], [3, 4], [5, 6, 7, 10], [2, 9]], pa.list_(pa.int64()))},
     "row group 2: row 0: column 'item_ids': id 10 is >= the table size num_items=10 (dataset.json)"),
])
def test_bad_user_rows_are_named_or_skipped(tmp_path: Path, changes: dict[str, pa.Array], needle: str) -> None:
    data = write_v2(tmp_path / "bad", **changes)
    cfg = DataConfig(path=str(data), batch_size=7, prefetch=2, shuffle=False, partitioner="round_robin")
    loader = build_loader(cfg, "train", rank=0, world_size=1, sparse_features=FEATURES,
                          derived_cost=CostModel(1.0, 1.0, 1.0), seed=0)
    with pytest.raises(DataError) as info:  # raised by the prefetch thread, re-raised here as it was
        loader.next_batch()
    assert str(info.value) == f"{data}/users-00000.parquet: {needle}"
    loader.close()
    cfg.on_bad_rows = "skip"
    skipping = build_loader(cfg, "train", rank=0, world_size=1, sparse_features=FEATURES,
                            derived_cost=CostModel(1.0, 1.0, 1.0), seed=0)
    batch = skipping.next_batch()
    assert batch.size == 7 - 3 and sum(skipping.source.skipped.values()) == 1  # user 2's 3 dropped
    assert skipping.last is not None  # the prefetched batch (histories copied from the slots) is the batch of its rows
    again = skipping.batch_of(skipping.last.rows, batch.loss_scale or 1.0)
    assert torch.equal(again.sparse.values(), batch.sparse.values()) and torch.equal(again.labels, batch.labels)
    skipping.close()


@pytest.mark.parametrize(("log", "flags", "message"), [
    ({"who": [1, 2], "what": [1, 1], "when": [1, 2]}, ["--label", "stars"], "no column 'stars' (it has: who, what, when)"),
    ({"who": [1, 2], "what": [1, 1], "when": ["2020-01-01", "soon"]}, [],
     "row 1: column 'when': unparseable timestamp as ISO 8601; give --time-format ('soon')"),
    ({"who": [1, None], "what": [1, 1], "when": [1, 2]}, [], "row 1: column 'who': null id (null)"),
    ({"who": [1, 2], "what": [1, 1], "when": [1, 2], "stars": [1, 3]}, ["--label", "stars", "--rating-threshold", "4"],
     "--rating-threshold 4 matches no row of column 'stars'"),
    ({"who": [1, 2], "what": [1, 1], "when": [1, 2], "stars": ["4", "b"]}, ["--label", "stars"],
     "row 1: column 'stars': not a number ('b')"),
    ({"who": [1, 2], "what": [1, 1], "when": [1, 2], "stars": ["4", "5"]}, ["--label", "stars"],
     "column 'stars' has type string; a label column must be numeric (non-numeric values)"),
    ({"who": [1, 2], "what": [1, 1], "when": [1, 2], "stars": [1, 5]}, ["--label", "stars"],
     "row 1: column 'stars': a label must be 0 or 1; for ratings give --rating-threshold (5)"),
    ({"who": pa.array([], pa.int64()), "what": pa.array([], pa.int64()), "when": pa.array([], pa.int64())}, [],
     "the log has no rows"),
])
def test_bad_logs_are_one_line_with_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  log: dict[str, list[object]], flags: list[str], message: str) -> None:
    pq.write_table(pa.table(log), tmp_path / "log.parquet")
    code = main(["prepare", str(tmp_path / "log.parquet"), "--out", str(tmp_path / "out"), "--user", "who",
                 "--item", "what", "--time", "when", "--min-user-count", "1", *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_cli_prepares_a_generated_log_and_prints_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gen-log", "--out", str(tmp_path / "ratings.csv"), "--users", "200", "--items", "300"]) == 0
    argv = ["prepare", str(tmp_path / "ratings.csv"), "--out", str(tmp_path / "ml"), "--user", "userId", "--item",
            "movieId", "--time", "timestamp", "--label", "rating", "--rating-threshold", "4"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for line in ("interactions read", "history only (each user's first interaction", "samples: train", "bytes written"):
        assert line in printed
    manifest = json.loads((tmp_path / "ml" / "dataset.json").read_text())
    assert manifest["samples"]["eval"] == manifest["num_users"] == 200
    assert main(argv) == 2 and "already holds a dataset" in capsys.readouterr().err


def test_a_generated_log_with_sessions_chains_successors_within_them() -> None:
    """``gen-log --successor``: within a session (minutes apart) the next item is often the last one's fixed
    successor (the next of its category); never across a new session's long gap."""
    from freescale.dataloader.synthetic_log import LogSpec, interactions

    spec = LogSpec(users=300, items=180, categories=6, successor=0.6, new_session=0.25, seed=3)
    log = interactions(spec).sort_by([("userId", "ascending"), ("timestamp", "ascending")])
    user, item, time = (log.column(c).to_numpy() for c in ("userId", "movieId", "timestamp"))
    same_user = user[1:] == user[:-1]
    previous, nxt, gap = item[:-1] - 1, item[1:] - 1, np.diff(time)
    successor = previous % 6 + 6 * ((previous // 6 + 1) % 30) == nxt
    short = gap < 3_600
    assert abs(successor[same_user & short].mean() - 0.6) < 0.05  # a chance draw is the successor < 1 in 30
    assert successor[same_user & (gap > 6 * 3_600)].mean() < 0.1
    assert 0.2 < (~short[same_user]).mean() < 0.3


def test_with_several_tastes_a_user_draws_from_each_of_their_categories() -> None:
    """``gen-log --tastes 3``: each user's interactions come mostly from three categories of their own,
    about equally, and are liked there (so the last item's category names one taste, the history all)."""
    from freescale.dataloader.synthetic_log import LogSpec, interactions

    spec = LogSpec(users=200, items=600, categories=12, tastes=3, seed=5)
    log = interactions(spec)
    user, category = log.column("userId").to_numpy(), (log.column("movieId").to_numpy() - 1) % 12
    liked = log.column("rating").to_numpy() >= 4
    top3, stand_out = [], []
    for u in np.unique(user):
        counts = np.sort(np.bincount(category[user == u], minlength=12))[::-1]
        top3.append(counts[:3].sum() / counts.sum())
        stand_out.append(counts[2] > 2 * counts[3])  # expected 26% of a user's interactions vs 2.5%
    assert 0.7 < np.mean(top3) < 0.85  # on_topic 0.7 plus the off-topic draws that land in a taste
    assert np.mean(stand_out) > 0.8  # (users with 20 interactions are noisy)
    assert 0.6 < liked.mean() < 0.75
    with pytest.raises(ConfigError, match="tastes"):
        LogSpec(categories=6, tastes=7).validate()


def test_engine_spark_without_pyspark_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyspark", None)  # as where it is not installed (CI)
    monkeypatch.setitem(sys.modules, "pyspark.sql", None)
    code = main(["prepare", "x.csv", "--out", str(tmp_path / "o"), "--user", "u", "--item", "i", "--time", "t",
                 "--engine", "spark"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "freescale: error: --engine spark needs pyspark: pip install 'freescale[spark]'"]


@pytest.mark.parametrize("user_1_labels", [[1], [1, 0, 1, 1, 0, 1]])
def test_a_skipped_user_with_lists_of_other_lengths_shifts_no_other_users_values(tmp_path: Path,
                                                                                 user_1_labels: list[int]) -> None:
    """User 1's labels are shorter or longer than its items: skipped whole.  The longer one takes the row group
    past the values its slot was sized for (from the declared lengths): the slots grow, nothing shifts."""
    bad_labels = pa.array([[1, 0, 1], user_1_labels, [0, 1, 0, 1], [1, 0]], pa.list_(pa.float32()))
    data = write_v2(tmp_path / "d", labels=bad_labels)
    pq.write_table(pq.read_table(data / "users-00000.parquet"), data / "users-00000.parquet", row_group_size=4)
    source = SequenceSource(str(data), "train", ["user_id", "candidate_item_id", "label"], max_seq_len=4,
                            on_bad_rows="skip")
    table, _ = source.read(np.arange(source.num_rows))
    got = list(zip(table.column("user_id").to_pylist(), table.column("candidate_item_id").to_pylist(),
                   table.column("label").to_pylist()))
    # Users 0, 2, 3 at positions 1.. (train_end = length); user 1 is dropped whole.
    assert got == [(0, 2, 0.0), (0, 3, 1.0), (2, 6, 1.0), (2, 7, 0.0), (2, 8, 1.0), (3, 9, 0.0)]


def test_a_split_ending_in_an_empty_file_opens_and_reads_every_sample(tmp_path: Path) -> None:
    """Another tool's empty Parquet file (one row group of no rows) as the split's last file: every row group's
    declared interactions are still counted right, and every sample reads."""
    data = write_v2(tmp_path / "d")
    table = pq.read_table(data / "users-00000.parquet")
    pq.write_table(table.slice(0, 0), data / "users-00001.parquet")
    DatasetManifest(num_items=10, num_users=4, dense_dim=0, max_len=4, format_version=2,
                    splits={"train": ["users-00000.parquet", "users-00001.parquet"]}).write(data)
    source = SequenceSource(str(data), "train", ["user_id", "candidate_item_id"], max_seq_len=4)
    assert source.stored_rows[-1] == 0
    got, kept = source.read(np.arange(source.num_rows))
    assert kept.tolist() == list(range(7)) and got.column("candidate_item_id").to_pylist() == [2, 3, 4, 6, 7, 8, 9]


def test_times_in_any_unit_and_iso_text_keep_their_order_within_a_second(tmp_path: Path) -> None:
    ns = 1_700_000_000_000_000_000
    log = pa.table({"who": [1, 1, 1, 2, 2], "what": [5, 4, 3, 1, 2],
                    "when": pa.array([ns + 900_000_000, ns + 100_000_000, ns + 500_000_000, ns, ns + 1], pa.int64()),
                    "big": pa.array([2**40, 3, 4, 5, 6], pa.int64())})
    pq.write_table(log, tmp_path / "ns.parquet")
    cols = LogColumns(user="who", item="what", time="when", dense=("big",), time_unit="ns")
    prepare(PrepareSpec(input=str(tmp_path / "ns.parquet"), out=str(tmp_path / "a"), columns=cols, min_user_count=1,
                        work_dir=str(tmp_path / "work")))
    first = users_table(tmp_path / "a").to_pylist()
    items = vocab(tmp_path / "a", "item_id")
    by_user = {vocab(tmp_path / "a", "user_id")[r["user_id"]]: [int(items[i]) for i in r["item_ids"]] for r in first}
    assert by_user == {1: [4, 3, 5], 2: [1, 2]}  # 0.1 s, 0.5 s, 0.9 s: the order within the second is kept
    assert {t for r in first for t in r["timestamps"]} == {ns // 10**9}
    text = pa.table({"who": [1, 1, 1], "what": [7, 8, 9],
                     "when": ["2024-05-01T10:00:00.700Z", "2024-05-01T10:00:00.200Z", "2024-05-01T11:00:00+01:00"]})
    pacsv.write_csv(text, tmp_path / "text.csv")
    prepare(PrepareSpec(input=str(tmp_path / "text.csv"), out=str(tmp_path / "b"), min_user_count=1,
                        columns=LogColumns(user="who", item="what", time="when"), work_dir=str(tmp_path / "work")))
    row, = users_table(tmp_path / "b").to_pylist()
    assert [int(vocab(tmp_path / "b", "item_id")[i]) for i in row["item_ids"]] == [9, 8, 7]  # 10:00 UTC, .2, .7


def test_a_glob_stays_in_its_directory_and_the_split_is_checked_before_reading(tmp_path: Path) -> None:
    (tmp_path / "logs" / "old").mkdir(parents=True)
    part = pa.table({"who": [1, 1, 2, 2], "what": [1, 2, 1, 2], "when": [1, 2, 3, 4]})
    pq.write_table(part, tmp_path / "logs" / "a.parquet")
    pq.write_table(part, tmp_path / "logs" / "old" / "b.parquet")  # not matched by logs/*.parquet
    cols = LogColumns(user="who", item="what", time="when")
    report = prepare(PrepareSpec(input=str(tmp_path / "logs" / "*.parquet"), out=str(tmp_path / "o"), columns=cols,
                                 min_user_count=1))
    assert report.interactions_read == 4
    with pytest.raises(DataError, match=r"^--split time:--5: not an ISO date/time or epoch seconds$"):
        prepare(PrepareSpec(input=str(tmp_path / "nowhere"), out=str(tmp_path / "p"), columns=cols, split="time:--5"))
    with pytest.raises(DataError, match=r"^--validation time:2020-01-01: a time cut for validation needs a time split"):
        prepare(PrepareSpec(input=str(tmp_path / "nowhere"), out=str(tmp_path / "p"), columns=cols,
                            validation="time:2020-01-01"))
    with pytest.raises(DataError, match=r"^--validation must be last, none, "):
        prepare(PrepareSpec(input=str(tmp_path / "nowhere"), out=str(tmp_path / "p"), columns=cols, validation="first"))


def test_the_generators_own_odds_score_its_log_best() -> None:
    """``next_item_odds`` / ``like_odds`` (the bounds ``bench_quality`` states margins against) are the log's
    own law: each row sums to 1, and the log's actual next items are likelier under them than under the odds
    of a log made with other settings (a proper scoring rule: only the true law maximizes it); the gap makes
    them likelier still; like odds match the ratings."""
    from dataclasses import replace

    from freescale.dataloader.synthetic_log import LogSpec, interactions, like_odds, next_item_odds

    spec = LogSpec(users=150, items=180, categories=6, successor=0.6, new_session=0.25, tastes=2, seed=3)
    log = interactions(spec).sort_by([("userId", "ascending"), ("timestamp", "ascending")])
    user, item, time = (log.column(c).to_numpy() for c in ("userId", "movieId", "timestamp"))
    user, item = user - 1, item - 1
    at = np.flatnonzero(user[1:] == user[:-1]) + 1  # every interaction after a user's first
    gaps = (time[at] - time[at - 1]).astype(np.float64)

    def log_likelihood(s: LogSpec, with_gap: bool = True) -> float:
        odds = next_item_odds(s, user[at], item[at - 1], gaps if with_gap else None)
        assert np.allclose(odds.sum(1), 1.0)
        return float(np.log(odds[np.arange(at.size), item[at]]).mean())

    truth = log_likelihood(spec)
    assert truth > log_likelihood(spec, with_gap=False) + 0.05
    for other in (replace(spec, successor=0.45), replace(spec, successor=0.75), replace(spec, on_topic=0.55),
                  replace(spec, on_topic=0.85), replace(spec, seed=4)):
        assert truth > log_likelihood(other), other
    # Without the gap, the prior chance of a new session matters (with it, the gap all but decides).
    assert log_likelihood(spec, with_gap=False) > log_likelihood(replace(spec, new_session=0.1), with_gap=False)
    high = log.column("rating").to_numpy() >= 4
    odds = like_odds(spec, user, item)
    assert set(np.unique(odds)) == {0.2, 0.8}
    for value in (0.2, 0.8):
        assert abs(high[odds == value].mean() - value) < 0.03
