"""A fused embedding module's step in row form, and the fused optimizers' update of those rows.

The union update (``freescale.ft.sparse_sync``) moves each replica group's embedding step across
groups as **unique rows with their summed gradients**, not as the looked-up ids and their bags'
gradients: a row's update under fbgemm's exact optimizers depends only on the sum of its
gradients within the step, so a group sums its own occurrences once (``RowStep.of``: its ids
deduplicated and its bags' gradients scattered onto them) and every group then merges R groups'
rows, not R groups' ids.  The update itself (``apply_rows``) is fbgemm's optimizer arithmetic
written out with torch on the rows (row-wise Adagrad, Adagrad, SGD; the same values to float
rounding, checked against fbgemm in ``tests/test_sparse_sync.py``), in place on the module's own
weight and state views: no lookup of the union, no autograd graph, nothing to put back when a
vote fails.

Keys: a row of table ``t`` is ``row_base[t] + id`` (the tables of one module laid end to end), so
one ``torch.unique`` deduplicates every table of a module at once; tables of different widths
form separate groups (``TBELayout.dims``), each with its own key and gradient tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

POOL_SUM, POOL_MEAN, POOL_NONE = 0, 1, 2
"""fbgemm's ``PoolingMode`` values."""


@dataclass(frozen=True)
class TBELayout:
    """Where a fused module's features, tables and rows are: read once from the module."""

    features: int
    pooling: int
    table_of_feature: torch.Tensor
    """int64 [T]: the table each feature looks up."""
    row_base: torch.Tensor
    """int64 [tables + 1]: the key of each table's row 0 (its rows' keys follow)."""
    dims: list[int]
    """Distinct row widths, ascending: one key group per width."""
    group_of_feature: torch.Tensor
    """int64 [T]: index into ``dims``."""
    feature_slot: torch.Tensor
    """int64 [T]: the feature's place among its group's features."""
    group_columns: list[torch.Tensor | None]
    """Per group, its features' columns of a pooled output ``[bags, sum of widths]`` in feature order
    (None: the group is every column, in order)."""
    group_features: list[torch.Tensor]
    tables_of_group: list[list[int]]

    @classmethod
    def of(cls, tbe: Any) -> TBELayout:
        rows = [int(spec[0]) for spec in tbe.embedding_specs]
        widths = [int(spec[1]) for spec in tbe.embedding_specs]
        table_of_feature = [int(t) for t in tbe.feature_table_map]
        feature_width = [widths[t] for t in table_of_feature]
        dims = sorted(set(feature_width))
        starts = [sum(feature_width[:f]) for f in range(len(feature_width))]
        members = [[f for f, w in enumerate(feature_width) if w == d] for d in dims]
        slot = [members[dims.index(w)].index(f) for f, w in enumerate(feature_width)]
        columns: list[torch.Tensor | None] = [
            None if len(dims) == 1 else torch.tensor([c for f in fs for c in range(starts[f], starts[f] + d)])
            for d, fs in zip(dims, members)]
        base = [0]
        for r in rows:
            base.append(base[-1] + r)
        return cls(len(table_of_feature), int(tbe.pooling_mode), torch.tensor(table_of_feature, dtype=torch.int64),
                   torch.tensor(base, dtype=torch.int64), dims,
                   torch.tensor([dims.index(w) for w in feature_width], dtype=torch.int64),
                   torch.tensor(slot, dtype=torch.int64), columns,
                   [torch.tensor(fs, dtype=torch.int64) for fs in members],
                   [sorted({t for t in table_of_feature if widths[t] == d}) for d in dims])

    @property
    def pooled(self) -> bool:
        return self.pooling != POOL_NONE


@dataclass
class Occurrences:
    """One step's ids of a module, sorted into key groups (computed at the forward: the unique
    counts ride in the dense reduction before backward).  Per group: which occurrences belong to
    it (``select``, None when the module has one group), the bag each one pooled into, and the
    step's unique keys with each occurrence's index among them."""

    bags: int
    """Bags per feature (``B``)."""
    select: list[torch.Tensor | None]
    bag: list[torch.Tensor]
    """Per group, each occurrence's bag among the group's bags (feature-major: the group's
    ``slot x B + bag``)."""
    keys: list[torch.Tensor]
    inverse: list[torch.Tensor]
    lengths: torch.Tensor
    """int64 [T * B]: each bag's id count (mean pooling divides by it)."""

    @classmethod
    def of(cls, layout: TBELayout, indices: torch.Tensor, offsets: torch.Tensor) -> Occurrences:
        device = indices.device
        lengths = offsets.diff()
        bags = (offsets.numel() - 1) // layout.features
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        feature = torch.div(bag, max(bags, 1), rounding_mode="floor")
        keys = layout.row_base.to(device)[layout.table_of_feature.to(device)[feature]] + indices
        selects: list[torch.Tensor | None] = []
        bag_of, unique, inverse = [], [], []
        for k in range(len(layout.dims)):
            select = None if len(layout.dims) == 1 else (layout.group_of_feature.to(device)[feature] == k).nonzero()[:, 0]
            mine = keys if select is None else keys[select]
            u, inv = torch.unique(mine, return_inverse=True)
            selects.append(select)
            bag_of.append(bag if select is None else
                          layout.feature_slot.to(device)[feature[select]] * bags + bag[select] - feature[select] * bags)
            unique.append(u)
            inverse.append(inv)
        return cls(bags, selects, bag_of, unique, inverse, lengths)


@dataclass
class RowStep:
    """One module's step in row form: per key group, unique keys (ascending) and summed gradients."""

    keys: list[torch.Tensor]
    grads: list[torch.Tensor]

    @classmethod
    def empty(cls, layout: TBELayout) -> RowStep:
        return cls([torch.zeros(0, dtype=torch.int64) for _ in layout.dims],
                   [torch.zeros(0, d) for d in layout.dims])

    @classmethod
    def of(cls, layout: TBELayout, seen: Occurrences, grad: torch.Tensor) -> RowStep:
        """Scatter the output gradient (pooled ``[B, sum of widths]``, sequence ``[ids, width]``) onto
        the step's unique rows: each id gets its bag's gradient (over its length under mean pooling),
        and a row's occurrences are summed."""
        keys, grads = [], []
        for k, dim in enumerate(layout.dims):
            bag, select = seen.bag[k], seen.select[k]
            if layout.pooled:  # the group's bags feature-major, then each id's bag's row
                columns, features = layout.group_columns[k], layout.group_features[k]
                mine = grad if columns is None else grad.index_select(1, columns.to(grad.device))
                per_bag = mine.reshape(seen.bags, features.numel(), dim).transpose(0, 1).reshape(-1, dim)
                if layout.pooling == POOL_MEAN:
                    lengths = seen.lengths.view(layout.features, seen.bags)
                    lengths = (lengths if columns is None else lengths[features.to(lengths.device)]).reshape(-1, 1)
                    per_bag = per_bag / lengths.clamp(min=1).to(per_bag.dtype)
                per_id = per_bag.index_select(0, bag)
            else:
                per_id = (grad if select is None else grad[select])[:, :dim]
            summed = torch.zeros(seen.keys[k].numel(), dim, dtype=torch.float32, device=grad.device)
            keys.append(seen.keys[k])
            grads.append(summed.index_add_(0, seen.inverse[k], per_id.float()))
        return cls(keys, grads)

    def counts(self) -> list[int]:
        return [k.numel() for k in self.keys]


def merge(parts: list[RowStep], shares: list[float]) -> RowStep:
    """Every participant's rows, each scaled by its share of the step's samples, summed per key, in
    participant order (the same bits on every group: one ordered ``index_add_``)."""
    keys, grads = [], []
    for k in range(len(parts[0].keys) if parts else 0):
        cat_keys = torch.cat([p.keys[k] for p in parts])
        scaled = torch.cat([p.grads[k] * torch.tensor(s, dtype=torch.float32) for p, s in zip(parts, shares)])
        unique, inverse = torch.unique(cat_keys, return_inverse=True)
        keys.append(unique)
        grads.append(torch.zeros(unique.numel(), scaled.shape[1], dtype=torch.float32,
                                 device=scaled.device).index_add_(0, inverse, scaled))
    return RowStep(keys, grads)


def apply_rows(tbe: Any, layout: TBELayout, rows: RowStep) -> None:
    """fbgemm's exact optimizer step on ``rows`` (each row once, its gradient already summed), in
    place on the module's weights and optimizer state (views of its own buffers).  Lower-precision
    weights are updated in float32 and rounded to nearest (fbgemm rounds stochastically): the same
    bits on every replica either way."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kind, lr, eps = tbe.optimizer, tbe.get_learning_rate(), float(tbe.optimizer_args.eps)
    weights = tbe.split_embedding_weights()
    states = tbe.split_optimizer_states() if kind != EmbOptimType.EXACT_SGD else None
    for k, tables in enumerate(layout.tables_of_group):
        keys, grads = rows.keys[k], rows.grads[k]
        if keys.numel() == 0:
            continue
        device = weights[tables[0]].device
        keys, grads = keys.to(device), grads.to(device)
        starts = torch.searchsorted(keys, layout.row_base[tables].to(device)).tolist()
        ends = torch.searchsorted(keys, layout.row_base[[t + 1 for t in tables]].to(device)).tolist()
        for t, start, end in zip(tables, starts, ends):
            if end <= start:
                continue
            ids = keys[start:end] - int(layout.row_base[t])
            g = grads[start:end]
            table = weights[t]
            w = table[ids].float()
            if kind == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
                state = states[t][0]  # type: ignore[index]
                accumulated = state[ids] + (g * g).mean(dim=1)
                state[ids] = accumulated
                w -= (lr / (accumulated.sqrt() + eps)).unsqueeze(1) * g
            elif kind == EmbOptimType.EXACT_ADAGRAD:
                state = states[t][0].view(table.shape)  # type: ignore[index]
                accumulated = state[ids] + g * g
                state[ids] = accumulated
                w -= lr * g / (accumulated.sqrt() + eps)
            else:
                w -= lr * g
            table[ids] = w.to(table.dtype)
