"""Building the data side of a run from its ``[data]`` config: the dataset opened once (``Dataset``: its
manifest), the source of its layout, the epoch order, the planner, and the ``BalancedLoader`` over them
(``loader.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc

from freescale.config import require
from freescale.dataloader import gather, read_ahead, row_checks, sequence_source
from freescale.dataloader.assemble import SPARSE_FEATURES
from freescale.dataloader.balance_kernels import warm_up
from freescale.dataloader.cost import CostModel
from freescale.dataloader.epoch_order import EpochOrder
from freescale.dataloader.loader import BalancedLoader
from freescale.dataloader.partition import check_size
from freescale.dataloader.planner import BatchPlanner
from freescale.dataloader.schema import (
    CANDIDATE_ITEM,
    CANDIDATE_TIMESTAMP,
    DENSE,
    HISTORY_TIMESTAMPS,
    ITEM_IDS,
    LABEL,
    SEQUENCE_FORMAT_VERSION,
    TRAIN_END,
    DataError,
    DatasetManifest,
)
from freescale.dataloader.sequence_source import SequenceSource
from freescale.dataloader.source import ParquetSource


@dataclass
class DataConfig:
    path: str = "data/demo"
    """Dataset directory: a local path or a pyarrow filesystem URI (s3://, gs://, hdfs://)."""
    batch_size: int = 64
    """Samples per rank per step on average; the global batch is batch_size x ranks at start."""
    max_seq_len: int = 64
    """History items kept per sample (the most recent); longer histories are truncated."""
    shuffle: bool = True
    partitioner: Literal["round_robin", "token_kk", "lpt", "kk"] = "lpt"
    equal_count: bool = False
    """Give every rank the same number of samples (balancing cost within that constraint)."""
    window: int = 1
    """Global batches planned together; > 1 groups the heaviest samples into the same steps."""
    shuffle_row_groups: int = 8
    """Row groups whose rows are shuffled together (the reads of a step stay within them)."""
    locality: bool = False
    """Plan for reads: each rank's share of a window is one contiguous run of storage cut at equal
    cost, then split into the window's steps, so a rank decodes about the bytes it trains on
    instead of most of the window's row groups (use with window > 1 at many ranks; planner.py)."""
    prefetch: int = 2
    """Batches prepared ahead on a background thread; 0 prepares them inline."""
    read_ahead: int = 8
    """Row groups read and decoded to Arrow ahead of the reads, on a thread of their own, at most this many waiting
    (with ``prefetch`` > 0 and without ``locality``; 0: none): the decode, and a remote filesystem's wait for bytes,
    overlap building the batches.  Memory: this many row groups' Arrow tables (the columns read and checked)."""
    on_bad_rows: Literal["error", "skip"] = "error"
    cost_quadratic: float = -1.0
    """Cost model ``a*L^2 + b*L + c0``; negative values mean: derive from the model's dimensions."""
    cost_linear: float = -1.0
    cost_constant: float = -1.0
    calibrate_every: int = 0
    """Every this many steps, refit the cost model to the ranks' measured compute times
    (``cost.calibrate``) and plan with it from the next window on; 0 = never."""

    def validate(self) -> None:
        require(bool(self.path), "path", "must name a dataset directory")
        require(self.batch_size > 0, "batch_size", f"must be positive, got {self.batch_size}")
        require(self.max_seq_len > 0, "max_seq_len", f"must be positive, got {self.max_seq_len}")
        require(self.window >= 1, "window", f"must be >= 1, got {self.window}")
        require(
            self.window == 1 or (self.partitioner != "round_robin" and not self.equal_count),
            "window", "> 1 needs a cost-balancing partitioner (lpt, kk, token_kk) and equal_count = false",
        )
        require(self.shuffle_row_groups >= 1, "shuffle_row_groups", "must be >= 1")
        require(not (self.locality and self.equal_count), "locality", "cuts shares by cost: set equal_count = false")
        require(not self.locality or self.partitioner == "lpt", "locality",
                f"plans with its own cut and LPT: set partitioner = 'lpt' (got '{self.partitioner}')")
        require(self.prefetch >= 0, "prefetch", f"must be >= 0, got {self.prefetch}")
        require(self.read_ahead >= 0, "read_ahead", f"must be >= 0, got {self.read_ahead}")
        require(self.calibrate_every >= 0, "calibrate_every", f"must be >= 0, got {self.calibrate_every}")

    def cost_model(self, derived: CostModel) -> CostModel:
        """The configured coefficients, each falling back to ``derived`` when negative."""
        return CostModel(
            quadratic=self.cost_quadratic if self.cost_quadratic >= 0 else derived.quadratic,
            linear=self.cost_linear if self.cost_linear >= 0 else derived.linear,
            constant=self.cost_constant if self.cost_constant >= 0 else derived.constant,
        )


class Dataset:
    """A dataset opened once per rank: its manifest read once, and what a run builds from it (the sources
    of its splits, the loaders over them, the item counts of a retrieval model)."""

    def __init__(self, cfg: DataConfig, manifest: DatasetManifest | None = None) -> None:
        self.cfg = cfg
        self.manifest = manifest if manifest is not None else DatasetManifest.read(cfg.path)

    @property
    def per_user(self) -> bool:
        """Format 2: one row per user (``freescale prepare``); else one row per sample."""
        return self.manifest.format_version == SEQUENCE_FORMAT_VERSION

    def samples(self, split: str) -> int:
        """Samples in ``split`` as the manifest counts them (0 if it has none)."""
        return int(self.manifest.samples.get(split, self.manifest.rows.get(split, 0)))

    def source(self, split: str, columns: list[str]) -> ParquetSource | SequenceSource:
        """The reader of ``split``'s layout: one row per sample (format 1) or per user (format 2)."""
        cfg, cache = self.cfg, 2 * self.cfg.shuffle_row_groups + 2
        if self.per_user:
            return SequenceSource(cfg.path, split, columns, max_seq_len=cfg.max_seq_len, on_bad_rows=cfg.on_bad_rows,
                                  cache_row_groups=cache, manifest=self.manifest)
        return ParquetSource(cfg.path, split, columns, on_bad_rows=cfg.on_bad_rows, cache_row_groups=cache,
                             max_seq_len=cfg.max_seq_len, manifest=self.manifest)

    def loader(self, split: str, *, rank: int, world_size: int, sparse_features: list[str], derived_cost: CostModel,
               seed: int, training: bool = True, pin_memory: bool = False, group_size: int | None = None,
               timestamps: bool = False, sampled_items: int = 0) -> BalancedLoader:
        """The training loader (shuffled, balanced, endless) or an evaluation one (one pass, in order, every
        sample: the last step also holds the rows short of a whole batch);
        ``timestamps``: its batches carry the history's and the candidates' timestamps; ``sampled_items``:
        that many uniform item ids a step as the feature ``sampled_item_ids`` (a retrieval model's negatives)."""
        cfg = self.cfg
        warm_up()  # the planner's and the reads' kernels: loaded from numba's cache, or compiled here, not in the
        gather.warm_up()  # prefetch thread
        row_checks.warm_up()
        sequence_source.warm_up()
        read_ahead.warm_up()
        if training:
            window = max(cfg.window, 1)
            try:
                check_size(cfg.partitioner, cfg.batch_size * world_size * window, world_size * window, cfg.equal_count)
            except ValueError as exc:
                raise DataError(f"data.partitioner = '{cfg.partitioner}' at {world_size} ranks: {exc}") from None
        columns = {SPARSE_FEATURES[f][0] for f in sparse_features if SPARSE_FEATURES[f][0]} | {DENSE, LABEL}
        if timestamps:
            columns |= {HISTORY_TIMESTAMPS, *([CANDIDATE_TIMESTAMP] if self.per_user else [])}
        source = self.source(split, sorted(columns))
        order = EpochOrder(source.rg_rows, seed=seed, shuffle=cfg.shuffle and training,
                           window_row_groups=cfg.shuffle_row_groups)
        planner = BatchPlanner(
            source.lengths, order, cost_model=cfg.cost_model(derived_cost),
            partitioner=cfg.partitioner if training else "round_robin",
            global_batch_size=cfg.batch_size * world_size, window=cfg.window if training else 1,
            equal_count=cfg.equal_count and training, max_seq_len=cfg.max_seq_len, locality=cfg.locality and training,
            keep_partial=not training,
        )
        return BalancedLoader(
            source, planner, rank=rank, live_ranks=list(range(world_size)), sparse_features=sparse_features,
            max_seq_len=cfg.max_seq_len, prefetch=cfg.prefetch, read_ahead=cfg.read_ahead,
            epochs=None if training else 1, pin_memory=pin_memory,
            group_size=group_size, timestamps=timestamps, sampled_items=sampled_items, seed=seed,
        )

    def item_counts(self) -> np.ndarray:
        """How often each item is a training target (int64 ``[num_items]``): format 1 counts the train
        split's candidates; format 2 the interactions at training positions ``1 .. train_end - 1`` (the
        held-out ones excluded).  Reads one or two small columns of every file."""
        num_items, per_user = self.manifest.num_items, self.per_user
        source = self.source("train", [CANDIDATE_ITEM])
        counts = np.zeros(num_items, dtype=np.int64)
        for table in source.read_column_per_file([ITEM_IDS, TRAIN_END] if per_user else [CANDIDATE_ITEM]):  # per file
            if per_user:
                lists = table.column(ITEM_IDS).combine_chunks()
                lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
                position = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
                end = np.repeat(table.column(TRAIN_END).to_numpy(), lengths)
                ids = lists.flatten().to_numpy()[(position >= 1) & (position < end)]
            else:
                ids = table.column(CANDIDATE_ITEM).to_numpy()
            counts += np.bincount(ids, minlength=num_items)[:num_items]
        return counts


def build_loader(cfg: DataConfig, split: str, **kwargs: Any) -> BalancedLoader:
    """``Dataset(cfg).loader(split, ...)``: a loader of its own (tools and tests; a run opens its ``Dataset`` once)."""
    return Dataset(cfg).loader(split, **kwargs)


def item_counts(cfg: DataConfig) -> np.ndarray:
    """``Dataset(cfg).item_counts()``."""
    return Dataset(cfg).item_counts()


__all__ = ["DataConfig", "Dataset", "build_loader", "item_counts"]
