"""A read's numpy columns -> one ``Batch`` per step, several steps in one pass.

The loader reads several steps' rows at once (``source.read_runs``: their samples back to back, step by
step).  Here the steps' batches are built from that one read without a loop over samples and with one buffer
per kind of tensor for all the steps: the sparse features' values and lengths (step by step, feature by
feature: each step's KJT is one contiguous stretch), every value copied once straight to its place (a
history the source left in its buffers, ``read_runs(uncut=True)``: format 2's slots, format 1's row groups piece
by piece, cut into it there), dense features, labels and costs converted once; each step's tensors are then
views of those (a step's batch keeps its steps' buffers alive: a few batches' worth; the values' buffer is reused
once none does, ``buffer_pool.py``).  Per step, only the KJT and the ``Batch`` are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from freescale.dataloader.batch import Batch
from freescale.dataloader.buffer_pool import BufferPool
from freescale.dataloader.copy_thread import Copying, CopyThread, copy_all
from freescale.dataloader.gather import STEP_COPY_DTYPES, copy_runs, copy_tails, interleave_steps
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
    per-sample lengths as ``name@``; its values cut, or, from ``read_runs(uncut=True)``, its buffer ``name@src``
    (or one per piece of the samples from ``name@from`` on) and each sample's end in it ``name@end``, valid while
    the caller holds the source's ``read_lock``)."""

    sparse_features: list[str]
    dense_dim: int
    rank: int
    timestamps: bool = False
    sampled_items: int = 0
    num_items: int = 0
    seed: int = 0
    pool: BufferPool = field(default_factory=BufferPool)
    """Where each read's KJT values go (reused once its batches are gone)."""
    copier: CopyThread | None = None
    """Where a history left in one buffer (format 2's slots) is copied into the KJT values while the caller builds
    the batches' tensors and the steps' infos (``start_batches``, ``copy_thread.py``); None: on the caller's thread,
    first."""

    def batches(self, arrays: dict[str, np.ndarray], steps: StepRows) -> list[Batch]:
        """One batch per step of ``steps`` from ``arrays`` (their samples back to back)."""
        batches, copying = self.start_batches(arrays, steps)
        if copying is not None:
            copying.finish()
        return batches

    def start_batches(self, arrays: dict[str, np.ndarray], steps: StepRows) -> tuple[list[Batch], Copying | None]:
        """``batches``, and the copy still filling their KJT values (on ``copier``), if any: the batches may be
        handed out, and ``arrays`` let go of (the source's read lock released), only once it is ``finish``ed."""
        cuts = np.concatenate([[0], np.cumsum(steps.sizes)]).astype(np.int64)
        deferred: list[tuple[np.ndarray, ...]] = []
        sparse = self._sparse(arrays, cuts, steps.when, deferred)
        copying = None
        if self.copier is not None:
            copying = self.copier.start(deferred)
        else:
            copy_all(deferred)
        try:
            return self._built(arrays, steps, cuts, *sparse), copying
        except BaseException:  # (a failure while the copy runs waits for it: its buffer is not handed out meanwhile)
            if copying is not None:
                copying.finish()
            raise

    def _built(self, arrays: dict[str, np.ndarray], steps: StepRows, cuts: np.ndarray, values: np.ndarray,
               lengths: np.ndarray, value_cuts: list[int], length_cuts: list[int], per_key: list[list[int]]
               ) -> list[Batch]:
        """Each step's ``Batch``: views of the read's tensors (``_sparse``'s values and lengths, and the dense
        features, labels and costs converted here once)."""
        total = int(cuts[-1])
        value_t, length_t = torch.from_numpy(values), torch.from_numpy(lengths)
        dense = (np.ascontiguousarray(arrays[DENSE], dtype=np.float32).reshape(total, self.dense_dim) if total
                 else np.zeros((0, self.dense_dim), dtype=np.float32))
        labels = np.array(arrays[LABEL], dtype=np.float32) if total else np.zeros(0, dtype=np.float32)
        dense_t, labels_t = torch.from_numpy(dense), torch.from_numpy(labels)
        costs_t = torch.from_numpy(np.ascontiguousarray(steps.costs, dtype=np.float32))
        if self.timestamps:
            history_t, candidate_t = _timestamps(arrays, total)
            time_cuts = np.concatenate([[0], np.cumsum(arrays[HISTORY_TIMESTAMPS + "@"])])[cuts] if total else cuts
        sizes = np.diff(cuts).tolist()  # each step's tensors: views of the read's, split in one call per tensor
        by_step = zip(value_t.split_with_sizes(np.diff(value_cuts).tolist()),
                      length_t.split_with_sizes(np.diff(length_cuts).tolist()), dense_t.split_with_sizes(sizes),
                      labels_t.split_with_sizes(sizes), costs_t.split_with_sizes(sizes), steps.loss_scales, sizes,
                      per_key)
        # Each KJT carries its stride and values per key, known here: torchrec otherwise sums its lengths for them
        # (``length_per_key``) when its input dist splits it by table, a device sync on a GPU.
        out = [Batch(sparse=KeyedJaggedTensor(keys=self.sparse_features, values=values, lengths=lengths, stride=size,
                                              length_per_key=counts, offset_per_key=[0, *accumulate(counts)]),
                     dense=dense, labels=labels, costs=costs, loss_scale=scale)
               for values, lengths, dense, labels, costs, scale, size, counts in by_step]
        if self.timestamps:
            time_sizes = np.diff(time_cuts).tolist()
            for batch, history, candidate in zip(out, history_t.split_with_sizes(time_sizes),
                                                 candidate_t.split_with_sizes(sizes)):
                batch.history_timestamps, batch.candidate_timestamps = history, candidate
        return out

    def _sparse(self, arrays: dict[str, np.ndarray], cuts: np.ndarray, when: list[tuple[int, int]],
                deferred: list[tuple[np.ndarray, ...]]
                ) -> tuple[np.ndarray, np.ndarray, list[int], list[int], list[list[int]]]:
        """Every step's KJT values and lengths, back to back (step by step, then feature by feature), int64,
        where each step's start in them, and each step's count of values per feature.  Each value is copied once,
        straight to its place: a history the source left uncut (``read_runs(uncut=True)``: its buffer, or one per
        piece of the samples, and each sample's end in it) is cut into it there (``copy_tails``), where gathering
        it first and concatenating the steps' pieces after copied it twice; from one buffer, that copy's arguments
        go to ``deferred`` (made by the caller, on the ``copier`` or at once)."""
        steps, total, features = cuts.size - 1, int(cuts[-1]), len(self.sparse_features)
        sizes = np.diff(cuts)
        counts = np.zeros((steps, features), dtype=np.int64)  # values of each (step, feature)
        per_sample: list[np.ndarray] = []  # each feature's lengths, every sample's
        drawn: list[tuple[np.ndarray, np.ndarray]] = []
        for f, feature in enumerate(self.sparse_features):
            column, is_list = SPARSE_FEATURES[feature]
            if feature == SAMPLED_ITEMS:  # all of them under the rank's first sample
                drawn = [self._sampled(when[j], int(sizes[j])) for j in range(steps)]
                counts[:, f] = [values.size for values, _ in drawn]
                per_sample.append(np.concatenate([n for _, n in drawn]) if steps else np.zeros(0, dtype=np.int64))
            elif is_list:  # the source cut it to the most recent max_seq_len (gather.py), or says where to
                lengths = arrays[column + "@"] if total else np.zeros(0, dtype=np.int64)
                counts[:, f] = np.diff(np.concatenate([[0], np.cumsum(lengths)])[cuts])
                per_sample.append(lengths)
            else:
                counts[:, f] = sizes
                per_sample.append(np.ones(total, dtype=np.int64))
        starts = np.concatenate([[0], np.cumsum(counts.ravel())]).astype(np.int64)
        values = self.pool.take(int(starts[-1]), np.int64)
        at, bounds = starts.tolist(), cuts.tolist()
        for f, feature in enumerate(self.sparse_features):
            column, is_list = SPARSE_FEATURES[feature]
            step_starts = np.ascontiguousarray(starts[f:-1:features])  # (where each step's values of this feature go)
            if feature == SAMPLED_ITEMS:
                for j in range(steps):
                    values[at[j * features + f]:at[j * features + f + 1]] = drawn[j][0]
            elif is_list and column + "@end" in arrays:
                ends, lengths = arrays[column + "@end"], per_sample[f]
                src = arrays[column + "@src"]
                if src.dtype in STEP_COPY_DTYPES:  # (one buffer, format 2's slots: every step in one call)
                    deferred.append((src, ends, lengths, values, cuts, step_starts))
                    continue
                pieces = _pieces(arrays, column, total)
                for j in range(steps):  # (the pieces in sample order: a step's lie from where the last one's ended)
                    a, b, pos = bounds[j], bounds[j + 1], at[j * features + f]
                    while a < b:
                        src, last = pieces[-1]
                        if last <= a:
                            pieces.pop()
                            continue
                        cut = min(b, last)
                        pos = copy_tails(src, ends[a:cut], lengths[a:cut], values, pos)
                        a = cut
            else:
                flat = arrays[column] if total else np.zeros(0, dtype=np.int64)
                source_at = np.concatenate([[0], np.cumsum(counts[:, f])]).astype(np.int64)
                if flat.dtype in STEP_COPY_DTYPES:
                    copy_runs(np.ascontiguousarray(flat), source_at, values, step_starts)
                    continue
                source_bounds = source_at.tolist()
                for j in range(steps):
                    values[at[j * features + f]:at[j * features + f + 1]] = flat[source_bounds[j]:source_bounds[j + 1]]
        by_feature = np.stack(per_sample).astype(np.int64, copy=False) if features else np.zeros((0, total), np.int64)
        lengths_out = interleave_steps(np.ascontiguousarray(by_feature), cuts)
        value_cuts = starts[::features].tolist() if features else [0] * (steps + 1)
        return values, lengths_out, value_cuts, (cuts * features).tolist(), counts.tolist()

    def _sampled(self, when: tuple[int, int], samples: int) -> tuple[np.ndarray, np.ndarray]:
        """``sampled_items`` ids drawn from (seed, epoch, step, rank), all under the step's first sample (none for
        an empty step)."""
        lengths = np.zeros(samples, dtype=np.int64)
        if not samples:
            return np.zeros(0, dtype=np.int64), lengths
        rng = np.random.default_rng([self.seed, *when, self.rank])
        lengths[0] = self.sampled_items
        return rng.integers(0, self.num_items, self.sampled_items, dtype=np.int64), lengths


def _pieces(arrays: dict[str, np.ndarray], column: str, total: int) -> list[tuple[np.ndarray, int]]:
    """A list column left in place (``read_runs(uncut=True)``) as ``(buffer, end sample)`` pieces in sample order,
    the last first (popped as the samples are copied)."""
    src = arrays[column + "@src"]
    if src.dtype != object:
        return [(src, total)]
    ends = [*arrays[column + "@from"].tolist()[1:], total]
    return [(src[k], ends[k]) for k in reversed(range(src.size))]


def _timestamps(arrays: dict[str, np.ndarray], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The history's timestamps (cut like its items) and each candidate's: the source's own where it
    has one (format 2), else the newest history timestamp (0 for an empty history)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    history = arrays[HISTORY_TIMESTAMPS].astype(np.int64, copy=False)
    if CANDIDATE_TIMESTAMP in arrays:
        candidate = arrays[CANDIDATE_TIMESTAMP].astype(np.int64, copy=False)
    else:
        lengths = arrays[HISTORY_TIMESTAMPS + "@"]
        last = np.cumsum(lengths) - 1
        candidate = np.where(lengths > 0, history[np.clip(last, 0, None)] if history.size else 0, 0)
    return torch.from_numpy(np.ascontiguousarray(history)), torch.from_numpy(np.array(candidate, dtype=np.int64))


__all__ = ["SPARSE_FEATURES", "BatchAssembler", "StepRows"]
