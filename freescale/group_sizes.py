"""What a replica group's agent does when one of its ranks fails (``[ft] on_rank_loss``), and when a lost rank's
slot comes back (``[ft] grow_back_after_s``): ``GroupSizes``, read by ``freescale.launch.launch_local``.

A group that shrinks re-forms as a new elastic launch on fewer ranks; its ranks learn the whole group's size
(``FREESCALE_GROUP_RANKS``: they stand in for the lost positions, ``freescale.ft.replica_group``), their
incarnation (``FREESCALE_INCARNATION_BASE``: the lighthouse tells incarnations apart) and what a failure will
lead to (``AFTER_FAILURE_ENV``) from the environment it sets.  A rank that cannot train at the new size says
why (``refuse_shrink``) and the agent restarts the group at its size before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, NoReturn

from freescale.ft.config import GROUP_RANKS_ENV, INCARNATION_BASE_ENV, REPLICA_INDEX_ENV

ERROR_DIR_ENV = "FREESCALE_ERROR_DIR"
AFTER_FAILURE_ENV = "FREESCALE_AFTER_FAILURE"
"""What a rank failure leads to in this launch (``GroupSizes``): a rank that saw a peer fail says it."""
FORMED_ENV = "FREESCALE_GROUP_FORMED"
"""Why this launch of the group formed, said by its rank 0 as it starts (``rank_console.install``): re-formed on
fewer ranks, or grown back; unset, a restart after a failure."""
SHRINK_REFUSED = "shrink_refused.txt"
"""Written in ``$FREESCALE_ERROR_DIR`` by a rank of a group re-formed on fewer ranks that cannot train at that size
(``refuse_shrink``): the agent restarts the group at its size before instead."""


class ShrinkRefused(RuntimeError):
    """Raised by a rank of a shrunk group that cannot train at its size, after ``refuse_shrink``: it ends the rank
    (status 1) and its agent, which says why in one line, restarts the group at its size before."""


def refuse_shrink(reason: str, ranks: int, full: int) -> NoReturn:
    """A rank of a group on ``ranks`` of its ``full`` ranks that cannot train at that size: tell the agent (one
    line, ``reason``: its plan cannot move or fit, ``freescale.shrunk_plan``; or its tables are averaged across
    groups by slices of each rank's buffers, laid out differently on fewer ranks) and end (``ShrinkRefused``)."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        Path(error_dir, SHRINK_REFUSED).write_text(reason)
    raise ShrinkRefused(f"fault tolerance: replica group {os.environ.get(REPLICA_INDEX_ENV, '0')} cannot train on "
                        f"{ranks} of its {full} ranks: {reason}")


def take_shrink_refusal(error_dir: str) -> str:
    path = Path(error_dir, SHRINK_REFUSED)
    reason = path.read_text() if path.exists() else ""
    path.unlink(missing_ok=True)
    return reason


class RankLoss(NamedTuple):
    """How a launch ended: its first failed rank."""

    rank: int
    how: str
    pid: int
    lost: bool = True
    """False for a restartable user error (said already): the rank is not gone, the group restarts if it may."""


class GroupSizes:
    """A replica group agent's answer to a rank failure (``[ft] on_rank_loss``).

    ``restart``: torch's agent restarts the whole group at its size, ``--max-restarts`` times.  ``shrink``: every
    failure comes back here (each launch has no restart of torch's own).  While the group has more than
    ``min_group_ranks`` ranks, it re-forms at once on one rank fewer (a new elastic launch, incarnation counted
    on: ``FREESCALE_INCARNATION_BASE``); its ranks catch up from a peer group, serve the lost rank's positions in
    the exchange across groups (``FREESCALE_GROUP_RANKS``: the whole group's ranks) and are planned a share in
    proportion to their number.  At the minimum, a failure restarts the group at its size while
    ``--max-restarts`` allows.  A shrunk group that cannot train at its size (``refuse_shrink``) restarts at the
    size before instead, if a restart is left, and shrinks no more.  Every change is one console line; the ranks
    read what a failure will lead to from ``AFTER_FAILURE_ENV`` (``freescale.rank_console``)."""

    def __init__(self, ranks: int, max_restarts: int, on_rank_loss: str, min_group_ranks: int,
                 grow_back_after_s: float = 0.0) -> None:
        self.full, self.size, self.restarts_left = ranks, ranks, max_restarts
        self.shrinks = on_rank_loss == "shrink"
        self.min_ranks = max(1, min_group_ranks)
        self.grow_back_after_s = grow_back_after_s
        self._launches = 0
        self._given = 0
        self._growing = threading.Event()
        os.environ[GROUP_RANKS_ENV] = str(ranks)

    @contextlib.contextmanager
    def growing_back(self) -> Iterator[None]:
        """Around a launch: on fewer ranks than the group's own, with ``grow_back_after_s`` set, stop it after that
        long (SIGTERM to this agent: torch's agent stops the ranks, the other groups go on without this one, and
        the step in flight is redone without it) so that ``grew_back`` re-forms the group at its size."""
        timer = None
        if self.size < self.full and self.grow_back_after_s > 0:
            def grow() -> None:
                while not _another_holder():  # never take down the only group that holds the run's state
                    if stop.wait(2.0):
                        return
                self._growing.set()
                os.kill(os.getpid(), signal.SIGTERM)
            stop = threading.Event()
            timer = threading.Timer(self.grow_back_after_s, grow)
            timer.daemon = True
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                stop.set()
                timer.cancel()

    def grew_back(self) -> bool:
        """The launch was stopped to grow the group back (``growing_back``): launch it again at its size."""
        if not self._growing.is_set():
            return False
        self._growing.clear()
        self._launches += self._given + 1
        self.restarts_left -= self._given
        group = f"replica group {os.environ.get(REPLICA_INDEX_ENV, '0')}"
        _say(f"{group}: back to {_ranks(self.full)} (the lost rank's slot is tried again after "
             f"{self.grow_back_after_s:g} s)")
        self.size = self.full
        os.environ[FORMED_ENV] = f"grown back to {_ranks(self.full)}"
        return True

    def restarts_now(self) -> int:
        """Restarts torch's agent may make in the next launch (none under ``shrink``: this decides each)."""
        os.environ[INCARNATION_BASE_ENV] = str(self._launches)
        self._given = 0 if self.shrinks or self.size < self.full else self.restarts_left
        shrinks = self.shrinks and self.size > self.min_ranks
        # (Read by a rank only once torch's own restarts of this launch are spent: then, with torch's agent
        # restarting, the group stops.)
        os.environ[AFTER_FAILURE_ENV] = ("no restart left: the group stops" if self._given else
                                         "the group continues on the ranks it has left" if shrinks else
                                         "its group restarts" if self.restarts_left > 0 else
                                         "no restart left: the group stops")
        return self._given

    def after_loss(self, lost: RankLoss, refusal: str) -> bool:
        """The launch ended on a rank's failure: whether to launch again (at ``size``), saying why in one line."""
        self._launches += self._given + 1  # every incarnation of that launch
        self.restarts_left -= self._given
        group = f"replica group {os.environ.get(REPLICA_INDEX_ENV, '0')}"
        if refusal:
            self.shrinks = False  # it cannot train smaller: no further shrink either
            if self.restarts_left <= 0:
                _say(f"{group}: cannot continue on {_ranks(self.size)}: {refusal}; no restart left: the group stops")
                return False
            self.size, self.restarts_left = self.size + 1, self.restarts_left - 1
            os.environ.pop(FORMED_ENV, None)
            _say(f"{group}: cannot continue on {_ranks(self.size - 1)}: {refusal}; restarts on {_ranks(self.size)}")
            return True
        if self._given:  # torch's agent spent the restarts it was given
            return False
        if self.shrinks and self.size > self.min_ranks and lost.lost:
            self.size -= 1
            _say(f"{group}: lost rank {lost.rank} ({lost.how}); continues on {_ranks(self.size)} at "
                 f"{self.size / self.full:.2f} share")
            os.environ[FORMED_ENV] = f"re-formed on {_ranks(self.size)}, without the lost one"
            return True
        if self.restarts_left > 0:
            os.environ.pop(FORMED_ENV, None)
            self.restarts_left -= 1
            _say(f"{group}: {'lost ' if lost.lost else ''}rank {lost.rank} ({lost.how}); restarts on {_ranks(self.size)}")
            return True
        return False


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _say(line: str) -> None:
    print(f"freescale: {line}", file=sys.stderr, flush=True)




def _another_holder() -> bool:
    """The lighthouse (``FREESCALE_LIGHTHOUSE``) names another healthy group among those holding the run's newest
    state: this group may leave to grow back without the run's progress leaving with it.  False when it cannot
    be asked (the group stays as it is, and asks again)."""
    import json
    import urllib.request

    from freescale.ft.config import LIGHTHOUSE_ENV, TOKEN_ENV

    url, me = os.environ.get(LIGHTHOUSE_ENV, ""), f"replica{os.environ.get(REPLICA_INDEX_ENV, '0')}"
    if not url:
        return False
    token = os.environ.get(TOKEN_ENV, "")
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/status",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            status = json.loads(reply.read())
    except (OSError, ValueError):
        return False
    groups = status.get("groups") or {}
    return any(rid != me and (groups.get(rid) or {}).get("healthy") for rid in status.get("holders") or [])
