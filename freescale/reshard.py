"""Checkpoint state whose every tensor means the same thing under any sharding plan.

torchrec's state is almost plan-independent already: a table's weight is a
``ShardedTensor`` of its logical shape ``[rows, dim]`` whatever the plan (table-,
row-, column- or table-row-wise), and DCP reshards it on load.  The exception is
the fused optimizer's *row-wise* state (row-wise Adagrad's ``momentum1``): fbgemm
keeps one value per row *per column shard*, and torchrec lays a column-sharded
table's values end to end, a tensor of ``rows x shards``, whose meaning depends on
the plan (a checkpoint with 2 column shards does not load into 1).

So a checkpoint stores each row-wise state as its *fragments*: a ``[rows, S]``
tensor, column ``j`` the values of the ``j``-th column range of the plan that saved
it (``S = 1`` unless the table was split by columns), with the ranges in the
checkpoint's metadata (``RowwiseLayout``).  Saving costs no communication (each
rank writes its shards as they are); loading reads, for each local shard of the new
plan, the rows it holds of every saved column range, and combines them:

- **exact** when each saved range that overlaps the new shard's columns lies inside
  it: row-wise Adagrad adds, each step, the mean over the shard's columns of the
  squared gradient, so the value of a union of column ranges is the width-weighted
  mean of their values (same plan, merging column shards, any change of rows);
- **approximate** when the new plan splits a saved range: the per-column values are
  gone, and each part takes the range's value (the width-weighted mean of the
  overlaps in general), as if its squared gradients were spread evenly over its
  columns.  ``load`` returns a note for each table where this happened.

Everything else (weights, pointwise optimizer state, dense parameters and AdamW
moments) goes through DCP untouched.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

ROWWISE = "rowwise"
"""The app-state key of the row-wise optimizer state's fragments."""


class LayoutError(ValueError):
    """A table's state cannot be mapped between plans (names the table)."""


@dataclass(frozen=True)
class Span:
    """A shard's logical rows ``[r0, r1)`` and columns ``[c0, c1)`` of its table."""

    r0: int
    r1: int
    c0: int
    c1: int


@dataclass(frozen=True)
class RowwiseLayout:
    """How one table's row-wise state was cut: its rows, width and the column ranges' cut points."""

    rows: int
    dim: int
    cuts: tuple[int, ...]
    """``0 = cuts[0] < ... < cuts[S] = dim``: column range ``j`` is ``[cuts[j], cuts[j+1])``."""

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "dim": self.dim, "cuts": list(self.cuts)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RowwiseLayout:
        return cls(int(data["rows"]), int(data["dim"]), tuple(int(c) for c in data["cuts"]))


def _spans_of_weight(weight: ShardedTensor, name: str) -> tuple[list[Span], bool]:
    """Every shard of a table weight (global metadata order) and whether the table is split by columns."""
    spans = [Span(m.shard_offsets[0], m.shard_offsets[0] + m.shard_sizes[0],
                  m.shard_offsets[1], m.shard_offsets[1] + m.shard_sizes[1]) for m in weight.metadata().shards_metadata]
    rows, dim = weight.size()
    by_columns = any(s.c0 != 0 or s.c1 != dim for s in spans)
    if by_columns and any(s.r0 != 0 or s.r1 != rows for s in spans):
        raise LayoutError(f"table '{name}': split by rows and by columns at once (grid sharding): its row-wise "
                          "optimizer state has no plan-independent form here yet; constrain its sharding type")
    return spans, by_columns


def _optimizer_spans(weight: ShardedTensor, name: str) -> dict[int, Span]:
    """torchrec's row-wise state layout: the offset of each weight shard's values in the 1-D state tensor
    (rows end to end in column order for a column-split table, the shard's row offset otherwise)."""
    spans, by_columns = _spans_of_weight(weight, name)
    if not by_columns:
        return {s.r0: s for s in spans}
    ordered = sorted(spans, key=lambda s: s.c0)
    return {i * (s.r1 - s.r0): s for i, s in enumerate(ordered)}


def layout_of(weight: ShardedTensor, name: str) -> RowwiseLayout:
    spans, _ = _spans_of_weight(weight, name)
    rows, dim = weight.size()
    return RowwiseLayout(int(rows), int(dim), tuple(sorted({s.c0 for s in spans} | {int(dim)})))


def is_rowwise_state(state: Any, weight: Any) -> bool:
    """A fused optimizer's row-wise state of a sharded table (1-D, a multiple of the table's rows)."""
    return (isinstance(state, ShardedTensor) and isinstance(weight, ShardedTensor) and state.dim() == 1
            and weight.dim() == 2 and state.size(0) % weight.size(0) == 0)


def fragments(state: ShardedTensor | None, weight: ShardedTensor, name: str, dtype: torch.dtype,
              group: Any = None) -> tuple[ShardedTensor, RowwiseLayout]:
    """``state`` (torchrec's row-wise layout, of ``dtype``; None on a rank holding no shard of the table) as the
    logical ``[rows, S]`` fragments tensor, each local shard a view of the live state (nothing copied).  No
    collective: one fragment per non-empty shard of the weight, where that shard is (a row-wise state's shards lie
    with the weight's), declared from the weight's global metadata, which every rank holds alike (building it
    collectively, ``init_from_local_shards``, cost every save a pickled all-gather per table on the writer's
    thread, beside the training's steps).  Empty shards (row-wise sharding gives the ranks past the last rows
    none, all at the same offset) hold nothing to save and are left out."""
    layout = layout_of(weight, name)
    where = _optimizer_spans(weight, name)
    held: dict[tuple[int, int], Shard] = {}  # this rank's state shards by the (row, column) where they start
    for shard in state.local_shards() if state is not None else []:
        span = where.get(int(shard.metadata.shard_offsets[0]))
        if span is None:
            raise LayoutError(f"table '{name}': a row-wise state shard at offset {shard.metadata.shard_offsets[0]} "
                              "matches no shard of the table")
        if span.r1 > span.r0:
            held[(span.r0, span.c0)] = shard
    me = dist.get_rank() if dist.is_initialized() else 0
    declared, local = [], []
    for m in weight.metadata().shards_metadata:
        (r0, c0), rows = (int(m.shard_offsets[0]), int(m.shard_offsets[1])), int(m.shard_sizes[0])
        if rows == 0:
            continue
        ours = held.pop((r0, c0), None) if m.placement is not None and m.placement.rank() == me else None
        if ours is None and m.placement is not None and m.placement.rank() == me:
            raise LayoutError(f"table '{name}': this rank holds its rows [{r0}, {r0 + rows}) from column {c0} "
                              "but no row-wise optimizer state for them")
        meta = ShardMetadata(shard_offsets=[r0, layout.cuts.index(c0)], shard_sizes=[rows, 1],
                             placement=m.placement if ours is None else ours.metadata.placement)
        declared.append(meta)
        if ours is not None:
            local.append(Shard(ours.tensor.view(-1, 1), meta))
    if held:
        raise LayoutError(f"table '{name}': row-wise state rows from {sorted(held)[0][0]} on this rank, where the "
                          "table's shard is not")
    global_meta = ShardedTensorMetadata(
        shards_metadata=declared, size=torch.Size([layout.rows, len(layout.cuts) - 1]),
        tensor_properties=TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_meta, process_group=group), layout


def destination(state: ShardedTensor, weight: ShardedTensor, saved: RowwiseLayout, name: str) -> ShardedTensor:
    """Where DCP reads the saved fragments to: on this rank, the rows of each local shard of ``state`` (the
    new plan's), every saved column range.  Ranks may want the same rows (every column shard of a table
    needs all of them), which a ShardedTensor built collectively forbids, so it is built from this rank's
    metadata alone (as torchrec builds its own): the rows this rank does not want are declared on another
    rank, and DCP, which reads each rank's local shards on their own, never reads them."""
    where = _optimizer_spans(weight, name)
    rows = weight.size(0)  # the saved layout's rows and width match (``_layout_problem``, checked first)
    ranges = sorted({(where[int(s.metadata.shard_offsets[0])].r0, where[int(s.metadata.shard_offsets[0])].r1)
                     for s in state.local_shards()})
    width = len(saved.cuts) - 1
    mine = state.local_shards()[0].metadata.placement
    assert mine is not None, f"table '{name}': a local shard without a placement"
    elsewhere = f"rank:{(dist.get_rank() + 1) % dist.get_world_size()}/{mine.device()}" if dist.is_initialized() else None
    local, declared, row = [], [], 0
    for r0, r1 in ranges:
        if r0 > row:
            declared.append(ShardMetadata(shard_offsets=[row, 0], shard_sizes=[r0 - row, width], placement=elsewhere))
        meta = ShardMetadata(shard_offsets=[r0, 0], shard_sizes=[r1 - r0, width], placement=mine)
        local.append(Shard(torch.zeros(r1 - r0, width, dtype=state.dtype, device=state.local_shards()[0].tensor.device),
                           meta))
        declared.append(meta)
        row = r1
    if row < rows:
        declared.append(ShardMetadata(shard_offsets=[row, 0], shard_sizes=[rows - row, width], placement=elsewhere))
    global_meta = ShardedTensorMetadata(
        shards_metadata=declared, size=torch.Size([rows, width]),
        tensor_properties=TensorProperties(dtype=state.dtype, layout=torch.strided, requires_grad=False))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_meta)


def fill(state: ShardedTensor, weight: ShardedTensor, read: ShardedTensor, saved: RowwiseLayout, name: str) -> None:
    """Write the new plan's local row-wise values from the saved fragments ``read`` (``destination``, loaded)."""
    where = _optimizer_spans(weight, name)
    rows_of = {int(s.metadata.shard_offsets[0]): s.tensor for s in read.local_shards()}
    for shard in state.local_shards():
        span = where[int(shard.metadata.shard_offsets[0])]
        weights, _ = column_weights(saved.cuts, span.c0, span.c1)
        rows = rows_of[span.r0]
        values = rows.to(torch.float64) @ torch.from_numpy(weights).to(rows.device)
        shard.tensor.view(-1).copy_(values.to(shard.tensor.dtype))


def approximation(weight: ShardedTensor, saved: RowwiseLayout, name: str) -> str | None:
    """A note when this plan splits one of the saved column ranges of the table (the same on every rank:
    from the plan's global metadata), else None."""
    spans, _ = _spans_of_weight(weight, name)
    if all(column_weights(saved.cuts, s.c0, s.c1)[1] for s in spans):
        return None
    now = sorted({s.c0 for s in spans} | {saved.dim})
    return (f"table '{name}': columns cut at {now}, the checkpoint's at {list(saved.cuts)}: each new column "
            "shard's row-wise optimizer state is the width-weighted mean of the saved ranges it overlaps "
            "(approximate where a saved range is split)")


def column_weights(cuts: tuple[int, ...], c0: int, c1: int) -> tuple[np.ndarray, bool]:
    """Weights over the saved column ranges giving the value of columns ``[c0, c1)``: each range's
    overlap over the width; exact when every overlapping range lies inside ``[c0, c1)``."""
    lo, hi = np.asarray(cuts[:-1]), np.asarray(cuts[1:])
    overlap = np.clip(np.minimum(hi, c1) - np.maximum(lo, c0), 0, None).astype(np.float64)
    exact = bool(np.all((overlap == 0) | ((lo >= c0) & (hi <= c1))))
    return overlap / (c1 - c0), exact


def plan_summary(dmp: Any) -> dict[str, dict[str, Any]]:
    """Each table's sharding under ``dmp``'s plan: type, kernel, ranks and each shard's rows and columns
    (the checkpoint's metadata: ``freescale checkpoint inspect`` shows it, a resume names what changed)."""
    found: dict[str, dict[str, Any]] = {}
    for module_plan in getattr(getattr(dmp, "plan", None), "plan", {}).values():
        for table, sharding in module_plan.items():
            spec = getattr(sharding.sharding_spec, "shards", None) or []
            found[table] = {
                "type": sharding.sharding_type, "kernel": sharding.compute_kernel, "ranks": list(sharding.ranks or []),
                "shards": [{"rank": getattr(m.placement, "rank", lambda: None)(), "offsets": list(m.shard_offsets),
                            "sizes": list(m.shard_sizes)} for m in spec],
            }
    return found


def table_name(param_key: str) -> str:
    """``...embedding_bags.<table>.weight`` -> ``<table>``."""
    parts = param_key.split(".")
    return parts[-2] if len(parts) >= 2 else param_key


_DEPRECATION = "Please use DTensor instead and we are deprecating ShardedTensor"
"""torch's FutureWarning at every ShardedTensor call: torchrec's sharded tables are ShardedTensors, so this
module cannot do without them, and the user can do nothing about it."""

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def sharded_tensor_calls(fn: _Fn) -> _Fn:
    """``fn`` without torch's ShardedTensor deprecation warning (that message alone, for this call)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEPRECATION, category=FutureWarning)
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


@sharded_tensor_calls
def to_logical(model: dict[str, Any], optim: dict[str, Any],
               group: Any = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Collective over ``group`` (default: the default group).  The app state DCP writes (``model``;
    ``optim`` without its row-wise states, which move to ``ROWWISE`` as fragments) and each row-wise
    state's layout (for the checkpoint's metadata).  ``optim`` is changed in place.  A rank holding no
    shard of a table has no optimizer state for it, so the ranks first agree on the list (and each state's dtype):
    the one collective, whatever the tables (``fragments`` declares each from its weight's metadata)."""
    states = optim.get("state", {})
    mine = sorted((p, k, str(v.dtype).removeprefix("torch.")) for p, entries in states.items()
                  for k, v in entries.items() if is_rowwise_state(v, model.get(p)))
    everyone: list[Any] = [None] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    pieces: dict[str, ShardedTensor] = {}
    layouts: dict[str, dict[str, Any]] = {}
    named: dict[tuple[str, str], str] = {}
    for param_key, state_key, dtype in sorted({tuple(k) for keys in everyone for k in keys}):
        if named.setdefault((param_key, state_key), dtype) != dtype:
            raise LayoutError(f"table '{table_name(param_key)}': its row-wise state '{state_key}' is "
                              f"{named[(param_key, state_key)]} on one rank and {dtype} on another")
        weight, name = model[param_key], table_name(param_key)
        state = states.get(param_key, {}).pop(state_key, None)
        key = f"{param_key}/{state_key}"
        pieces[key], layout = fragments(state, weight, name, getattr(torch, dtype), group)
        layouts[key] = layout.to_json()
    return _app_state(model, _without_empty(optim), pieces), layouts


def _layout_problem(model: dict[str, Any], key: str, saved: RowwiseLayout) -> str | None:
    """What keeps a saved row-wise state from this model's table (None: it fits)."""
    param_key = key.split("/")[0]
    weight, name = model.get(param_key), table_name(param_key)
    if not isinstance(weight, ShardedTensor):
        return f"table '{name}': in the checkpoint, not in this model"
    rows, dim = weight.size()
    if (saved.rows, saved.dim) != (rows, dim):
        return f"table '{name}': the checkpoint's is {saved.rows} x {saved.dim}, this model's {rows} x {dim}"
    return None


def _raise_on_every_rank(problems: list[str], group: Any = None) -> None:
    """Raise the first problem any rank of ``group`` found, on every one of them (one small all-gather)."""
    found: list[Any] = [problems]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, problems, group=group)
    first = next((p for ranks in found for p in ranks), None)
    if first is not None:
        raise LayoutError(first)


def _app_state(model: dict[str, Any], optim: dict[str, Any], rowwise: dict[str, Any]) -> dict[str, Any]:
    """What DCP saves or loads; an empty part left out (DCP saves nothing for it, then asks for it on load)."""
    parts = {"model": model, "optim": optim, ROWWISE: rowwise}
    return {k: v for k, v in parts.items() if v}


def _without_empty(tree: Any) -> Any:
    """``tree`` without the containers the row-wise states left empty (DCP refuses an empty one), sharing
    every leaf."""
    if isinstance(tree, dict):
        kept = {k: _without_empty(v) for k, v in tree.items()}
        return {k: v for k, v in kept.items() if not (isinstance(v, (dict, list)) and not v)}
    if isinstance(tree, list):
        return [_without_empty(v) for v in tree]
    return tree


def _merge_back(tree: Any, loaded: Any) -> None:
    """Copy ``loaded``'s leaves into ``tree`` where ``_without_empty(tree)`` put them."""
    keys = loaded.keys() if isinstance(loaded, dict) else range(len(loaded))
    for k in keys:
        if isinstance(loaded[k], (dict, list)):
            _merge_back(tree[k], loaded[k])
        else:
            tree[k] = loaded[k]


@dataclass
class Replicas:
    """The tables a checkpoint holds ``data_parallel``: a resume that shards one of them, or replicates a table
    it holds sharded, converts its row-wise Adagrad state.  A replicated table's accumulator (torchrec's
    ``RowWiseAdagrad``, ``sum``: rows x 1) and the fused kernel's (``momentum1``, per row) hold the same
    values: ``parallelize.build_optimizer`` makes the replicated update take the fused kernel's step (measured:
    after 4 steps of the tiny DLRM at 2 ranks each way, their ratio's median is 1.005); the weight is the
    same table either way."""

    saved_tables: frozenset[str] = frozenset()


@sharded_tensor_calls
def load_logical(load: Any, model: dict[str, Any], optim: dict[str, Any],
                 layouts: dict[str, dict[str, Any]], group: Any = None, replicas: Replicas | None = None) -> list[str]:
    """Fill ``model`` and ``optim`` (this plan's state dicts) from a checkpoint saved by ``to_logical``
    under any plan: ``load(app_state)`` is DCP's load of that checkpoint.  The notes name every table
    whose row-wise state was approximated (module docstring).  Collective over ``group`` (default: the
    default group): the ranks agree on any problem before DCP's load.  ``replicas``: a table saved
    ``data_parallel`` and sharded now, or the other way round, converts its accumulator (``Replicas``)."""
    replicas = replicas or Replicas()
    now_replicated = _now_replicated(model, optim, layouts)
    problems = [_layout_problem(model, key, RowwiseLayout.from_json(data)) for key, data in sorted(layouts.items())
                if key not in now_replicated]
    pending: list[tuple[dict[str, Any], str, ShardedTensor, ShardedTensor, str, RowwiseLayout | None, str]] = []
    reads: dict[str, Any] = {}
    for param_key, states in optim.get("state", {}).items():
        weight = model.get(param_key)
        for state_key in [k for k, v in states.items() if is_rowwise_state(v, weight)]:
            key, name = f"{param_key}/{state_key}", table_name(param_key)
            if key not in layouts and name not in replicas.saved_tables:
                problems.append(f"table '{name}': the checkpoint holds no row-wise optimizer state for it")
                continue
            saved = RowwiseLayout.from_json(layouts[key]) if key in layouts else None
            assert isinstance(weight, ShardedTensor), f"table '{name}': row-wise state beside a weight that is not sharded"
            pending.append((states, state_key, states.pop(state_key), weight, key, saved, name))
    _raise_on_every_rank([p for p in problems if p], group)  # before DCP's collectives: no rank left waiting
    for key, (_, accumulator, _) in now_replicated.items():
        saved = RowwiseLayout.from_json(layouts[key])
        reads[key] = torch.zeros(saved.rows, len(saved.cuts) - 1, dtype=accumulator.dtype)
    for _, _, state, weight, key, saved, name in pending:
        if saved is not None and state.local_shards():  # DCP reads only what a rank asks: none without the table
            reads[key] = destination(state, weight, saved, name)
    pruned = _without_empty(optim)
    was_replicated = _ask_for_replicated(pruned, [(key, weight) for _, _, _, weight, key, saved, _ in pending
                                                  if saved is None])
    load(_app_state(model, pruned, reads))
    for param_key in was_replicated:
        pruned["state"][param_key].pop("sum")
    _merge_back(optim, pruned)  # DCP replaces non-tensor values (steps, learning rates) in the dict it is given
    for states, state_key, state, weight, key, saved, name in pending:
        if saved is None:
            _fill_from_replicated(state, weight, was_replicated[key.split("/")[0]], name)
        elif key in reads:
            fill(state, weight, reads[key], saved, name)
        states[state_key] = state
    for key, (states, accumulator, step) in now_replicated.items():
        _fill_replicated(accumulator, reads[key], RowwiseLayout.from_json(layouts[key]))
        states["sum"] = accumulator
        if step is not None:
            states["step"] = step
    # From the layouts and every rank's global metadata: the same notes on every rank, for every table.
    notes = [approximation(model[key.split("/")[0]], RowwiseLayout.from_json(data), table_name(key.split("/")[0]))
             for key, data in sorted(layouts.items()) if isinstance(model.get(key.split("/")[0]), ShardedTensor)]
    notes += [f"table '{name}': saved data_parallel, now sharded by columns: each column shard's row-wise optimizer "
              "state takes the whole row's (approximate)" for _, _, _, weight, _, saved, name in pending
              if saved is None and len(layout_of(weight, name).cuts) > 2]
    return [n for n in notes if n]


def _now_replicated(model: dict[str, Any], optim: dict[str, Any],
                    layouts: dict[str, dict[str, Any]]) -> dict[str, tuple[dict[str, Any], torch.Tensor, Any]]:
    """Tables saved sharded (a row-wise layout in the checkpoint) that this plan replicates (a whole weight
    with torchrec's ``RowWiseAdagrad`` state): layout key -> (their state dict, its ``sum``, its ``step``),
    both taken out of ``optim`` (the checkpoint holds neither)."""
    found = {}
    for key in layouts:
        param_key = key.split("/")[0]
        states = optim.get("state", {}).get(param_key)
        if isinstance(model.get(param_key), ShardedTensor) or not states or "sum" not in states:
            continue
        found[key] = (states, states.pop("sum"), states.pop("step", None))
    return found


def _ask_for_replicated(pruned: dict[str, Any], wanted: list[tuple[str, ShardedTensor]]) -> dict[str, torch.Tensor]:
    """Ask DCP for the replicated accumulator (``sum``, rows x 1) of each table saved ``data_parallel`` that this
    plan shards: param key -> the tensor DCP fills."""
    asked = {}
    for key, weight in wanted:
        param_key = key.split("/")[0]
        asked[param_key] = torch.zeros(weight.size(0), 1)
        pruned.setdefault("state", {}).setdefault(param_key, {})["sum"] = asked[param_key]
    return asked


def _fill_from_replicated(state: ShardedTensor, weight: ShardedTensor, saved_sum: torch.Tensor, name: str) -> None:
    """This plan's fused row-wise state from a replicated table's accumulator (the same values, ``Replicas``)."""
    where = _optimizer_spans(weight, name)
    per_row = saved_sum.view(-1)
    for shard in state.local_shards():
        span = where[int(shard.metadata.shard_offsets[0])]
        shard.tensor.view(-1).copy_(per_row[span.r0:span.r1].to(shard.tensor.dtype))


def _fill_replicated(accumulator: torch.Tensor, fragments_read: torch.Tensor, saved: RowwiseLayout) -> None:
    """A replicated table's accumulator from saved fragments: the whole row's value (the width-weighted mean of
    the saved column ranges: exact, and the value itself when the table was not split by columns)."""
    weights, _ = column_weights(saved.cuts, 0, saved.dim)
    per_row = fragments_read.to(torch.float64) @ torch.from_numpy(weights) if len(saved.cuts) > 2 else fragments_read
    accumulator.copy_(per_row.view_as(accumulator).to(accumulator.dtype))


__all__ = ["ROWWISE", "LayoutError", "Replicas", "RowwiseLayout", "column_weights", "load_logical", "plan_summary", "to_logical"]
