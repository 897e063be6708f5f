"""A fault-tolerant run's steps retrained in one process without fault tolerance: the reference they must equal.

Under auditing (``FREESCALE_AUDIT=1``) each group's ``commit`` record names the rows the whole step trained
(every group's), the rows its rank 0 trained, the factor its summed loss was scaled by, and that loss.  The
sample-weighted exchange makes each committed update the gradient of the mean loss over exactly the step's rows,
whatever share each group held: a group shrunk to fewer ranks, a slow group planned smaller, a dead rank's rows
retrained in the next step.  So one plain process that trains every committed step on those rows, as one batch,
takes the same steps; each group's logged loss equals the reference model's loss on that group's rank-0 rows
(scaled alike, before the step's update).

**Segments, not one long replay.**  Two float32 trainings that differ only in summation order drift apart
(this tiny DLRM: 1e-6 after a step, ~10x every 20 steps), so a replay of hundreds of steps from step 0 proves
little.  The reference restarts from each of the run's checkpoints (every ``checkpoint.every`` steps, any plan:
``Resume.load_into``; a run that must have every one sets ``checkpoint.skip_while_busy = false``, else a save due
while the previous one is written is skipped and the segment is longer), replays the steps up to the next one, comparing losses on the way, then compares its whole
state with that next checkpoint: a step that weighted a group wrongly moves the tables by a share of a learning
rate, float order by ~1e-6.  The first segment starts from the initial model (the same whatever the plan:
``freescale.table_init``).

**Scale.**  Every kernel steps on the mean gradient of the rows it trained, on any number of ranks (torchrec
divides the gradient its all-to-all returns to a fused shard by the group's size; DDP and fault tolerance average the
dense and replicated ones), so the reference's batch loss is the plain mean over the step's rows, with the run's
own optimizer settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freescale.audit import commits_by_step, group_logs


@dataclass(frozen=True)
class LossPair:
    step: int
    group: int
    logged: float
    """The loss the group's rank 0 logged for the step."""
    reference: float
    """The reference model's loss on the same rows, scaled alike, before the step's update."""


@dataclass(frozen=True)
class StateGap:
    step: int
    """The checkpoint the reference's state was compared with (the state after steps ``.. step - 1``)."""
    max_abs: float
    """The largest absolute difference of any parameter or optimizer state element."""
    where: str


@dataclass
class Reference:
    losses: list[LossPair]
    gaps: list[StateGap]


Share = tuple[float, list[int], float]
"""A group's rank 0 at one step: (logged loss, its rows, its loss scale)."""


def reference_run(out: Path, config: str | Path, overrides: list[str], checkpoints: Path | None = None) -> Reference:
    """Retrain the audited run in ``out`` (fault-tolerant: ``out/replica<g>/train_log.jsonl``; or plain, one group:
    ``out/train_log.jsonl``) in this process (the module docstring) from ``config`` with ``overrides`` (the run's
    own, with ``--train.output_dir`` pointing elsewhere), segment by segment between its checkpoints
    (``checkpoints``: default ``out/checkpoints``)."""
    from freescale.components import TrainerConfig, build
    from freescale.config import load_config
    from freescale.distributed import DistConfig, init_distributed, shutdown

    steps = _committed_steps(out)
    cfg = load_config(TrainerConfig, config, overrides)
    if cfg.ft.enabled:
        raise ValueError("reference_run trains without fault tolerance: leave [ft] out of its config and overrides")
    ctx = init_distributed(DistConfig(backend="gloo"))
    if ctx.world_size != 1:
        shutdown(ctx)
        raise ValueError("reference_run runs in one process, outside any process group")
    parts = build(cfg, ctx)
    try:
        if parts.sampled_items:
            raise ValueError("reference_run: the model samples negatives per rank and step; a reference "
                             "cannot draw the same ones")
        if any(_drops(m) for m in parts.dmp.modules()):
            raise ValueError("reference_run: the model applies dropout, whose masks are drawn per rank slot and step "
                             "(step_engine.step_seed); a reference training the step as one batch cannot draw the "
                             "same ones: audit with the model's dropout at 0")
        return _segments(parts, cfg, steps, checkpoints or out / "checkpoints")
    finally:
        parts.close()
        shutdown(ctx)


def _drops(module: torch.nn.Module) -> bool:
    """Whether a module draws dropout masks in training."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    return isinstance(module, torch.nn.MultiheadAttention) and module.dropout > 0


def _segments(parts: Any, cfg: Any, steps: dict[int, tuple[list[int], dict[int, Share]]], root: Path) -> Reference:
    from freescale import checkpoint
    from freescale.resume import Resume

    resume = Resume(cfg, root, None, "")
    saved = dict(checkpoint.complete_checkpoints(root))
    last = max(steps, default=-1) + 1
    ends = sorted({s for s in saved if 0 < s <= last} | {last})
    found = Reference([], [])
    start = 0
    for end in ends:
        if start:
            resume.load_into(parts, saved[start])
        for step in range(start, end):
            if step not in steps:
                raise ValueError(f"step {step} has no commit record in any group's log")
            found.losses += _train_step(parts, step, *steps[step])
        if end in saved:
            before = _state_tensors(parts)
            resume.load_into(parts, saved[end])
            found.gaps.append(_gap(end, before, _state_tensors(parts)))
        start = end
    return found


def _train_step(parts: Any, step: int, rows: list[int], shares: dict[int, Share]) -> list[LossPair]:
    """Each group's rank-0 loss on the state before ``step``, then ``step``'s update from all its rows."""
    model, loader, update = parts.dmp, parts.loader, parts.engine.sync.update
    pairs = []
    model.eval()
    with torch.no_grad():
        for group, (logged, rank_rows, scale) in sorted(shares.items()):
            got = model(loader.batch_of(np.asarray(rank_rows), scale, (0, step)))[0]
            pairs.append(LossPair(step, group, logged, float(got)))
    if not rows:  # nothing trained (or the step was skipped as non-finite): no update
        return pairs
    model.train()
    parts.optimizer.zero_grad(set_to_none=True)
    update.before_tables(step)
    model(loader.batch_of(np.asarray(rows), 1.0 / len(rows), (0, step)))[0].backward()
    update.apply(step)
    return pairs


def _state_tensors(parts: Any) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of the model's and optimizer's state, copied, by snapshot name (a sharded
    table: its local shards, named by their offsets)."""
    from freescale.ft.snapshot_state import named_tensors
    from freescale.resume import raw_state

    return {name: t.detach().clone() for name, t in named_tensors(raw_state(parts), "") if t.is_floating_point()}


def _gap(step: int, ours: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> StateGap:
    if ours.keys() != saved.keys():
        missing = sorted(ours.keys() ^ saved.keys())
        return StateGap(step, float("inf"), f"state keys differ: {missing[:3]}")
    worst, where = 0.0, ""
    for key, tensor in ours.items():
        diff = float((tensor.double() - saved[key].double()).abs().max()) if tensor.numel() else 0.0
        if diff > worst or not where:
            worst, where = diff, key
    return StateGap(step, worst, where)


def _committed_steps(out: Path) -> dict[int, tuple[list[int], dict[int, Share]]]:
    """Each committed step: the rows it trained and each contributing group's rank-0 share."""
    steps: dict[int, tuple[list[int], dict[int, Share]]] = {}
    logs = group_logs(out) or {0: [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]}
    for group, events in logs.items():
        for step, e in commits_by_step(events).items():
            if "rank_rows" not in e:
                raise ValueError(f"{out}: group {group}'s step {step} was not audited "
                                 "(run it with FREESCALE_AUDIT=1)")
            _, shares = steps.setdefault(step, ([] if e.get("nonfinite_skipped") else e["rows"], {}))
            if e.get("contributing", True) and e["loss"] is not None and e["rank_rows"]:
                shares[group] = (e["loss"], e["rank_rows"], e["loss_scale"])
    return dict(sorted(steps.items()))
