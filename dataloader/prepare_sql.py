"""The relational half of ``freescale prepare``: filters, vocabularies and the sorted stream, as SQL.

Input: a table ``log(user, item, ts, label, d0, d1, ...)`` (``log_input.py``
loads it).  Output: the kept interactions as ``(user_id, item_id, ts, label,
d0, ...)`` sorted by ``(user_id, ts, item_id, ...)``, which the sequence writer
turns into one row per user without holding more than one row group.

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
class Filters:
    min_item_count: int
    min_user_count: int
    seed: int


def vocabulary_statements(f: Filters) -> list[str]:
    """Counts and the two vocabularies, as tables ``item_counts``, ``user_counts``, ``user_vocab``,
    ``item_vocab`` (``item_vocab``/``user_vocab``: the log's id, its dense id, its count)."""
    return [
        "CREATE TABLE item_counts AS SELECT item, count(*) AS n FROM log GROUP BY item",
        f"""CREATE TABLE user_counts AS
            SELECT l.user, count(*) AS n FROM log l JOIN item_counts c ON l.item = c.item
            WHERE c.n >= {f.min_item_count} GROUP BY l.user""",
        f"""CREATE TABLE user_vocab AS
            SELECT user, n AS count, row_number() OVER (ORDER BY hash(user, {f.seed}), user) - 1 AS user_id
            FROM user_counts WHERE n >= {f.min_user_count}""",
        f"""CREATE TABLE item_vocab AS
            SELECT l.item, count(*) AS count, row_number() OVER (ORDER BY count(*) DESC, l.item) - 1 AS item_id
            FROM log l JOIN item_counts c ON l.item = c.item JOIN user_vocab u ON l.user = u.user
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
            (SELECT coalesce(sum(label), 0) FROM log) AS positives
    """


def kept_query(dense_dim: int) -> str:
    """Every kept interaction with its dense ids, in no order."""
    return _kept(dense_dim)


def sequence_order(dense_dim: int) -> list[str]:
    """The output's sort key: by user, oldest first at the time's own resolution (``ts_fine``, so the
    order within a second is kept); ties broken by every column, so the output does not depend on the
    input's file or row order."""
    return ["user_id", "ts_fine", "item_id", "label", *(f"d{i}" for i in range(dense_dim))]


def sequence_columns(dense_dim: int) -> list[str]:
    """What the sequence writer takes, in its order."""
    return ["user_id", "item_id", "ts", "label", *(f"d{i}" for i in range(dense_dim))]


def _kept(dense_dim: int) -> str:
    dense = "".join(f", l.d{i}" for i in range(dense_dim))
    return f"""SELECT u.user_id, v.item_id, l.ts, l.ts_fine, l.label{dense}
               FROM log l JOIN user_vocab u ON l.user = u.user JOIN item_vocab v ON l.item = v.item"""


def time_quantile_query(q: float) -> str:
    """The ``q`` quantile of the kept interactions' timestamps (a cut that keeps ``q`` for training)."""
    return f"SELECT percentile_disc({q}) WITHIN GROUP (ORDER BY ts) FROM ({_kept(0)})"


def sequences_query(dense_dim: int) -> str:
    """The kept interactions (``sequence_columns``) in ``sequence_order``: each user's contiguous."""
    return (f"SELECT {', '.join(sequence_columns(dense_dim))} FROM ({_kept(dense_dim)}) "
            f"ORDER BY {', '.join(sequence_order(dense_dim))}")


def vocab_query(feature: str) -> str:
    """``feature``'s mapping, dense id order: (id, raw, count)."""
    table, raw = ("user_vocab", "user") if feature == "user_id" else ("item_vocab", "item")
    return f"SELECT {feature} AS id, {raw} AS raw, count FROM {table} ORDER BY {feature}"
