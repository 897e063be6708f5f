"""``freescale report RUN_DIR``: one self-contained HTML page from a run's logs.

- ``logs``: reads ``train_log.jsonl`` / ``replica<g>/train_log.jsonl`` and ``rank<r>.killed``
  (one-line ``ReportError`` for a missing directory, no log, a malformed line)
- ``figures``: step time, planned imbalance and measured bubble, loader wait; loss/AUC,
  capacity and calibrations; the fault-tolerance timeline (quorum membership, kills, restarts,
  redo attempts, catch-up phases, committed steps per group)
- ``page``: the HTML (summary, what happened, figures as embedded PNGs)

matplotlib is an optional extra (``pip install -e '.[report]'``): without it the command says
so in one line.
"""

from freescale.report.page import write_report

__all__ = ["write_report"]
