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


HIGH_IF_LIKED, HIGH_IF_NOT = 0.8, 0.2
"""The chance an interaction is rated 4 or 5: with one of the user's preferred categories, or any other."""
SESSION_GAP_S = 120.0
"""Mean gap (seconds) between interactions of one session; a new session starts ``NEW_SESSION_GAP_S`` later."""
NEW_SESSION_GAP_S = 172_800.0


def _users(spec: LogSpec) -> tuple[np.random.Generator, np.ndarray, np.ndarray, np.random.Generator | None]:
    """The per-user draws: (the log's generator, interactions per user, each user's preferred categories
    ``[users, tastes]``, the tastes' own generator when ``tastes > 1``), in the order ``interactions`` takes them."""
    rng = np.random.default_rng([spec.seed, 42])
    s, loc, scale = LOGNORMAL_LENGTHS[spec.lengths]
    counts = np.clip(np.rint(loc + scale * rng.lognormal(0.0, s, spec.users)), spec.min_per_user, spec.max_per_user)
    preferred = rng.integers(0, spec.categories, spec.users)[:, None]
    extra = None
    if spec.tastes > 1:  # a generator of its own: a log of one taste is the same as before tastes existed
        extra = np.random.default_rng([spec.seed, 44])
        preferred = np.argsort(extra.random((spec.users, spec.categories)), axis=1)[:, :spec.tastes]
    return rng, counts.astype(np.int64), preferred, extra


def _rank_probabilities(spec: LogSpec) -> np.ndarray:
    """The chance of each popularity rank within a category (Zipf over ``items // categories`` ranks)."""
    weights = np.arange(1, spec.items // spec.categories + 1, dtype=np.float64) ** (-spec.item_zipf_alpha)
    return weights / weights.sum()


def interactions(spec: LogSpec) -> pa.Table:
    """The whole log as one table, rows shuffled (a log's order carries no meaning)."""
    rng, counts, preferred, extra = _users(spec)
    total = int(counts.sum())
    owner = np.repeat(np.arange(spec.users), counts)
    k = spec.categories
    on_topic = rng.random(total) < spec.on_topic
    taste = preferred[owner, 0] if extra is None else preferred[owner, extra.integers(0, spec.tastes, total)]
    category = np.where(on_topic, taste, rng.integers(0, k, total))
    per_category = spec.items // k
    rank = np.minimum(np.searchsorted(np.cumsum(_rank_probabilities(spec)), rng.random(total)), per_category - 1)
    item = category + k * rank
    if spec.successor > 0:
        return _in_sessions(spec, rng, counts, owner, preferred, item)
    high = rng.random(total) < _like_chance(spec, preferred[owner], item)
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
    total = owner.size
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    item = fresh.copy()
    new_session = rng.random(total) < spec.new_session
    new_session[first] = True
    follow = ~new_session & (rng.random(total) < spec.successor)
    for t in range(1, int(counts.max())):
        at = first[counts > t] + t  # position t of every user that has one
        chained = at[follow[at]]
        item[chained] = successor_of(spec, item[chained - 1])
    gaps = np.where(new_session, rng.exponential(NEW_SESSION_GAP_S, total), rng.exponential(SESSION_GAP_S, total)).astype(np.int64) + 1
    start = rng.integers(956_703_932, 1_046_454_590, spec.users)
    clock = np.cumsum(gaps)
    timestamp = start[owner] + clock - (clock[first] - gaps[first])[owner]
    high = rng.random(total) < _like_chance(spec, preferred[owner], item)
    rating = np.where(high, rng.integers(4, 6, total), rng.integers(1, 4, total)).astype(np.float64)
    order = rng.permutation(total)
    return pa.table({
        "userId": pa.array(owner[order] + 1), "movieId": pa.array(item[order] + 1),
        "rating": pa.array(rating[order]), "timestamp": pa.array(timestamp[order]),
    })


def successor_of(spec: LogSpec, items: np.ndarray) -> np.ndarray:
    """The fixed successor of each item (0-based ids): the next item of its category, by popularity rank."""
    k, per_category = spec.categories, spec.items // spec.categories
    return items % k + k * ((items // k + 1) % per_category)


def next_item_odds(spec: LogSpec, users: np.ndarray, last_items: np.ndarray,
                   gaps_s: np.ndarray | None = None) -> np.ndarray:
    """The generator's own chance of each item (0-based ids) being each user's next, ``[len(users), items]``:
    the Bayes-optimal scores, which no model of the log can beat (users and items 0-based, as drawn).

    ``last_items``: each user's latest interaction; ``gaps_s``: seconds from it to the one asked about
    (its chance of starting a new session follows from the two gap distributions); without them, the
    prior chance of a new session.  A fresh draw is a category (one of the user's tastes with chance
    ``on_topic``, else any) then an item of it by popularity rank."""
    _, _, preferred, _ = _users(spec)
    k = spec.categories
    category_odds = np.full((users.size, k), (1 - spec.on_topic) / k)
    np.add.at(category_odds, (np.arange(users.size)[:, None], preferred[users]), spec.on_topic / spec.tastes)
    ranks = _rank_probabilities(spec)
    item = np.arange(spec.items)
    inside = item < k * ranks.size  # the ids past the last full category are never drawn
    fresh = np.where(inside, category_odds[:, item % k] * ranks[np.minimum(item // k, ranks.size - 1)], 0.0)
    if spec.successor <= 0:
        return fresh
    new = np.full(users.size, spec.new_session)
    if gaps_s is not None:  # gaps are 1 + floor(an exponential draw): compare the two laws' log chances
        g = np.asarray(gaps_s, dtype=np.float64) - 1

        def log_chance(mean: float) -> np.ndarray:
            return -g / mean + np.log1p(-np.exp(-1 / mean))

        odds = np.log(spec.new_session) + log_chance(NEW_SESSION_GAP_S) - (
            np.log1p(-spec.new_session) + log_chance(SESSION_GAP_S))
        new = 1 / (1 + np.exp(-np.clip(odds, -700, 700)))
    follow = (1 - new) * spec.successor
    odds_out = (1 - follow)[:, None] * fresh
    odds_out[np.arange(users.size), successor_of(spec, np.asarray(last_items))] += follow
    return odds_out


def like_odds(spec: LogSpec, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """The generator's chance that each (user, item) interaction is rated 4 or 5 (0-based ids): the
    Bayes-optimal click score."""
    return _like_chance(spec, _users(spec)[2][users], items)


def _like_chance(spec: LogSpec, preferred: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Per interaction, the chance of a 4 or 5: ``items`` (0-based) against the user's ``preferred`` categories
    (one row per interaction)."""
    liked = ((items % spec.categories)[:, None] == preferred).any(axis=1)
    return np.where(liked, HIGH_IF_LIKED, HIGH_IF_NOT)


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
