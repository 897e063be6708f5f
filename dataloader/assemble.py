"""A read's numpy columns -> one ``Batch`` per step, several steps in one pass.

The loader reads several steps' rows at once (``source.read_runs``: their samples back to back, step by
step).  Here the steps' batches are built from that one read without a loop over samples and with one copy
per kind of tensor for all the steps: the sparse features' values and lengths in one concatenation (step by
step, feature by feature: each step's KJT is one contiguous stretch), dense features, labels and costs
converted once; each step's tensors are then views of those (a step's batch keeps its steps' buffers alive:
a few batches' worth).  Per step, only the KJT and the ``Batch`` are built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from freescale.dataloader.batch import Batch
from freescale.dataloader.gather import Columns, Tails, as_array
from freescale.dataloader.schema import (
    CANDIDATE_ITEM,
    CANDIDATE_TIMESTAMP,
    DENSE,
    HISTORY_ITEMS,
    HISTORY_TIMESTAMPS,
    LABEL,
    SAMPLED_ITEMS,
    USER_ID,
)

# Sparse feature name -> (column, is a list column); no column: the loader makes it.
SPARSE_FEATURES: dict[str, tuple[str, bool]] = {
    HISTORY_ITEMS: (HISTORY_ITEMS, True),
    CANDIDATE_ITEM: (CANDIDATE_ITEM, False),
    USER_ID: (USER_ID, False),
    SAMPLED_ITEMS: ("", True),
}


@dataclass
class StepRows:
    """What each of several steps holds of a read, in order: samples, the summed loss's scale, (epoch, step)."""

    sizes: np.ndarray
    costs: np.ndarray
    """Every sample's cost, the steps' back to back."""
    loss_scales: list[float]
    when: list[tuple[int, int]]


@dataclass
class BatchAssembler:
    """This rank's batches from a read's columns (``read_arrays``/``read_runs``: a list column ``name`` has its
    per-sample lengths as ``name@``; histories already cut)."""

    sparse_features: list[str]
    dense_dim: int
    rank: int
    timestamps: bool = False
    sampled_items: int = 0
    num_items: int = 0
    seed: int = 0

    def batches(self, arrays: Columns, steps: StepRows) -> list[Batch]:
        """One batch per step of ``steps`` from ``arrays`` (their samples back to back)."""
        cuts = np.concatenate([[0], np.cumsum(steps.sizes)]).astype(np.int64)
        total = int(cuts[-1])
        values, lengths, value_cuts, length_cuts = self._sparse(arrays, cuts, steps.when)
        value_t, length_t = torch.from_numpy(values), torch.from_numpy(lengths)
        dense = (np.ascontiguousarray(as_array(arrays[DENSE]), dtype=np.float32).reshape(total, self.dense_dim) if total
                 else np.zeros((0, self.dense_dim), dtype=np.float32))
        labels = np.array(as_array(arrays[LABEL]), dtype=np.float32) if total else np.zeros(0, dtype=np.float32)
        dense_t, labels_t = torch.from_numpy(dense), torch.from_numpy(labels)
        costs_t = torch.from_numpy(np.ascontiguousarray(steps.costs, dtype=np.float32))
        if self.timestamps:
            history_t, candidate_t = _timestamps(arrays, total)
            time_cuts = np.concatenate([[0], np.cumsum(as_array(arrays[HISTORY_TIMESTAMPS + "@"]))])[cuts] if total else cuts
        out = []
        for j in range(cuts.size - 1):
            a, b = int(cuts[j]), int(cuts[j + 1])
            sparse = KeyedJaggedTensor(keys=self.sparse_features, values=value_t[value_cuts[j]:value_cuts[j + 1]],
                                       lengths=length_t[length_cuts[j]:length_cuts[j + 1]])
            batch = Batch(sparse=sparse, dense=dense_t[a:b], labels=labels_t[a:b], costs=costs_t[a:b],
                          loss_scale=steps.loss_scales[j])
            if self.timestamps:
                batch.history_timestamps = history_t[int(time_cuts[j]):int(time_cuts[j + 1])]
                batch.candidate_timestamps = candidate_t[a:b]
            out.append(batch)
        return out

    def _sparse(self, arrays: Columns, cuts: np.ndarray,
                when: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
        """Every step's KJT values and lengths, back to back (step by step, then feature by feature), int64, and
        where each step starts in them.  Each feature's values are copied once, straight to their place (a
        ``Tails`` per feature: a list column as the source left it, in place; a column already cut, as is)."""
        steps, total = cuts.size - 1, int(cuts[-1])
        columns = [self._tails(arrays, feature, cuts, when, total) for feature in self.sparse_features]
        if not columns:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), [0] * (steps + 1), [0] * (steps + 1)
        counts = np.empty((steps, len(columns)), dtype=np.int64)  # values of each (step, feature)
        for k, tails in enumerate(columns):
            counts[:, k] = np.diff(np.concatenate([[0], np.cumsum(tails.lengths)])[cuts])
        flat_starts = np.concatenate([[0], np.cumsum(counts.ravel())]).astype(np.int64)
        values = np.empty(int(flat_starts[-1]), dtype=np.int64)
        starts = flat_starts[:-1].reshape(steps, len(columns))
        for k, tails in enumerate(columns):
            tails.place(values, cuts, np.ascontiguousarray(starts[:, k]))
        sample_cuts = cuts.tolist()
        lengths = np.concatenate([tails.lengths[sample_cuts[j]:sample_cuts[j + 1]] for j in range(steps)
                                  for tails in columns]) if steps else np.zeros(0, dtype=np.int64)
        return values, lengths.astype(np.int64, copy=False), flat_starts[::len(columns)].tolist(), \
            (cuts * len(columns)).tolist()

    def _tails(self, arrays: Columns, feature: str, cuts: np.ndarray,
               when: list[tuple[int, int]], total: int) -> Tails:
        """Sparse ``feature``'s values over the read's samples, as ``Tails`` (a sample's values and its length)."""
        column, is_list = SPARSE_FEATURES[feature]
        if feature == SAMPLED_ITEMS:  # all of them under the step's first sample
            drawn = [self._sampled(when[j], int(cuts[j + 1] - cuts[j])) for j in range(cuts.size - 1)]
            return Tails.of_flat(np.concatenate([v for v, _ in drawn] or [np.zeros(0, dtype=np.int64)]),
                                 np.concatenate([n for _, n in drawn] or [np.zeros(0, dtype=np.int64)]))
        if not total:
            return Tails.of_flat(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        values = arrays[column]
        if isinstance(values, Tails):
            return values
        if is_list:  # the source cut it to the most recent max_seq_len (gather.py)
            return Tails.of_flat(values, as_array(arrays[column + "@"]))
        return Tails(np.ascontiguousarray(values), np.arange(1, total + 1, dtype=np.int64), np.ones(total, dtype=np.int64))

    def _sampled(self, when: tuple[int, int], samples: int) -> tuple[np.ndarray, np.ndarray]:
        """``sampled_items`` ids drawn from (seed, epoch, step, rank), all under the step's first sample (none for
        an empty step)."""
        lengths = np.zeros(samples, dtype=np.int64)
        if not samples:
            return np.zeros(0, dtype=np.int64), lengths
        rng = np.random.default_rng([self.seed, *when, self.rank])
        lengths[0] = self.sampled_items
        return rng.integers(0, self.num_items, self.sampled_items, dtype=np.int64), lengths


def _timestamps(arrays: Columns, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The history's timestamps (cut like its items) and each candidate's: the source's own where it
    has one (format 2), else the newest history timestamp (0 for an empty history)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    history = as_array(arrays[HISTORY_TIMESTAMPS]).astype(np.int64, copy=False)
    if CANDIDATE_TIMESTAMP in arrays:
        candidate = as_array(arrays[CANDIDATE_TIMESTAMP]).astype(np.int64, copy=False)
    else:
        lengths = as_array(arrays[HISTORY_TIMESTAMPS + "@"])
        last = np.cumsum(lengths) - 1
        candidate = np.where(lengths > 0, history[np.clip(last, 0, None)] if history.size else 0, 0)
    return torch.from_numpy(np.ascontiguousarray(history)), torch.from_numpy(np.array(candidate, dtype=np.int64))


__all__ = ["SPARSE_FEATURES", "BatchAssembler", "StepRows"]
