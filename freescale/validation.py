"""Training to convergence: the validation split evaluated during training, the best step kept, early stopping.

Every ``eval.every`` committed steps (a step count, or ``"1e"``: once an epoch) and at the run's last step (where a
decaying schedule ends) the group evaluates the model on
``eval.split`` (the ``valid`` split ``freescale prepare`` writes: each user's interaction before the test one, or
an earlier time cut; never the test split, never a position a training sample's history reaches).  The pipeline
holds no batch in flight then (a validation step ends a read-ahead segment, as a checkpoint does), the model is
detached from it for the evaluation and picks up where it was; the evaluation reads no random generator the
training uses (they are forked around it) and changes no parameter, so training is the same with and without it.

``BestTracker`` follows ``eval.metric`` (default: the task's own, ``ndcg@10`` for retrieval, ``auc`` for
ranking; ``loss`` and ``ne`` are lower-is-better): the best step so far, and with ``train.early_stop = N`` the
run stops after N evaluations without improvement.  With ``eval.keep_best`` every validated step is also a
checkpoint, the best one is named in ``best.json`` beside them and never pruned, and the final test evaluation
runs on it (``train.eval``).

**Replica groups agree.**  Every group evaluates at the same steps (its state is the job's), but a group running
on fewer ranks sums in another order; a decision made from each group's own number could differ in the last bit.
So the metric travels with the next step's cross-group reduction (``ValidationShare``, a side header: no
collective of its own) and every group, a catching-up one in its replay too, decides from the value of the
lowest-indexed group that evaluated: the same best step, the same stop, at the same commit.  The last step has
no later step: groups of one size decide from their own value (the same to the bit); groups on different ranks
leave it undecided and do not evaluate it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from freescale.config import require

if TYPE_CHECKING:
    from freescale.components import Components
    from freescale.run_log import RunLog
    from freescale.step_types import Commit

LOWER_IS_BETTER = ("loss", "ne")
BEST_NAME = "best.json"
"""Beside the checkpoints: the best validated step (``{"step", "metric", "value", "path"}``)."""


@dataclass
class EvalConfig:
    every: str = "0"
    """Validate every N committed steps (``"500"``) or every N epochs (``"1e"``, ``"0.5e"``), and at the last step
    (``train.steps``: where a decaying schedule ends, often the best); ``"0"``: no validation during training (the
    final test evaluation alone, ``train.eval``)."""
    split: str = "valid"
    """The split validated on (``freescale prepare`` writes ``valid``; ``gen-data --valid-rows``)."""
    metric: str = ""
    """What picks the best step and stops early: any metric the evaluation reports (``hr@10``, ``ndcg@10``, ``mrr``;
    ``auc``, ``ne``, ``loss``); empty: the task's own (retrieval ``ndcg@10``, ranking ``auc``)."""
    keep_best: bool = True
    """Checkpoint every validated step, keep the best (``best.json``) past ``checkpoint.keep``, and run the final
    test evaluation on it."""

    def validate(self) -> None:
        require(parse_every(self.every) is not None, "every",
                f"must be a step count (\"500\") or epochs (\"1e\", \"0.5e\"), got {self.every!r}")
        require(bool(self.split), "split", "must name a split")


def parse_every(text: str) -> tuple[float, bool] | None:
    """``"500"`` -> (500, False); ``"0.5e"`` -> (0.5, True); None when malformed or negative."""
    body, epochs = (text[:-1], True) if text.endswith("e") else (text, False)
    try:
        value = float(body) if epochs else int(body)
    except ValueError:
        return None
    return (value, epochs) if value >= 0 else None


def validation_steps(every: str, steps_per_epoch: int) -> int:
    """``eval.every`` in steps (0: none)."""
    parsed = parse_every(every)
    assert parsed is not None  # (validated)
    value, epochs = parsed
    return max(1, round(value * steps_per_epoch)) if epochs and value else int(value)


def epoch_steps(cfg: Any, samples: int, world_size: int) -> int:
    """``train.epochs`` in steps: ``samples`` of the training split over the global batch (``data.batch_size`` a
    rank slot: every group's whole ranks with replica groups), times the epochs (the loader's epoch: whole global
    batches).  Refuses a warm-up longer than that (``components.prepare`` could not check it)."""
    from freescale.config import ConfigError

    epochs, batch_size = cfg.train.epochs, cfg.data.batch_size
    slots = cfg.ft.replicas * (cfg.ft.group_ranks or world_size) if cfg.ft.enabled else world_size
    per_epoch = samples // max(batch_size * slots, 1)
    if per_epoch == 0:
        raise ConfigError(f"train.epochs: the training split has {samples:,} samples, fewer than one global batch "
                          f"({batch_size} x {slots} rank slots)")
    if cfg.optim.warmup_steps > epochs * per_epoch:
        raise ConfigError(f"optim.warmup_steps: {cfg.optim.warmup_steps:,} is more than train.epochs = {epochs} "
                          f"makes ({epochs * per_epoch:,} steps): the whole run would train at a fraction of the rate")
    return epochs * per_epoch


def task_metrics(task: str) -> tuple[str, ...]:
    """What an evaluation of ``task`` reports (``freescale.tasks``)."""
    if task == "retrieval":
        from freescale.retrieval import HIT_KS, NDCG_KS

        return (*(f"hr@{k}" for k in HIT_KS), *(f"ndcg@{k}" for k in NDCG_KS), "mrr")
    return ("loss", "auc", "ne")


def check_validation(split: str, metric: str, task: str, samples: int, ranks: int, data: str) -> None:
    """One line for a validation that cannot run: the test split, an unknown metric, a split too small or absent."""
    from freescale.config import ConfigError

    if split == "eval":
        raise ConfigError("eval.split: 'eval' is the test split; the best step must be picked on another one "
                          "('valid': freescale prepare --validation, gen-data --valid-rows)")
    if metric not in task_metrics(task):
        raise ConfigError(f"eval.metric: {metric!r} is not one a {task} evaluation reports "
                          f"({', '.join(task_metrics(task))})")
    if samples < ranks:
        what = "no" if samples == 0 else f"{samples} (fewer than the group's {ranks} ranks)"
        raise ConfigError(f"eval.every: {data} has {what} samples in its '{split}' split (freescale prepare "
                          "--validation last writes one; gen-data --valid-rows N); or set eval.every = 0")


def default_metric(task: str) -> str:
    return "ndcg@10" if task == "retrieval" else "auc"


@dataclass
class BestTracker:
    """The best validated step so far, and when to stop (``patience`` evaluations without improvement; 0: never)."""

    metric: str
    patience: int = 0
    best_step: int = -1
    best_value: float = math.nan
    since_best: int = 0
    stop_at: int | None = None
    """The validated step after which training stops (set once: the patience ran out there)."""
    history: list[tuple[int, float]] = field(default_factory=list)

    @property
    def lower_is_better(self) -> bool:
        return self.metric in LOWER_IS_BETTER

    def observe(self, step: int, value: float) -> bool:
        """Validated ``step`` scored ``value``: whether it is the new best (a NaN never is)."""
        self.history.append((step, value))
        better = not math.isnan(value) and (
            self.best_step < 0 or (value < self.best_value if self.lower_is_better else value > self.best_value))
        if better:
            self.best_step, self.best_value, self.since_best = step, value, 0
        else:
            self.since_best += 1
            if self.patience and self.since_best >= self.patience and self.stop_at is None:
                self.stop_at = step
        return better

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, [tuple(v) for v in value] if key == "history" else value)


class ValidationShare:
    """The validation metric across replica groups (module docstring; a ``freescale.step_types.SideChannel``).
    Header: ``[validated step + 1, the metric's float64 bits as two 32-bit words]`` (a side header carries values
    below 2**40), zeros when this group has nothing new."""

    name = "validation"
    size = 3

    def __init__(self, tracker: BestTracker) -> None:
        self.tracker = tracker
        self._pending: tuple[int, float] | None = None
        self.decided: list[tuple[int, float, bool]] = []
        """(step, agreed value, new best) reached since the trainer last took them."""

    def offer(self, step: int, value: float) -> None:
        """This group validated ``step``: its value rides with the next step's reduction."""
        self._pending = (step, value)

    def header(self) -> torch.Tensor:
        out = torch.zeros(self.size, dtype=torch.int64)
        if self._pending is not None:
            step, value = self._pending
            self._pending = None
            bits = int(np.float64(value).view(np.uint64))
            out[0], out[1], out[2] = step + 1, bits >> 32, bits & 0xFFFFFFFF
        return out

    def on_commit(self, commit: Commit, headers: dict[int, torch.Tensor]) -> None:
        told = sorted((g, h) for g, h in headers.items() if h.numel() >= self.size and int(h[0]) > 0)
        if not told:
            return
        header = told[0][1]
        step = int(header[0]) - 1
        value = float(np.uint64((int(header[1]) << 32) | int(header[2])).view(np.float64))
        if self.tracker.history and self.tracker.history[-1][0] >= step:
            return  # decided already (a replay reaching a step its snapshot had seen)
        self.decided.append((step, value, self.tracker.observe(step, value)))

    def notes(self) -> dict[str, Any]:
        t = self.tracker
        return {"best_step": t.best_step, "best": None if math.isnan(t.best_value) else t.best_value} \
            if t.best_step >= 0 else {}

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state["tracker"])
        self.decided, self._pending = [], None  # (reached on the state just replaced)


def evaluate(parts: Components, model: torch.nn.Module, split: str, seed: int, model_cfg: Any) -> dict[str, float]:
    """The model's metrics on ``split`` over the group (collective), without touching the training's random
    generators or its parameters."""
    from freescale.models import cost_model_for

    ctx = parts.ctx
    loader = parts.dataset.loader(split, rank=ctx.rank, world_size=ctx.world_size, sparse_features=parts.features,
                                  derived_cost=cost_model_for(model_cfg, parts.dataset.manifest.dense_dim),
                                  seed=seed, training=False, pin_memory=ctx.device.type == "cuda",
                                  timestamps=parts.reads_timestamps, sampled_items=parts.sampled_items)
    window = parts.task.evaluator(model)
    devices = [ctx.device] if ctx.device.type == "cuda" else []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for batch in loader:
                _, output = model(batch.to(ctx.device, non_blocking=True))
                window.add(output[1:])
        return window.compute()
    finally:
        model.train(was_training)
        loader.close()


def mark_best(root: Path, step: int, metric: str, value: float) -> None:
    """Name ``step``'s checkpoint the best in ``root/best.json`` (atomically: written aside, then renamed)."""
    from freescale.checkpoint import step_dir

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{BEST_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"step": step, "metric": metric, "value": value, "path": step_dir(root, step).name}))
    os.replace(tmp, root / BEST_NAME)


def best_step(root: Path) -> int | None:
    """The step ``best.json`` names, or None."""
    try:
        return int(json.loads((root / BEST_NAME).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


BEST_WAIT_S = 300.0
"""How long a group waits for the best checkpoint to be complete (another group, or this one's writer thread, may
still be writing it) before it gives up and evaluates the state it ends with."""


def load_best(parts: Components, cfg: Any, root: Path, log: RunLog, step: int) -> int | None:
    """Load the best validated step's checkpoint (``step``: the tracker's, the same in every group; ``best.json``,
    which one group writes, may not name it yet when another group gets here) into the model and optimizer
    (collective over the group), for the final test evaluation; its step, or None (no best, or its checkpoint
    never became complete: said in the log)."""
    from freescale.checkpoint import complete_checkpoints
    from freescale.resume import Resume

    if step < 0:
        return None
    deadline = time.monotonic() + BEST_WAIT_S
    while (path := dict(complete_checkpoints(root)).get(step)) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    found = torch.tensor([int(path is not None)], dtype=torch.int64, device=parts.ctx.device)
    if parts.ctx.world_size > 1:  # every rank of the group loads it, or none does (the load is collective)
        import torch.distributed as dist

        dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if path is None or not int(found[0]):
        log.write("best_missing", step=step, root=str(root))
        return None
    Resume(cfg, root, None, "").load_into(parts, path)
    log.write("best_loaded", step=step, path=str(path))
    return step


def test_evaluation(parts: Components, cfg: Any, root: Path, log: RunLog) -> dict[str, float]:
    """The final evaluation on the test split (``eval``), of the best validated step when one was kept (loaded
    from its checkpoint), logged; its metrics."""
    validation = parts.validation
    best = load_best(parts, cfg, root, log, validation.tracker.best_step) \
        if validation is not None and validation.keep_best else None
    if validation is not None:
        validation.evaluated_best = best is not None
    result = evaluate(parts, parts.engine.detach(), "eval", cfg.train.seed, cfg.model)
    log.write("eval", **result, **({"best_step": best} if best is not None else {}))
    return result


class Validation:
    """The trainer's side of it: when to validate, the evaluation and its log record, the decisions."""

    def __init__(self, every: int, last_step: int, split: str, tracker: BestTracker, keep_best: bool, seed: int,
                 model_cfg: Any, share: ValidationShare | None) -> None:
        self.every, self.last_step, self.split, self.tracker = every, last_step, split, tracker
        self.keep_best, self.seed = keep_best, seed
        self.model_cfg, self.share = model_cfg, share
        self.seconds = 0.0
        """Time spent validating, in all."""
        self.evaluated_best = False
        """The final test evaluation ran on the best validated step's checkpoint."""

    def summary(self) -> dict[str, Any]:
        """What the run's summary says of it."""
        t = self.tracker
        return {"metric": t.metric, "best_step": t.best_step, "best_value": t.best_value, "seconds": self.seconds,
                "evaluations": len(t.history), "evaluated_best": self.evaluated_best}

    def stopped_before(self, log: RunLog, start: int) -> bool:
        """The run resumed from a checkpoint saved at its early stop: nothing is left to train (said in the log)."""
        if self.tracker.stop_at is None:
            return False
        log.write("early_stop", step=start, since_best=self.tracker.since_best, resumed=True)
        return True

    def due(self, done: int) -> bool:
        """Every ``every`` steps and at the run's last step."""
        return done % self.every == 0 or done == self.last_step

    def after_commit(self, parts: Components, log: RunLog, commit: Commit, owner: Callable[[], bool], root: Path,
                     last: bool) -> bool:
        """At each applied commit: validate when due, act on the decisions reached (``owner()``, collective over the
        group, called only when a new best is to be named: whether this group writes the checkpoints, and so
        ``best.json``); whether training stops here."""
        done = commit.step + 1
        decided = self.take()
        if self.due(done) and self.share is not None and last and len(set(commit.sizes.values())) > 1:
            # No later step carries the last value, and groups on different ranks may differ in its last bit:
            # nothing to decide from, so nothing is evaluated (the same on every group: ``commit.sizes`` is).
            log.write("validation_undecided", step=done, reason="the last step, with groups of different sizes")
        elif self.due(done):
            value = self.run(parts, log, done)
            if self.share is None or last:
                # At the last step groups of one size evaluate alike to the bit, so each decides from its own.
                decided.append((done, value, self.tracker.observe(done, value)))
            else:
                self.share.offer(done, value)
        self._decided(decided, parts, log, owner, root)
        return self.tracker.stop_at is not None

    def _decided(self, decided: list[tuple[int, float, bool]], parts: Components, log: RunLog,
                 owner: Callable[[], bool], root: Path) -> None:
        """Log and say each decision; name the best in ``best.json`` once if any was a new best (several arrive
        together after a catch-up: only the latest best is named, never an older one in between)."""
        t = self.tracker
        for step, value, better in decided:
            log.write("validation_decision", step=step, metric=t.metric, value=value, best=better,
                      best_step=t.best_step, best_value=t.best_value, since_best=t.since_best, stop_at=t.stop_at)
            if parts.ctx.is_main:
                from freescale.rank_console import say

                group = f"group {parts.group}: " if parts.groups > 1 else ""
                say(f"freescale: {group}validation at step {step}: {t.metric} {value:.4f}"
                    f"{' (best)' if better else f' (best {t.best_value:.4f} at step {t.best_step})'}"
                    f"{'; early stop: ' + str(t.patience) + ' validations without improvement' if t.stop_at == step else ''}")
        if self.keep_best and any(better for _, _, better in decided) and owner() and parts.ctx.is_main:
            mark_best(root, t.best_step, t.metric, t.best_value)

    def resumed(self, parts: Components, log: RunLog, start: int, root: Path) -> None:
        """The run resumed at ``start`` from a checkpoint (its tracker loaded with it): a validation due there
        whose decision the checkpoint does not hold (with replica groups it comes with the next step) is made
        again, from the same state."""
        t = self.tracker
        if start == self.last_step and self.share is not None:  # no later step carries a value offered now
            if self.due(start) and not (t.history and t.history[-1][0] >= start):
                log.write("validation_undecided", step=start, reason="the last step, resumed: no later step")
            return
        if start and self.due(start) and not (t.history and t.history[-1][0] >= start):
            value = self.run(parts, log, start)
            if self.share is not None:
                self.share.offer(start, value)
            else:
                self._decided([(start, value, t.observe(start, value))], parts, log, lambda: True, root)

    def run(self, parts: Components, log: RunLog, done: int) -> float:
        """Validate the state after ``done`` steps (collective over the group), log it; the metric's value."""
        start = time.perf_counter()
        metrics = evaluate(parts, parts.engine.detach(), self.split, self.seed, self.model_cfg)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        log.write("validate", step=done, split=self.split, seconds=seconds, **metrics)
        return float(metrics[self.tracker.metric])

    def take(self) -> list[tuple[int, float, bool]]:
        """Decisions agreed across groups since the last call (none without replica groups)."""
        if self.share is None:
            return []
        decided, self.share.decided = self.share.decided, []
        return decided
