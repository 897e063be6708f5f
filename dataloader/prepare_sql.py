"""The relational half of ``freescale prepare``: filters, vocabularies and the sorted stream, as SQL.

Input: a table ``log(user, item, ts, ts_fine, label, d0, d1, ..., pos[, tie])``
(``log_input.py`` loads it).  Output: the kept interactions as ``(user_id,
item_id, ts, label, d0, ...)`` sorted by ``(user_id, ts_fine, tie, pos)``, which
the sequence writer turns into one row per user without holding more than one
row group.  Interactions at the same time keep the log's own order (``pos``:
the row's place in the files) unless a tie-break column orders them first: the
order decides which interaction is held out and which transitions are trained,
so it is the user's, never an artifact of ids.  Exact duplicate rows (equal in
every column but ``pos``) are counted, and with ``dedupe`` the first of each
is kept (table ``unique_log``).

The statements are plain SQL on purpose: DuckDB runs them in process within a
memory bound (it spills joins, aggregates and the sort to ``temp_directory``),
and the same text runs on Spark SQL for a log that outgrows one machine
(``hash(x, seed)``, ``row_number() OVER``, ``count(*)`` and ``ORDER BY`` mean
the same there, but Spark's ``hash`` is another function, so users are stored in
another order; ``prepare_spark.py`` runs them there).  Two filters, in this
order, each counted: items seen fewer than ``min_item_count`` times, then users
left with fewer than ``min_user_count`` interactions (one pass each, not an
iterated k-core).  Item ids are dense in frequency order (id 0 is the most
frequent item: hot rows together); user ids are dense in a seeded hash order,
which is also the storage order, so users are shuffled on disk.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """The log table the statements read: its name (``log``, or ``unique_log`` after ``dedupe_statement``),
    its dense features and whether it has a tie-break column."""

    dense_dim: int
    tie: bool = False
    table: str = "log"

    def row_columns(self) -> list[str]:
        """What makes a row what it is (every column but its position): equal in all, a duplicate."""
        return ["user", "item", "ts", "ts_fine", "label", *(f"d{i}" for i in range(self.dense_dim)),
                *(["tie"] if self.tie else [])]


@dataclass(frozen=True)
class Filters:
    min_item_count: int
    min_user_count: int
    seed: int
    table: str = "log"


def duplicates_query(layout: Layout) -> str:
    """One row: the rows that repeat an earlier one exactly (a group of n equal rows counts n - 1)."""
    keys = ", ".join(layout.row_columns())
    return f"SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM {layout.table} GROUP BY {keys}) AS g"


def dedupe_statement(layout: Layout) -> str:
    """Table ``unique_log``: each set of exact duplicates once, at its first position in the log."""
    keys = ", ".join(layout.row_columns())
    return f"CREATE TABLE unique_log AS SELECT {keys}, min(pos) AS pos FROM {layout.table} GROUP BY {keys}"


def vocabulary_statements(f: Filters) -> list[str]:
    """Counts and the two vocabularies, as tables ``item_counts``, ``user_counts``, ``user_vocab``,
    ``item_vocab`` (``item_vocab``/``user_vocab``: the log's id, its dense id, its count)."""
    return [
        f"CREATE TABLE item_counts AS SELECT item, count(*) AS n FROM {f.table} GROUP BY item",
        f"""CREATE TABLE user_counts AS
            SELECT l.user, count(*) AS n FROM {f.table} l JOIN item_counts c ON l.item = c.item
            WHERE c.n >= {f.min_item_count} GROUP BY l.user""",
        f"""CREATE TABLE user_vocab AS
            SELECT user, n AS count, row_number() OVER (ORDER BY hash(user, {f.seed}), user) - 1 AS user_id
            FROM user_counts WHERE n >= {f.min_user_count}""",
        f"""CREATE TABLE item_vocab AS
            SELECT l.item, count(*) AS count, row_number() OVER (ORDER BY count(*) DESC, l.item) - 1 AS item_id
            FROM {f.table} l JOIN item_counts c ON l.item = c.item JOIN user_vocab u ON l.user = u.user
            WHERE c.n >= {f.min_item_count} GROUP BY l.item""",
    ]


def counts_query(f: Filters) -> str:
    """One row: interactions read, then rows and distinct ids dropped by each filter, then kept."""
    return f"""
        SELECT
            (SELECT sum(n) FROM item_counts) AS interactions,
            (SELECT coalesce(sum(n), 0) FROM item_counts WHERE n < {f.min_item_count}) AS rows_rare_items,
            (SELECT count(*) FROM item_counts WHERE n < {f.min_item_count}) AS rare_items,
            (SELECT coalesce(sum(n), 0) FROM user_counts WHERE n < {f.min_user_count}) AS rows_rare_users,
            (SELECT count(*) FROM user_counts WHERE n < {f.min_user_count}) AS rare_users,
            (SELECT coalesce(sum(count), 0) FROM user_vocab) AS kept,
            (SELECT count(*) FROM user_vocab) AS users,
            (SELECT count(*) FROM item_vocab) AS items,
            (SELECT coalesce(sum(label), 0) FROM {f.table}) AS positives
    """


def kept_query(layout: Layout) -> str:
    """Every kept interaction with its dense ids, in no order."""
    return _kept(layout)


def sequence_order(layout: Layout) -> list[str]:
    """The output's sort key: by user, oldest first at the time's own resolution (``ts_fine``, so the order
    within a second is kept), then the tie-break column, then the log's own order (``pos``): the result is
    the same on every engine and at any memory bound.  Sort each ascending with nulls last (only ``tie``
    has any; the engines' defaults for them differ)."""
    return ["user_id", "ts_fine", *(["tie"] if layout.tie else []), "pos"]


def sequence_columns(dense_dim: int) -> list[str]:
    """What the sequence writer takes, in its order."""
    return ["user_id", "item_id", "ts", "label", *(f"d{i}" for i in range(dense_dim))]


def _kept(layout: Layout) -> str:
    extra = "".join(f", l.d{i}" for i in range(layout.dense_dim)) + (", l.tie" if layout.tie else "")
    return f"""SELECT u.user_id, v.item_id, l.ts, l.ts_fine, l.label, l.pos{extra}
               FROM {layout.table} l JOIN user_vocab u ON l.user = u.user JOIN item_vocab v ON l.item = v.item"""


def time_quantile_query(q: float, table: str = "log") -> str:
    """The ``q`` quantile of the kept interactions' timestamps (a cut that keeps ``q`` for training)."""
    return f"SELECT percentile_disc({q}) WITHIN GROUP (ORDER BY ts) FROM ({_kept(Layout(0, table=table))})"


def sequences_query(layout: Layout) -> str:
    """The kept interactions (``sequence_columns``) in ``sequence_order``: each user's contiguous."""
    order = ", ".join(f"{c} ASC NULLS LAST" for c in sequence_order(layout))
    return f"SELECT {', '.join(sequence_columns(layout.dense_dim))} FROM ({_kept(layout)}) ORDER BY {order}"


def vocab_query(feature: str) -> str:
    """``feature``'s mapping, dense id order: (id, raw, count)."""
    table, raw = ("user_vocab", "user") if feature == "user_id" else ("item_vocab", "item")
    return f"SELECT {feature} AS id, {raw} AS raw, count FROM {table} ORDER BY {feature}"
