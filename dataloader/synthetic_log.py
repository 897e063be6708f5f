"""A MovieLens-shaped interaction log with a planted signal (``freescale gen-log``).

What a user brings to ``freescale prepare``, made up so the quick start needs
no download: a ratings table ``userId, movieId, rating, timestamp`` (the
column names of MovieLens 20M's ``ratings.csv``), one row per interaction, in
no particular order.  Per-user counts follow the lognormal fit of MovieLens
(``--lengths ml-1m`` or ``ml-20m``, at least ``min_per_user``); every user prefers
``tastes`` item categories (one by default) and most of their interactions come
from them (each time one of them at random); an interaction with a preferred
category is rated 4 or 5 most of the time, any other 1 to 3.
A ranking model that reads the history (which category the user keeps
choosing) and the candidate therefore learns ``rating >= 4``.

``successor > 0`` adds order and time (what next-item retrieval and a time-aware
model can learn): interactions come in sessions (minutes apart; a new session
starts with probability ``new_session``, days later), and within a session the
next item is, with probability ``successor``, the fixed successor of the last
one (the next item of its category), else a fresh draw as above.  After a long
gap the last item says little; after a short one, a lot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from freescale.config import ConfigError, require
from freescale.dataloader.synthetic import LOGNORMAL_LENGTHS


@dataclass
class LogSpec:
    users: int = 6_040
    items: int = 3_706
    categories: int = 18
    lengths: str = "ml-1m"
    min_per_user: int = 20
    max_per_user: int = 2_000
    on_topic: float = 0.7
    tastes: int = 1
    item_zipf_alpha: float = 1.05
    successor: float = 0.0
    new_session: float = 0.2
    seed: int = 0

    def validate(self) -> None:
        require(self.users > 0, "users", f"must be positive, got {self.users}")
        require(self.items >= self.categories >= 2, "items", "must be >= categories >= 2")
        require(self.lengths in LOGNORMAL_LENGTHS, "lengths", f"must be one of {', '.join(LOGNORMAL_LENGTHS)}")
        require(1 <= self.min_per_user <= self.max_per_user, "min_per_user", "must be in [1, max_per_user]")
        require(0.0 <= self.on_topic <= 1.0, "on_topic", "must be in [0, 1]")
        require(1 <= self.tastes <= self.categories, "tastes",
                f"must be in [1, categories = {self.categories}], got {self.tastes}")
        require(0.0 <= self.successor <= 1.0, "successor", "must be in [0, 1]")
        require(0.0 < self.new_session <= 1.0, "new_session", "must be in (0, 1]")


def interactions(spec: LogSpec) -> pa.Table:
    """The whole log as one table, rows shuffled (a log's order carries no meaning)."""
    rng = np.random.default_rng([spec.seed, 42])
    s, loc, scale = LOGNORMAL_LENGTHS[spec.lengths]
    counts = np.clip(np.rint(loc + scale * rng.lognormal(0.0, s, spec.users)), spec.min_per_user, spec.max_per_user)
    counts = counts.astype(np.int64)
    total = int(counts.sum())
    owner = np.repeat(np.arange(spec.users), counts)
    k = spec.categories
    preferred = rng.integers(0, k, spec.users)[:, None]  # [users, tastes]: the categories each user prefers
    on_topic = rng.random(total) < spec.on_topic
    taste = preferred[owner, 0]
    if spec.tastes > 1:  # a generator of its own: a log of one taste is the same as before tastes existed
        extra = np.random.default_rng([spec.seed, 44])
        preferred = np.argsort(extra.random((spec.users, k)), axis=1)[:, :spec.tastes]
        taste = preferred[owner, extra.integers(0, spec.tastes, total)]
    category = np.where(on_topic, taste, rng.integers(0, k, total))
    per_category = spec.items // k
    weights = np.arange(1, per_category + 1, dtype=np.float64) ** (-spec.item_zipf_alpha)
    rank = np.minimum(np.searchsorted(np.cumsum(weights / weights.sum()), rng.random(total)), per_category - 1)
    item = category + k * rank
    if spec.successor > 0:
        return _in_sessions(spec, rng, counts, owner, preferred, item)
    liked = (category[:, None] == preferred[owner]).any(axis=1)
    high = rng.random(total) < np.where(liked, 0.8, 0.2)
    rating = np.where(high, rng.integers(4, 6, total), rng.integers(1, 4, total)).astype(np.float64)
    start = rng.integers(956_703_932, 1_046_454_590, spec.users)  # MovieLens 1M's span of time
    gaps = rng.exponential(7_200.0, total).astype(np.int64) + 1
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    clock = np.cumsum(gaps)
    timestamp = start[owner] + clock - (clock[first] - gaps[first])[owner]
    order = rng.permutation(total)
    return pa.table({
        "userId": pa.array(owner[order] + 1), "movieId": pa.array(item[order] + 1),
        "rating": pa.array(rating[order]), "timestamp": pa.array(timestamp[order]),
    })


def _in_sessions(spec: LogSpec, rng: np.random.Generator, counts: np.ndarray, owner: np.ndarray,
                 preferred: np.ndarray, fresh: np.ndarray) -> pa.Table:
    """``successor > 0`` (module docstring): each user's interactions in order, position by position
    over all users at once; ``fresh`` holds the independent draws a non-successor interaction takes."""
    k, total = spec.categories, owner.size
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    item = fresh.copy()
    new_session = rng.random(total) < spec.new_session
    new_session[first] = True
    follow = ~new_session & (rng.random(total) < spec.successor)
    per_category = spec.items // k
    for t in range(1, int(counts.max())):
        at = first[counts > t] + t  # position t of every user that has one
        chained = at[follow[at]]
        previous = item[chained - 1]
        item[chained] = previous % k + k * ((previous // k + 1) % per_category)
    gaps = np.where(new_session, rng.exponential(172_800.0, total), rng.exponential(120.0, total)).astype(np.int64) + 1
    start = rng.integers(956_703_932, 1_046_454_590, spec.users)
    clock = np.cumsum(gaps)
    timestamp = start[owner] + clock - (clock[first] - gaps[first])[owner]
    liked = ((item % k)[:, None] == preferred[owner]).any(axis=1)
    high = rng.random(total) < np.where(liked, 0.8, 0.2)
    rating = np.where(high, rng.integers(4, 6, total), rng.integers(1, 4, total)).astype(np.float64)
    order = rng.permutation(total)
    return pa.table({
        "userId": pa.array(owner[order] + 1), "movieId": pa.array(item[order] + 1),
        "rating": pa.array(rating[order]), "timestamp": pa.array(timestamp[order]),
    })


def write_log(out: str | Path, spec: LogSpec) -> tuple[Path, int]:
    """Write the log to ``out`` (``.csv`` or ``.parquet`` by its suffix); returns the path and the row count."""
    try:
        spec.validate()
    except ConfigError as exc:
        raise ConfigError(f"gen-log: {exc}") from None
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = interactions(spec)
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        raise ConfigError(f"gen-log: --out must end in .csv or .parquet, got {path.name!r}")
    return path, table.num_rows
