"""Each replica group's durable record of the last step the job committed, beside the checkpoints.

The lighthouse's ``--state`` file is what keeps a restarted lighthouse from letting a group restored from an
older checkpoint commit again steps the job already committed.  Without it (no ``--state``, a lost disk, an
operator's mistake) a lighthouse that restarts while the groups holding the newest state are hung or
stopped sees only the restarted group, takes the run for a fresh one, and that group commits again, from
its checkpoint, steps the job had committed with other states.

So the groups keep the fact themselves: rank 0 of each group writes ``<checkpoints>/commits/<replica>.json``
after every step it commits (``{"run": id, "step": S, "quorum": Q}``; a write and an atomic rename, fsynced
when the quorum changes, as the lighthouse's own state is, and at least every ``FSYNC_EVERY_S``).  A group
about to resume from a checkpoint while the lighthouse reports a fresh run reads every group's record
(``job_high``): if the job committed beyond the checkpoint, those steps would be committed again, so the
group waits for the groups that hold them (they catch it up when they are back) and says so in one line, or
proceeds only if the operator accepts the loss (``ft.accept_rollback``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FSYNC_EVERY_S = 5.0
"""The longest a record stays only in the page cache (a process crash keeps it; an OS crash loses this much)."""


@dataclass(frozen=True)
class JobHigh:
    """The newest step any group's record says the job committed, and which groups say so."""

    step: int
    groups: tuple[str, ...]


class CommitRecord:
    """One group's record (written by its rank 0)."""

    def __init__(self, directory: Path, replica_id: str, run_id: str) -> None:
        self.path = directory / f"{replica_id}.json"
        self.run_id = run_id
        self._quorum = -1
        self._synced_at = 0.0
        directory.mkdir(parents=True, exist_ok=True)

    def note(self, step: int, quorum_id: int) -> None:
        """``step`` was committed (in quorum ``quorum_id``)."""
        now = time.monotonic()
        sync = quorum_id != self._quorum or now - self._synced_at >= FSYNC_EVERY_S
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w") as fh:
            fh.write(json.dumps({"run": self.run_id, "step": int(step), "quorum": int(quorum_id)}))
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        if sync:
            self._quorum, self._synced_at = quorum_id, now


def job_high(directory: Path, run_id: str) -> JobHigh:
    """The newest committed step over every group's record of run ``run_id`` (-1 when none)."""
    best, groups = -1, []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a record being replaced: the rename is atomic, so this is a foreign file
        if not isinstance(record, dict) or record.get("run") != run_id:
            continue
        step = int(record.get("step", -1))
        if step > best:
            best, groups = step, [path.stem]
        elif step == best:
            groups.append(path.stem)
    return JobHigh(best, tuple(groups))


def hold_back_rollback(directory: Path, run_id: str, start: int, fresh_run: Callable[[], bool],
                       say: Callable[[str], None], accept: bool, poll_s: float = 1.0,
                       agree: Callable[[bool], bool] = lambda ok: ok) -> bool:
    """A group about to start the run at step ``start`` (its checkpoint's, or 0) because the lighthouse reports
    a fresh run (``fresh_run``, a collective of the group): if the groups' records say the job committed step
    ``start`` or later, wait until the lighthouse hears from the groups that hold them (``fresh_run`` turns
    False: this group then catches up from them), saying so in one line; with ``accept``, go on and say what
    is lost.  Returns what ``fresh_run`` last said (True: start at ``start``).  ``agree``: True only if every
    rank of the group says True (its ranks read the records at slightly different moments)."""
    high = job_high(directory, run_id)
    if agree(high.step < start):
        return True
    lost = f"steps {start}..{high.step}"
    if accept:
        say(f"ft.accept_rollback: starting again at step {start}; {lost}, committed by the job before (records of "
            f"{', '.join(high.groups)}), are trained again with other states")
        return True
    say(f"the job committed up to step {high.step} (records of {', '.join(high.groups)} in {directory}); starting "
        f"at step {start} would commit {lost} again with other states. Waiting for the groups that hold them "
        "(hung, stopped or cut off?) to come back: this group then catches up from them. If they are gone for "
        "good: restart the job with --resume (a new run, from the newest checkpoint), or accept losing those "
        "steps with --ft.accept_rollback true")
    while fresh_run():
        time.sleep(poll_s)
    return False


__all__ = ["CommitRecord", "JobHigh", "hold_back_rollback", "job_high"]
