"""Synthetic sequence-recommendation data with a planted, learnable signal.

Every user prefers one item category.  Most of the items in the user's history
come from that category (``history_affinity``), and the click label depends
mostly on whether the candidate item belongs to it, a little on the dense
features.  A model therefore has to read the history (or its pooled embedding)
to score well: dense features alone reach an AUC of about 0.6, the history and
candidate together about 0.85.  Item popularity inside a category is Zipf;
history lengths follow the named distribution, clipped to ``[1, max_len]``.

All of it is vectorized numpy (no per-row Python), deterministic by seed, and
written as Parquet through pyarrow with the schema in ``schema.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from freescale.config import ConfigError, require
from freescale.dataloader.schema import HISTORY_LENGTH, DatasetManifest, sample_schema

# scipy.stats.lognorm(s, loc, scale) fits of per-user history lengths (ANCHORS.md).
LOGNORMAL_LENGTHS: dict[str, tuple[float, float, float]] = {
    "ml-1m": (1.387, 17.7, 67.3),
    "ml-20m": (1.608, 19.1, 43.2),
}
LENGTH_DISTRIBUTIONS = (*LOGNORMAL_LENGTHS, "zipf", "uniform")


@dataclass
class SyntheticSpec:
    rows: int = 40_000
    eval_rows: int = 8_192
    valid_rows: int = 0
    """Rows of a ``valid`` split (validation during training), drawn like the others; 0: none."""
    num_items: int = 2_000
    num_users: int = 5_000
    num_categories: int = 16
    dense_dim: int = 8
    max_len: int = 64
    lengths: str = "ml-20m"
    zipf_alpha: float = 1.1
    """Exponent of the ``zipf`` length distribution (heavier tail as it nears 1)."""
    item_zipf_alpha: float = 1.05
    history_affinity: float = 0.8
    seed: int = 0
    rows_per_file: int = 1_000_000
    row_group_size: int = 8_192

    def validate(self) -> None:
        require(self.rows > 0, "rows", f"must be positive, got {self.rows}")
        require(self.eval_rows >= 0, "eval_rows", f"must be >= 0, got {self.eval_rows}")
        require(self.valid_rows >= 0, "valid_rows", f"must be >= 0, got {self.valid_rows}")
        require(self.num_categories >= 2, "num_categories", f"must be >= 2, got {self.num_categories}")
        require(
            self.num_items >= self.num_categories,
            "num_items",
            f"must be >= num_categories ({self.num_categories}), got {self.num_items}",
        )
        require(self.num_users > 0, "num_users", f"must be positive, got {self.num_users}")
        require(self.dense_dim > 0, "dense_dim", f"must be positive, got {self.dense_dim}")
        require(self.max_len >= 1, "max_len", f"must be >= 1, got {self.max_len}")
        require(
            self.lengths in LENGTH_DISTRIBUTIONS,
            "lengths",
            f"must be one of {', '.join(LENGTH_DISTRIBUTIONS)}, got {self.lengths!r}",
        )
        require(self.zipf_alpha > 1.0, "zipf_alpha", f"must be > 1, got {self.zipf_alpha}")
        require(0.0 <= self.history_affinity <= 1.0, "history_affinity", "must be in [0, 1]")
        require(self.rows_per_file > 0 and self.row_group_size > 0, "rows_per_file", "must be positive")


def sample_lengths(
    rng: np.random.Generator, n: int, distribution: str, max_len: int, zipf_alpha: float = 1.1
) -> np.ndarray:
    """History lengths, int64, clipped to ``[1, max_len]``."""
    if distribution == "uniform":
        return rng.integers(1, max_len + 1, size=n, dtype=np.int64)
    if distribution == "zipf":
        return np.minimum(rng.zipf(zipf_alpha, size=n), max_len).astype(np.int64)
    s, loc, scale = LOGNORMAL_LENGTHS[distribution]
    raw = loc + scale * rng.lognormal(mean=0.0, sigma=s, size=n)
    return np.clip(np.rint(raw), 1, max_len).astype(np.int64)


class _World:
    """The hidden structure shared by train and eval: categories, preferences, weights."""

    def __init__(self, spec: SyntheticSpec) -> None:
        rng = np.random.default_rng([spec.seed, 0])
        self.spec = spec
        self.items_per_category = spec.num_items // spec.num_categories
        ranks = np.arange(1, self.items_per_category + 1, dtype=np.float64)
        weights = ranks ** (-spec.item_zipf_alpha)
        self.rank_cdf = np.cumsum(weights / weights.sum())
        self.user_category = rng.integers(0, spec.num_categories, size=spec.num_users)
        self.dense_weight = rng.normal(0.0, 1.0, size=spec.dense_dim) / np.sqrt(spec.dense_dim)

    def items_in(self, rng: np.random.Generator, categories: np.ndarray) -> np.ndarray:
        """Popularity-weighted item of each given category (item ``i`` has category ``i % K``)."""
        rank = np.searchsorted(self.rank_cdf, rng.random(categories.shape[0]), side="right")
        rank = np.minimum(rank, self.items_per_category - 1)
        return categories + self.spec.num_categories * rank

    def rows(self, rng: np.random.Generator, n: int) -> pa.Table:
        spec = self.spec
        k = spec.num_categories
        user = rng.integers(0, spec.num_users, size=n, dtype=np.int64)
        pref = self.user_category[user]

        lengths = sample_lengths(rng, n, spec.lengths, spec.max_len, spec.zipf_alpha)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        owner = np.repeat(np.arange(n), lengths)
        on_topic = rng.random(total) < spec.history_affinity
        token_category = np.where(on_topic, pref[owner], rng.integers(0, k, size=total))
        history = self.items_in(rng, token_category).astype(np.int64)

        gaps = rng.exponential(3600.0, size=total).astype(np.int64) + 1
        clock = np.cumsum(gaps)
        start = rng.integers(1_500_000_000, 1_600_000_000, size=n, dtype=np.int64)
        before = np.concatenate([[0], clock])[offsets[:-1]]
        timestamps = start[owner] + clock - before[owner]

        candidate_category = np.where(rng.random(n) < 0.5, pref, rng.integers(0, k, size=n))
        candidate = self.items_in(rng, candidate_category).astype(np.int64)
        dense = rng.normal(0.0, 1.0, size=(n, spec.dense_dim)).astype(np.float32)
        logit = 2.0 * np.where(candidate_category == pref, 1.0, -1.0) + 0.75 * (dense @ self.dense_weight)
        label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)

        list_offsets = pa.array(offsets.astype(np.int32))
        return pa.Table.from_arrays(
            [
                pa.array(user),
                pa.ListArray.from_arrays(list_offsets, pa.array(history)),
                pa.ListArray.from_arrays(list_offsets, pa.array(timestamps)),
                pa.array(candidate),
                pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), spec.dense_dim),
                pa.array(label),
                pa.array(lengths.astype(np.int32)),
            ],
            schema=sample_schema(spec.dense_dim).append(pa.field(HISTORY_LENGTH, pa.int32(), nullable=False)),
        )


def generate(out: str | Path, spec: SyntheticSpec) -> DatasetManifest:
    """Write ``train-*.parquet``, ``eval-*.parquet`` (``valid-*.parquet`` with ``valid_rows``) and ``dataset.json``
    under ``out``.  Each split draws from its own generator: adding a validation split changes no other."""
    try:
        spec.validate()
    except ConfigError as exc:
        raise ConfigError(f"gen-data: {exc}") from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    world = _World(spec)
    manifest = DatasetManifest(
        num_items=spec.num_items,
        num_users=spec.num_users,
        dense_dim=spec.dense_dim,
        max_len=spec.max_len,
        generator={"name": "freescale.synthetic", **asdict(spec)},
    )
    splits = [("train", spec.rows), ("eval", spec.eval_rows), *([("valid", spec.valid_rows)] if spec.valid_rows else [])]
    for split_index, (split, n_rows) in enumerate(splits):
        rng = np.random.default_rng([spec.seed, 1, split_index])
        names: list[str] = []
        for file_index, start in enumerate(range(0, n_rows, spec.rows_per_file)):
            n = min(spec.rows_per_file, n_rows - start)
            name = f"{split}-{file_index:05d}.parquet"
            tmp = out / (name + ".tmp")
            pq.write_table(world.rows(rng, n), tmp, row_group_size=spec.row_group_size)
            tmp.replace(out / name)
            names.append(name)
        manifest.splits[split] = names
        manifest.rows[split] = n_rows
    manifest.write(out)
    return manifest
