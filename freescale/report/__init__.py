"""``freescale report RUN_DIR``: one self-contained HTML page from a run's logs.

- ``logs``: reads ``train_log.jsonl`` / ``replica<g>/train_log.jsonl`` and ``rank<r>.killed``;
  tolerates what killed writers and reused directories leave (truncated lines, earlier runs,
  stale kill files: noted on the page), thins long runs for the figures, and checks each event's
  fields by kind (one-line ``ReportError`` naming ``file:line`` and the field; a missing
  directory, no log, a file that is not a log)
- ``figures``: step time, planned imbalance and measured bubble, loader wait; loss/AUC,
  capacity and calibrations; the fault-tolerance timeline (quorum membership, kills, restarts,
  redo attempts, catch-up phases, committed steps per group)
- ``page``: the HTML (summary, what the reader skipped or thinned, what happened, figures as
  embedded PNGs; which figures are per step and which per log window)

matplotlib is an optional extra (``pip install -e '.[report]'``): without it the command says
so in one line.
"""

from freescale.report.page import write_report

__all__ = ["write_report"]
