"""``freescale prepare`` as a user meets it: the order of ties, duplicates, delimiters, implausible times, empty logs.

Each test writes a small log the way users' logs arrive (CSV with another delimiter, several files, a
header and nothing else) and checks the dataset written, or the one line the user is told.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from freescale.cli import main
from freescale.dataloader.log_input import LogColumns
from freescale.dataloader.prepare import PrepareReport, PrepareSpec, prepare
from freescale.dataloader.schema import DataError, DatasetManifest

COLS = LogColumns(user="u", item="i", time="t")


def sequences(out: Path) -> dict[object, list[object]]:
    """Each raw user's raw items, in the stored order."""
    manifest = DatasetManifest.read(out)
    users = pq.read_table(out / "vocab" / "user_id.parquet").column("raw").to_pylist()
    items = pq.read_table(out / "vocab" / "item_id.parquet").column("raw").to_pylist()
    table = pa.concat_tables(pq.read_table(out / f) for f in manifest.splits["train"])
    return {users[r["user_id"]]: [items[i] for i in r["item_ids"]] for r in table.to_pylist()}


def summary(printed: str) -> dict[str, str]:
    """The summary table's rows: what -> count."""
    return {line.rsplit(None, 1)[0].strip(): line.split()[-1] for line in printed.splitlines()[2:] if line.strip()}


def prep(source: Path, out: Path, columns: LogColumns = COLS, **options: object) -> PrepareReport:
    return prepare(PrepareSpec(input=str(source), out=str(out), columns=columns, min_user_count=1,
                               **options))  # type: ignore[arg-type]


def tied_log() -> pa.Table:
    """User 1's interactions all at one second, in an order unlike the items' frequency (item 1 is the most
    frequent: the old rule, dense item id, put it first); user 2's in two seconds."""
    return pa.table({
        "u": [1, 1, 2, 1, 1, 2, 3, 3, 3, 2],
        "i": [5, 3, 1, 9, 1, 1, 1, 1, 1, 7],
        "t": [100, 100, 200, 100, 100, 100, 50, 50, 50, 200],
        "seq": [4, 3, 1, 2, 1, 9, 0, 0, 0, None],
        "tag": ["d", "c", "z", "b", "a", "x", "q", "q", "q", "y"],
    })


def test_interactions_at_the_same_time_keep_the_order_of_the_log(tmp_path: Path) -> None:
    log = tied_log()
    pacsv.write_csv(log, tmp_path / "log.csv")
    prep(tmp_path / "log.csv", tmp_path / "one")
    assert sequences(tmp_path / "one") == {1: [5, 3, 9, 1], 2: [1, 1, 7], 3: [1, 1, 1]}
    # Split over files (read in path order), the order runs on from one file to the next.
    (tmp_path / "parts").mkdir()
    pq.write_table(log.slice(0, 4), tmp_path / "parts" / "a.parquet")
    pq.write_table(log.slice(4), tmp_path / "parts" / "b.parquet")
    prep(tmp_path / "parts", tmp_path / "two")
    assert sequences(tmp_path / "two") == sequences(tmp_path / "one")
    # The last in the log's order is the one held out for the test, the one before it for validation.
    manifest = DatasetManifest.read(tmp_path / "one")
    rows = pq.read_table(tmp_path / "one" / manifest.splits["train"][0]).to_pylist()
    assert all(r["valid_end"] == r["length"] - 1 and r["train_end"] == r["length"] - 2 for r in rows)


@pytest.mark.parametrize(("column", "expected"), [
    ("seq", {1: [1, 9, 3, 5], 2: [1, 1, 7], 3: [1, 1, 1]}),  # numbers; a null sorts last, then the log's order
    ("tag", {1: [1, 9, 3, 5], 2: [1, 7, 1], 3: [1, 1, 1]}),  # text
])
def test_tie_break_orders_interactions_at_the_same_time_by_that_column(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], column: str, expected: dict[object, list[object]]) -> None:
    pacsv.write_csv(tied_log(), tmp_path / "log.csv")
    assert main(["prepare", str(tmp_path / "log.csv"), "--out", str(tmp_path / "o"), "--user", "u", "--item", "i",
                 "--time", "t", "--min-user-count", "1", "--tie-break", column, "--no-progress"]) == 0
    assert sequences(tmp_path / "o") == expected
    manifest = json.loads((tmp_path / "o" / "dataset.json").read_text())
    assert manifest["preparation"]["columns"]["tie_break"] == column
    capsys.readouterr()


def test_tie_break_does_not_reorder_times(tmp_path: Path) -> None:
    log = pa.table({"u": [1, 1, 1], "i": [1, 2, 3], "t": [3, 2, 1], "k": [1, 2, 3]})
    pq.write_table(log, tmp_path / "log.parquet")
    prep(tmp_path / "log.parquet", tmp_path / "o", LogColumns(user="u", item="i", time="t", tie_break="k"))
    assert sequences(tmp_path / "o") == {1: [3, 2, 1]}
    pq.write_table(log.set_column(3, "k", pa.array([1.0, float("nan"), 2.0])), tmp_path / "nan.parquet")
    with pytest.raises(DataError, match=r"nan.parquet: row 1: column 'k': not a number \(NaN\) in the --tie-break"):
        prep(tmp_path / "nan.parquet", tmp_path / "p", LogColumns(user="u", item="i", time="t", tie_break="k"))


def test_exact_duplicates_are_counted_and_with_dedupe_dropped(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    log = pa.table({
        "u": [1, 1, 1, 1, 1, 2, 2, 1],
        "i": [7, 7, 7, 7, 8, 7, 7, 9],
        "t": [10, 10, 10, 10, 10, 10, 10, 11],
        "r": [1, 1, 1, 0, 1, 1, 1, 1],  # row 3 differs in its label: not a duplicate
    })
    pacsv.write_csv(log, tmp_path / "log.csv")
    argv = ["prepare", str(tmp_path / "log.csv"), "--user", "u", "--item", "i", "--time", "t", "--label", "r",
            "--min-user-count", "1", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "kept")]) == 0
    printed = capsys.readouterr().out
    assert summary(printed)["exact duplicate rows (kept; --dedupe drops them)"] == "3"
    assert sequences(tmp_path / "kept") == {1: [7, 7, 7, 7, 8, 9], 2: [7, 7]}
    report = json.loads((tmp_path / "kept" / "dataset.json").read_text())["preparation"]["report"]
    assert report["duplicates"] == 3 and report["interactions_read"] == 8
    assert main([*argv, "--out", str(tmp_path / "unique"), "--dedupe"]) == 0
    printed = capsys.readouterr().out
    assert summary(printed)["dropped: exact duplicate rows (--dedupe)"] == "3"
    assert "exact duplicate rows (kept; --dedupe drops them)" not in summary(printed)
    assert sequences(tmp_path / "unique") == {1: [7, 7, 8, 9], 2: [7]}  # the first of each kept, in place
    manifest = json.loads((tmp_path / "unique" / "dataset.json").read_text())
    report = manifest["preparation"]["report"]
    assert report["interactions_read"] == 8 and report["interactions_kept"] == 5 and report["duplicates"] == 3
    assert manifest["preparation"]["dedupe"] is True


@pytest.mark.parametrize("sep", ["\t", ";", "|"])
def test_the_delimiter_of_a_csv_file_is_sniffed_whatever_its_suffix(tmp_path: Path, sep: str) -> None:
    rows = ["user_id:token item_id:token timestamp:float", "1 10 1500000000", "1 11 1500000001", "2 10 1500000002"]
    (tmp_path / "log.csv").write_text("".join(line.replace(" ", sep) + "\n" for line in rows))
    cols = LogColumns(user="user_id:token", item="item_id:token", time="timestamp:float")
    report = prep(tmp_path / "log.csv", tmp_path / "o", cols)
    assert report.interactions_read == 3 and sequences(tmp_path / "o") == {1: [10, 11], 2: [10]}


def test_a_delimiter_given_is_used_and_a_wrong_one_is_named(tmp_path: Path) -> None:
    (tmp_path / "log.txt").write_text("u;i;t\n1;1,5;1500000000\n1;2,5;1500000001\n")  # commas inside values
    prep(tmp_path / "log.txt", tmp_path / "o", format="csv", delimiter=";")
    assert sequences(tmp_path / "o") == {1: ["1,5", "2,5"]}
    (tmp_path / "tab.csv").write_text("u\ti\tt\n1\t1\t1500000000\n")
    with pytest.raises(DataError) as caught:
        prep(tmp_path / "tab.csv", tmp_path / "p", delimiter=",")
    assert str(caught.value) == (f"{tmp_path / 'tab.csv'}: no column 'u' (it has: u\ti\tt); is the delimiter '\\t'? "
                                 "(--delimiter)")
    with pytest.raises(DataError, match="--delimiter is for CSV logs"):
        pq.write_table(pa.table({"u": [1], "i": [1], "t": [1]}), tmp_path / "log.parquet")
        prep(tmp_path / "log.parquet", tmp_path / "q", delimiter=",")


@pytest.mark.parametrize(("times", "flags", "message"), [  # (a CSV: its rows named by line)
    ([1_500_000_000_000, 1_500_000_000_001], [],
     "line 2: column 't': as seconds this is after the year 2200; give --time-unit ms (1500000000000)"),
    ([1_500_000_000, 1_500_000_000_000_000], [],
     "line 3: column 't': as seconds this is after the year 2200; give --time-unit us (1500000000000000)"),
    ([1_500_000_000_000_000, 1_500_000_000_000_000_000], ["--time-unit", "ms"],
     "line 2: column 't': as milliseconds this is after the year 2200; give --time-unit us (1500000000000000)"),
    ([1_500_000_000, -3], [], "line 3: column 't': as seconds this is before 1970; a time must fall in 1970..2200 (-3)"),
    ([1.5e9, 1.5e12], [], "line 3: column 't': as seconds this is after the year 2200; give --time-unit ms (1500000000000.0)"),
])
def test_numeric_times_outside_1970_to_2200_are_refused_naming_the_unit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], times: list[object], flags: list[str], message: str) -> None:
    pacsv.write_csv(pa.table({"u": [1, 1], "i": [1, 2], "t": times}), tmp_path / "log.csv")
    argv = ["prepare", str(tmp_path / "log.csv"), "--out", str(tmp_path / "o"), "--user", "u", "--item", "i",
            "--time", "t", "--min-user-count", "1", "--no-progress", *flags]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"freescale: error: {tmp_path / 'log.csv'}: {message}"]


def test_millisecond_times_with_their_unit_prepare(tmp_path: Path) -> None:
    pacsv.write_csv(pa.table({"u": [1, 1], "i": [1, 2], "t": [1_500_000_000_500, 1_500_000_000_200]}), tmp_path / "l.csv")
    prep(tmp_path / "l.csv", tmp_path / "o", LogColumns(user="u", item="i", time="t", time_unit="ms"))
    assert sequences(tmp_path / "o") == {1: [2, 1]}


def test_a_header_only_csv_has_no_rows(tmp_path: Path) -> None:
    (tmp_path / "log.csv").write_text("userId,movieId,timestamp\n")
    cols = LogColumns(user="userId", item="movieId", time="timestamp")
    with pytest.raises(DataError) as caught:
        prep(tmp_path / "log.csv", tmp_path / "o", cols)
    assert str(caught.value) == f"{tmp_path / 'log.csv'}: the log has no rows (only a header)"
    # In a directory, a header-only file adds nothing; the others are prepared.
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.csv").write_text("userId,movieId,timestamp\n")
    (tmp_path / "logs" / "b.csv").write_text("userId,movieId,timestamp\n1,2,1500000000\n")
    assert prep(tmp_path / "logs", tmp_path / "p", cols).interactions_read == 1
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match=r"empty.csv: the log has no rows \(the file is empty\)$"):
        prep(tmp_path / "empty.csv", tmp_path / "q", cols)


@pytest.mark.parametrize(("bad_row", "message"), [
    (10, "line 12: column 't': not a number, as the column's first values are ('soon')"),  # (a CSV's line: the
    (200_000, "line 200002: column 't': not int64 like the rows before it ('soon')"),  # header is line 1)
])
def test_text_in_a_numeric_time_column_names_its_row(tmp_path: Path, bad_row: int, message: str) -> None:
    times = [str(1_500_000_000 + k) for k in range(bad_row + 5)]
    times[bad_row] = "soon"
    pacsv.write_csv(pa.table({"u": [1] * len(times), "i": list(range(len(times))), "t": times}), tmp_path / "log.csv")
    with pytest.raises(DataError) as caught:
        prep(tmp_path / "log.csv", tmp_path / "o")
    assert str(caught.value) == f"{tmp_path / 'log.csv'}: {message}"


def test_text_in_a_label_column_of_a_csv_names_its_line(tmp_path: Path) -> None:
    """A rating column with one word in it is read as text: the word is named by its line (the header is line 1)."""
    ratings = ["4"] * 300
    ratings[99] = "four"  # the 100th data row: line 101
    pacsv.write_csv(pa.table({"u": [k % 7 for k in range(300)], "i": list(range(300)),
                              "t": [1_500_000_000 + k for k in range(300)], "r": ratings}), tmp_path / "log.csv")
    with pytest.raises(DataError) as caught:
        prep(tmp_path / "log.csv", tmp_path / "o", LogColumns(user="u", item="i", time="t", label="r",
                                                               rating_threshold=4))
    assert str(caught.value) == f"{tmp_path / 'log.csv'}: line 101: column 'r': not a number ('four')"


def test_a_half_star_rating_far_down_a_csv_is_a_rating(tmp_path: Path) -> None:
    """A label read as numbers in every block: ``4.5`` past the reader's first block of whole ratings (MovieLens
    10M/20M's half stars) was refused as "not int64 like the rows before it"; a word there is named by its line."""
    rows = 60_000  # past the reader's first block (1 MB)
    table = {"u": [k % 7 for k in range(rows)], "i": list(range(rows)), "t": [1_500_000_000 + k for k in range(rows)],
             "r": ["3"] * rows}
    table["r"][-1] = "4.5"
    pacsv.write_csv(pa.table(table), tmp_path / "log.csv")
    assert (tmp_path / "log.csv").stat().st_size > 1 << 20
    columns = LogColumns(user="u", item="i", time="t", label="r", rating_threshold=4)
    report = prep(tmp_path / "log.csv", tmp_path / "o", columns)
    assert report.interactions_kept > 0
    table["r"][-1] = "four"
    pacsv.write_csv(pa.table(table), tmp_path / "log.csv")
    with pytest.raises(DataError) as caught:
        prep(tmp_path / "log.csv", tmp_path / "o2", columns)
    assert str(caught.value) == f"{tmp_path / 'log.csv'}: line {rows + 1}: column 'r': not a number ('four')"


def test_overwrite_keeps_the_old_dataset_when_the_new_log_is_refused(tmp_path: Path) -> None:
    """``--overwrite`` removes the dataset already there only once the new log is read and checked: a log refused
    at one of its rows leaves the old dataset whole (it was deleted first, once) and no empty ``vocab/`` litter."""
    table = {"u": [k % 7 for k in range(300)], "i": list(range(300)), "t": [1_500_000_000 + k for k in range(300)],
             "r": ["4"] * 300}
    columns = LogColumns(user="u", item="i", time="t", label="r", rating_threshold=4)
    pacsv.write_csv(pa.table(table), tmp_path / "good.csv")
    prep(tmp_path / "good.csv", tmp_path / "o", columns)
    before = {p.relative_to(tmp_path / "o"): p.read_bytes() for p in (tmp_path / "o").rglob("*") if p.is_file()}
    table["r"][299] = "four"
    pacsv.write_csv(pa.table(table), tmp_path / "bad.csv")
    with pytest.raises(DataError, match="line 301: column 'r': not a number"):
        prep(tmp_path / "bad.csv", tmp_path / "o", columns, overwrite=True)
    after = {p.relative_to(tmp_path / "o"): p.read_bytes() for p in (tmp_path / "o").rglob("*") if p.is_file()}
    assert after == before and sequences(tmp_path / "o")
    with pytest.raises(DataError, match="line 301"):
        prep(tmp_path / "bad.csv", tmp_path / "fresh", columns)
    assert not (tmp_path / "fresh" / "vocab").exists()


def test_a_numeric_time_column_read_as_text_is_taken_as_numbers(tmp_path: Path) -> None:
    """A batch of a text column (a file whose first block had some text) whose values are all numbers."""
    (tmp_path / "log.csv").write_text('u,i,t\n1,1,"1500000002"\n1,2," 1500000001"\n1,3,1500000000.5\n')
    prep(tmp_path / "log.csv", tmp_path / "o", format="csv")
    assert sequences(tmp_path / "o") == {1: [3, 2, 1]}
