"""What a run reports: the JSONL log, the progress output, the metric windows (one format, any mode).

One log per replica group (its rank 0 writes it; without fault tolerance the
run is one group): ``<train.output_dir>/train_log.jsonl``, or
``<train.output_dir>/replica<g>/train_log.jsonl`` with ``--replicas``.  One
JSON object per line, flushed, each with ``event`` and ``time``:

``start``       config, world size, backend, device, versions, pid, group, incarnation
``resume``      step, path (``no_resume`` when a checkpoint was not used, and why)
``warm_up``     seconds (fault tolerance: torchrec's lazy set-up before the first quorum)
``commit``      every step this group committed with valid state: ``step``, ``samples``
                (this group's), ``seconds``, ``batch_wait_s``, ``busy_s``; with fault
                tolerance the quorum (``quorum_id``, ``participants``, ``attempts``,
                ``contributing``, ``weight``, ``ready``, waits); with ``FREESCALE_AUDIT``
                ``digest`` and ``rows`` (``freescale.testing``)
``step``        every ``train.log_every`` steps: loss, AUC, NE over the window (reduced
                over the group's ranks), samples/s, epoch, skipped rows, imbalance,
                bubble, loader wait
``calibrate``, ``checkpoint``, ``stage``, ``catch_up``, ``eval``, ``summary``
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from freescale.step_stats import StepTiming
from freescale.tasks import Ranking, Task


class RunLog:
    """JSONL events (one object per line, flushed) on the group's rank 0; a no-op elsewhere.  ``sinks``
    get every event too (``tensorboard_log.TensorBoardSink``)."""

    def __init__(self, path: Path | None, sinks: Sequence[Any] = ()) -> None:
        self._fh: TextIO | None = None
        self.sinks = list(sinks) if path is not None else []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a")

    def write(self, event: str, **fields: Any) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
            self._fh.flush()
        for sink in self.sinks:
            sink(event, fields)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        for sink in self.sinks:
            sink.close()


class Progress:
    """Metric windows, balance timings and the progress output of one run."""

    def __init__(self, log: RunLog, total: int, initial: int, name: str, show: bool, on_cpu: bool,
                 global_batch: int, label: str = "", task: Task | None = None) -> None:
        self.log, self.total, self.show, self.on_cpu = log, total, show, on_cpu
        self.label = label
        """Printed before each progress line (``group 1  ``: several groups share one terminal)."""
        self.global_batch = global_batch
        self.task = task or Ranking()
        self.window, self.run_window, self.timing = self.task.window(), self.task.window(), StepTiming()
        self.last: dict[str, float] = {"loss": float("nan"), "samples": 0}
        self.bar = tqdm(total=total, initial=initial, desc=f"train {name}", unit="step",
                        disable=not (show and sys.stderr.isatty()), dynamic_ncols=True)
        self._window_start = time.perf_counter()
        self.scores: dict[str, Any] = {}
        """The ranks' latest speed scores (``freescale.rank_speed``), written with each step record."""
        self.timed_from = time.perf_counter()
        self.timed_steps = 0
        self.samples = 0

    def add(self, outputs: Sequence[torch.Tensor]) -> None:
        """A committed step's outputs (the task's: ``tasks`` module docstring)."""
        self.window.add(outputs)
        self.run_window.add(outputs)

    def timed(self, first_of_process: bool) -> None:
        """After each committed step; the first step of a process pays for lazy set-up: not timed."""
        if first_of_process:
            self.timed_from = time.perf_counter()
        else:
            self.timed_steps += 1

    def report(self, done: int, epoch: int, skipped_rows: int) -> None:
        """Every ``log_every`` steps (collective over the group: metrics and bubble are reduced)."""
        self.last = self.window.compute()
        now = time.perf_counter()
        rate = self.last["samples"] / max(now - self._window_start, 1e-9)
        self._window_start = now
        balance = self.timing.compute(self.on_cpu)
        metrics = {k: v for k, v in self.last.items() if k != "samples"}
        self.log.write("step", step=done, **metrics, samples_per_s=rate, epoch=epoch, skipped_rows=skipped_rows,
                       **balance, **self.scores)
        shown = {"loss": f"{self.last['loss']:.4f}"}
        if self.task.headline is not None:
            shown[self.task.headline] = f"{self.last[self.task.headline]:.3f}"
        self.bar.set_postfix(**shown)
        if self.bar.disable and self.show:
            if not self.last["samples"]:  # (a group that sat the window out: catching up, or not planned in yet)
                print(f"{self.label}step {done}/{self.total}  nothing trained since the last line", flush=True)
                return
            print(f"{self.label}step {done}/{self.total}  " + "  ".join(f"{k} {v}" for k, v in shown.items())
                  + f"  {rate:,.0f} samples/s  imbalance {balance['imbalance']:.3f}", flush=True)

    def close(self) -> float:
        """Seconds since timing began."""
        self.bar.close()
        return time.perf_counter() - self.timed_from

    @property
    def samples_per_s(self) -> float:
        seconds = time.perf_counter() - self.timed_from
        return self.timed_steps * self.global_batch / seconds if self.timed_steps else float("nan")
