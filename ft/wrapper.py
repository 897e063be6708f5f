"""The wrapper form: a plain torch or torchrec loop made fault tolerant by wrapping its optimizer.

In the spirit of torchft's optimizer wrapper, the loop keeps its shape::

    samples = ft.StepSamples(per_step=4096)                  # which samples each group and rank trains
    optimizer = ft.wrap(model, optimizer, data=samples, scheduler=scheduler)
    for step in optimizer.steps(total_steps):                # only the steps this group trains
        batch = my_batch(samples.mine(step))                 # this rank's share of the step
        optimizer.zero_grad()
        loss = loss_fn(model(batch), batch.labels)           # the mean over this rank's samples
        loss.backward()                                      # dense buckets reduced in the group and across
        optimizer.step()                                     # exchange, vote, update; the scheduler steps

What happens where, and what overlaps with what:

- ``steps`` sends the step's quorum request before it yields the step, so its round trip overlaps the
  loop's data loading and forward (as ``begin_step`` does in the explicit form).  A forward hook on
  ``model`` arms the gradient buckets once the forward is done (its embedding lookups go into the
  exchange's header, as ``backward`` does it in the explicit form: armed before the forward, the
  header was empty and steps ran 10x slower, measured by ``benchmarks/bench_ft_wrapper.py``), so a plain ``loss.backward()`` reduces
  each bucket in the group and across groups while the rest of backward runs.  Steps this group
  cannot train (it is catching up from a peer, or has no samples planned) are run here without
  yielding: the loop body only sees real work.
- The sample weight and the loss scale come from ``data`` (``weight``, ``rank_samples``): a forward
  hook on ``model`` scales the gradient flowing out of its outputs so that a per-rank mean loss
  becomes the group's sample mean (``loss_reduction="sum"`` for a summed loss).  Nobody scales by hand.
- ``step()`` is the rest of the exchange, the vote and, once committed, the update: the dense
  optimizer on the sample-weighted average of every group's gradients, the fused embedding tables'
  union update, then ``scheduler.step()``.  The scheduler is stepped by the layer, also for steps a
  recovering group replays, and travels in the snapshot: do not step it in the loop.
- A job that finished elsewhere (the other groups completed the run while this one restarted) ends the
  iteration; ``steps`` calls ``finish`` and ``close`` when it is exhausted.

The explicit 4-call form (``FaultTolerance``: ``begin_step``, ``can_train``, ``backward``, ``step``) is
what freescale's own pipelines use; the wrapper is a thin layer over it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from freescale.ft.config import FTConfig, incarnation
from freescale.ft.layer import FaultTolerance
from freescale.step_types import Commit, DataSide, DataState, JobFinished

FAULTS_DIR_ENV = "FREESCALE_FAULTS_DIR"
"""Where fault injection (``FREESCALE_FAULTS``, tests) leaves its marker files in the wrapper form."""


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, *, data: DataState, scheduler: Any | None = None,
         cfg: FTConfig | None = None, loss_reduction: str = "mean") -> FaultTolerantOptimizer:
    """``optimizer`` wrapped for fault tolerance across replica groups (module docstring).

    ``model``: a torchrec ``DistributedModelParallel`` sharded by ``freescale.ft.shard`` (fused kernels, or
    data_parallel tables where asked; no DDP), or a module with dense parameters only.  ``optimizer``: over the
    dense parameters and any data_parallel table's (a table no optimizer steps is refused), with the fused one
    in a ``CombinedOptimizer`` for torchrec.  ``data``: ``StepSamples`` or any
    ``DataState`` that reports ``weight`` and ``rank_samples``.  ``scheduler``: a torch LR scheduler
    over the dense optimizer.  ``cfg``: default ``FTConfig.from_env()`` (what ``freescale launch`` sets).
    """
    from freescale.launch import FutileRestart, restart_is_futile
    from freescale.rank_console import install_excepthook, launched
    from freescale.testing import hooks_from_env

    if launched():  # a rank `freescale launch` owns: a refusal, or a peer's failure later, ends it in one line
        install_excepthook()
    if restart_is_futile():  # an earlier incarnation met an error no restart fixes: end before any collective
        raise FutileRestart("freescale.ft.wrap: an earlier incarnation of this group stopped on an error no restart "
                            "can fix; this one ends (the launcher reports that error)")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"freescale.ft.wrap: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    side = DataSide(data, "freescale.ft.wrap")
    if not side.weighs:
        raise ValueError("freescale.ft.wrap: data must report weight(step) and rank_samples(step) "
                         "(freescale.ft.StepSamples does)")
    cfg = cfg or FTConfig.from_env()
    if not cfg.enabled:
        raise ValueError("freescale.ft.wrap: no lighthouse (FREESCALE_LIGHTHOUSE is not set): run the loop under "
                         "`freescale launch --replicas R --ranks-per-replica G -- python ...`, or pass cfg= with "
                         "the lighthouse's URL")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    hooks = hooks_from_env(cfg.replica_index, rank, incarnation(),
                           Path(os.environ.get(FAULTS_DIR_ENV, ".")) / cfg.replica_id)
    # A model or optimizer the layer cannot keep identical, or a state that cannot travel (checked now, not
    # when a peer needs it): a ValueError beginning "fault tolerance:" (under the launcher, one line, exit 2).
    layer = FaultTolerance(model, optimizer, cfg, data=side, hooks=hooks, scheduler=scheduler)
    layer.check_snapshot()
    return FaultTolerantOptimizer(layer, model, optimizer, side, loss_reduction)


class FaultTolerantOptimizer:
    """The user's optimizer, fault tolerant (module docstring): ``steps``, ``zero_grad``, ``step``;
    ``register_state`` for more state in the snapshot; ``commit`` and ``record`` describe the last step."""

    def __init__(self, layer: FaultTolerance, model: nn.Module, optimizer: torch.optim.Optimizer, data: DataSide,
                 loss_reduction: str) -> None:
        self._layer, self._optimizer, self._data, self._reduction = layer, optimizer, data, loss_reduction
        self._to_arm: int | None = None
        """The step whose buckets the model's next forward arms (after it: the lookups it made are in the
        exchange's header, as in the explicit form where ``backward`` arms them)."""
        self._stepped = True
        self.commit: Commit | None = None
        """The last committed step's outcome (``step``, ``trained``, ``ready``, ``applied``, ``restored``)."""
        model.register_forward_hook(self._scale_outputs)

    @property
    def record(self) -> dict[str, Any]:
        """The last step's record: participants, attempts, timings, the rate (for a log)."""
        return self._layer.record

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    def register_state(self, name: str, state_dict: Any, load_state_dict: Any, on_commit: Any = None) -> None:
        """More state in the snapshot a recovering group loads; what advances per step advances in
        ``on_commit(commit)`` (``FaultTolerance.register_state``; refused at once if it cannot travel)."""
        self._layer.register_state(name, state_dict, load_state_dict, on_commit)
        self._layer.check_snapshot()

    def steps(self, total: int) -> Iterator[int]:
        """The steps ``0 .. total - 1`` this group trains, each after its quorum request is on its way."""
        layer = self._layer
        layer.start()
        step, finished = 0, False
        try:
            while step < total and not finished:
                step = layer.begin_step(step)  # (a waiting join: the quorum's step, its snapshot loaded)
                if layer.can_train(step):
                    self._to_arm, self._stepped = step, False
                    yield step
                    if not self._stepped:
                        raise RuntimeError(f"freescale.ft: step {step} ended without optimizer.step()")
                else:
                    self.commit = self._commit()
                finished = self.commit is None
                step = self.commit.step + 1 if self.commit is not None else step
            if not finished and total > 0:  # (nothing to train: nothing to say finished)
                layer.finish(total - 1)
        finally:
            layer.close()

    def _scale_outputs(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Forward hook: the step's buckets are armed (once the forward made its lookups) and the gradient
        flowing back into the model's outputs is scaled (module docstring)."""
        if self._to_arm is None or not torch.is_grad_enabled():
            return
        step, self._to_arm = self._to_arm, None
        scale = self._layer._arm(None)  # the weight from data; the mean-loss scale: n_rank * ranks / n_group
        if self._reduction == "sum":
            scale /= max(self._data.rank_samples(step) or 0, 1)
        found = [0]
        scaled = _map_tensors(output, lambda t: _scaled(t, scale, found))
        if not found[0]:
            raise ValueError("freescale.ft: the model's output holds no tensor that requires grad (return a "
                             "tensor, or a tuple, list or dict of them)")
        return scaled

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: ``steps`` armed the step, the dense gradients are views of the reduction
        buckets, cleared then (setting them to None here would detach them), and the fused tables
        have no gradients.  Kept so the loop reads as any torch loop."""

    def step(self, closure: Any = None) -> Commit | None:
        """The step's exchange, vote and update (module docstring); the commit, or None once the job
        finished elsewhere (``steps`` then ends)."""
        if closure is not None:
            raise ValueError("freescale.ft: optimizer.step(closure) is not supported")
        if self._to_arm is not None:
            raise RuntimeError("freescale.ft: optimizer.step() before the model's forward in this step")
        self._layer._after_backward()
        self._stepped = True
        self.commit = self._commit()
        return self.commit

    def _commit(self) -> Commit | None:
        try:
            return self._layer.step()
        except JobFinished:
            return None

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back through it is multiplied by ``scale``.  Applied to copies
    of the outputs the loop sees, so a path from one output into another inside the model is scaled once."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _scaled(t: torch.Tensor, scale: float, found: list[int]) -> torch.Tensor:
    if not t.requires_grad:
        return t
    found[0] += 1
    return _ScaleGrad.apply(t, scale)


def _map_tensors(value: Any, fn: Any) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)`` (tuples, lists, dicts; other values as they are)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value
