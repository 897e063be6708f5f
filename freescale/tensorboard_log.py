"""The run log's numbers as TensorBoard scalars (``log.tensorboard = true``; the ``tensorboard`` extra).

The JSONL log (``run_log.RunLog``) stays the record every tool reads (``freescale report``, the audits);
this is a second sink of the same events, written by the group's rank 0 through
``torch.utils.tensorboard``.  Each numeric field of the events below becomes ``<event>/<field>`` at
the event's step:

- ``step`` (every ``train.log_every`` steps): loss, AUC, NE, samples/s, imbalance, bubble, loader wait;
- ``commit`` (every step): step time, busy time, batch wait, the LR factor and gradient norm where a
  schedule or clipping is on, and with replica groups the groups that took part and the exchange times;
- ``validate`` (every ``eval.every`` steps): the validation split's metrics and the seconds they took;
- ``eval``: the held-out (test) metrics at the end (of the best validated step, with ``eval.keep_best``);
- ``catch_up`` and ``resume``: ``ft/recoveries`` and ``checkpoint/resumes`` counted up.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from freescale.config import ConfigError

SCALAR_EVENTS = ("step", "commit", "validate", "eval")
COUNTED_EVENTS = {"catch_up": "ft/recoveries", "resume": "checkpoint/resumes", "fail_slow": "balance/fail_slow"}


class TensorBoardSink:
    """Writes the events of one run log (``__call__(event, fields)``) to ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("log.tensorboard: needs the tensorboard package "
                              "(pip install 'freescale[tensorboard]')") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.counts: dict[str, int] = {}
        self._last_step = 0

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        step = fields.get("step")
        if isinstance(step, int):
            self._last_step = step
        if event in COUNTED_EVENTS:
            tag = COUNTED_EVENTS[event]
            self.counts[tag] = self.counts.get(tag, 0) + 1
            self.writer.add_scalar(tag, self.counts[tag], self._last_step)
        if event not in SCALAR_EVENTS:
            return
        for key, value in fields.items():
            if key == "step":
                continue
            if key == "participants" and isinstance(value, list):
                key, value = "participating_groups", len(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(f"{event}/{key}", value, self._last_step)

    def close(self) -> None:
        self.writer.close()
