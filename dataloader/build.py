"""Building the data side of a run from its ``[data]`` config: the source of the dataset's layout,
the epoch order, the planner, and the ``BalancedLoader`` over them (``loader.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow.compute as pc

from freescale.config import require
from freescale.dataloader import gather
from freescale.dataloader.balance_kernels import warm_up
from freescale.dataloader.cost import CostModel
from freescale.dataloader.loader import SPARSE_FEATURES, BalancedLoader
from freescale.dataloader.partition import check_size
from freescale.dataloader.planner import BatchPlanner, EpochOrder
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
        require(self.calibrate_every >= 0, "calibrate_every", f"must be >= 0, got {self.calibrate_every}")

    def cost_model(self, derived: CostModel) -> CostModel:
        """The configured coefficients, each falling back to ``derived`` when negative."""
        return CostModel(
            quadratic=self.cost_quadratic if self.cost_quadratic >= 0 else derived.quadratic,
            linear=self.cost_linear if self.cost_linear >= 0 else derived.linear,
            constant=self.cost_constant if self.cost_constant >= 0 else derived.constant,
        )


def open_source(cfg: DataConfig, split: str, columns: list[str]) -> ParquetSource | SequenceSource:
    """The reader of ``cfg.path``'s layout: one row per sample (format 1) or per user (format 2)."""
    cache = 2 * cfg.shuffle_row_groups + 2
    if DatasetManifest.read(cfg.path).format_version == SEQUENCE_FORMAT_VERSION:
        return SequenceSource(cfg.path, split, columns, max_seq_len=cfg.max_seq_len, on_bad_rows=cfg.on_bad_rows,
                              cache_row_groups=cache)
    return ParquetSource(cfg.path, split, columns, on_bad_rows=cfg.on_bad_rows, cache_row_groups=cache,
                         max_seq_len=cfg.max_seq_len)


def build_loader(
    cfg: DataConfig,
    split: str,
    *,
    rank: int,
    world_size: int,
    sparse_features: list[str],
    derived_cost: CostModel,
    seed: int,
    training: bool = True,
    pin_memory: bool = False,
    group_size: int | None = None,
    timestamps: bool = False,
    sampled_items: int = 0,
) -> BalancedLoader:
    """The training loader (shuffled, balanced, endless) or an evaluation one (one pass, in order, every
    sample: the last step also holds the rows short of a whole batch);
    ``timestamps``: its batches carry the history's and the candidates' timestamps; ``sampled_items``:
    that many uniform item ids a step as the feature ``sampled_item_ids`` (a retrieval model's negatives)."""
    warm_up()  # the planner's and the reads' kernels: loaded from numba's cache, or compiled here, not in the
    gather.warm_up()  # prefetch thread
    if training:
        window = max(cfg.window, 1)
        try:
            check_size(cfg.partitioner, cfg.batch_size * world_size * window, world_size * window, cfg.equal_count)
        except ValueError as exc:
            raise DataError(f"data.partitioner = '{cfg.partitioner}' at {world_size} ranks: {exc}") from None
    columns = {SPARSE_FEATURES[f][0] for f in sparse_features if SPARSE_FEATURES[f][0]} | {DENSE, LABEL}
    if timestamps:
        per_user = DatasetManifest.read(cfg.path).format_version == SEQUENCE_FORMAT_VERSION
        columns |= {HISTORY_TIMESTAMPS, *([CANDIDATE_TIMESTAMP] if per_user else [])}
    source = open_source(cfg, split, sorted(columns))
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
        max_seq_len=cfg.max_seq_len, prefetch=cfg.prefetch, epochs=None if training else 1, pin_memory=pin_memory,
        group_size=group_size, timestamps=timestamps, sampled_items=sampled_items, seed=seed,
    )


def item_counts(cfg: DataConfig) -> np.ndarray:
    """How often each item is a training target (int64 ``[num_items]``): format 1 counts the train
    split's candidates; format 2 the interactions at training positions ``1 .. train_end - 1`` (the
    held-out ones excluded).  Reads one or two small columns of every file."""
    manifest = DatasetManifest.read(cfg.path)
    source = open_source(cfg, "train", [CANDIDATE_ITEM])
    counts = np.zeros(manifest.num_items, dtype=np.int64)
    per_user = manifest.format_version == SEQUENCE_FORMAT_VERSION
    for table in source.read_column_per_file([ITEM_IDS, TRAIN_END] if per_user else [CANDIDATE_ITEM]):  # file by file
        if per_user:
            lists = table.column(ITEM_IDS).combine_chunks()
            lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
            position = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            end = np.repeat(table.column(TRAIN_END).to_numpy(), lengths)
            ids = lists.flatten().to_numpy()[(position >= 1) & (position < end)]
        else:
            ids = table.column(CANDIDATE_ITEM).to_numpy()
        counts += np.bincount(ids, minlength=manifest.num_items)[:manifest.num_items]
    return counts


__all__ = ["DataConfig", "build_loader", "item_counts", "open_source"]
