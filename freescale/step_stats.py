"""What a training step measures about balance: busy time, bubble, and cost-model fits.

``StepTiming`` turns per-step timings into the log's balance fields;
``Calibration`` collects per-rank (lengths, compute time) observations and fits
the loader's cost model to them.  Both are collectives at the steps where the
trainer calls ``compute`` / ``fit_and_share``: every rank must call them there.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from freescale.dataloader.cost import CostModel, calibrate
from freescale.dataloader.loader import StepInfo


class StepTiming:
    """Per-step balance and busy time over a log window (see docs/design.md "Measures").

    ``busy`` is this rank's main-thread CPU time in forward, backward and the
    optimizer step: on CPU, with one compute thread per rank, that is the rank's
    own compute, and time blocked in collectives is not in it.  The bubble
    fraction ``1 - busy / step_time`` is averaged over ranks (all-reduce) and
    steps.  On CUDA kernels run asynchronously and CPU time says nothing, so the
    bubble is reported on CPU only.  ``imbalance`` and ``bound`` are the planner's
    (planned cost, the same on every rank), ``loader_wait_ms`` the time the step
    waited for its batch.
    """

    def __init__(self) -> None:
        self._rows: list[tuple[float, float, float, float, float]] = []

    def add(self, info: StepInfo | None, *, busy: float, wall: float) -> None:
        imbalance, bound, wait = (info.imbalance, info.bound, info.wait_s) if info else (1.0, 1.0, 0.0)
        self._rows.append((busy, wall, imbalance, bound, wait))

    def compute(self, with_bubble: bool) -> dict[str, float]:
        """Collective when ``with_bubble`` (every rank must call it at the same step)."""
        rows = np.array(self._rows) if self._rows else np.zeros((1, 5))
        self._rows.clear()
        busy, wall, imbalance, bound, wait = rows.T
        out = {
            "imbalance": float(imbalance.mean()), "bound": float(bound.mean()),
            "step_ms": 1e3 * float(wall.mean()), "loader_wait_ms": 1e3 * float(wait.mean()),
        }
        if with_bubble:
            per_step = torch.tensor(1.0 - busy / np.maximum(wall, 1e-9), dtype=torch.float64)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(per_step)
                per_step /= dist.get_world_size()
            out["bubble"] = float(per_step.mean())
        return out


class Calibration:
    """Per-step observations (sum L^2, sum L, samples, busy seconds) for ``cost.calibrate``.

    Rank 0 fits on everyone's observations and broadcasts the three coefficients,
    so every rank plans with bit-identical costs (a fit on each rank could differ
    in the last bits on different machines, and the plans with it).  Only the
    latest ``window`` steps are kept, so the exchange stays small in long runs.
    """

    def __init__(self, window: int = 256) -> None:
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=window)

    def add(self, lengths: np.ndarray, busy_s: float) -> None:
        length = lengths.astype(np.float64)
        self._rows.append((float((length * length).sum()), float(length.sum()), float(length.size), busy_s))

    def fit_and_share(self, current: CostModel) -> CostModel | None:
        """Collective.  None while there are too few observations, or when the fit does not
        explain the measured times clearly better (10% lower residual) than ``current``
        does at its best scale: noisy timings must not replace a sound model."""
        mine = torch.tensor(list(self._rows) or [[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
        world = dist.get_world_size() if dist.is_initialized() else 1
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(everyone, mine)
        else:
            everyone = [mine]
        coefficients = torch.zeros(4, dtype=torch.float64)
        if not dist.is_initialized() or dist.get_rank() == 0:
            obs = torch.cat(everyone).numpy()
            obs = obs[obs[:, 2] > 0]
            if obs.shape[0] >= 8:
                fit = calibrate(obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3])
                if _residual(fit, obs) < 0.9 * _residual(current, obs):
                    coefficients = torch.tensor([1.0, fit.quadratic, fit.linear, fit.constant], dtype=torch.float64)
        if world > 1:
            dist.broadcast(coefficients, src=0)
        if coefficients[0] == 0:
            return None
        return CostModel(float(coefficients[1]), float(coefficients[2]), float(coefficients[3]))


def _residual(model: CostModel, obs: np.ndarray) -> float:
    """Root mean square error of ``model``'s prediction, at the scale that fits best."""
    predicted = model.quadratic * obs[:, 0] + model.linear * obs[:, 1] + model.constant * obs[:, 2]
    scale = float(predicted @ obs[:, 3] / max(float(predicted @ predicted), 1e-300))
    return float(np.sqrt(np.mean((obs[:, 3] - scale * predicted) ** 2)))
