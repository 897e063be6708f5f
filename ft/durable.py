"""The lighthouse's durable facts, in one small JSON file that survives its restart.

What a restarted lighthouse must not forget, or it could let a step be committed twice
(``freescale.ft.membership``): the run it serves, the highest quorum id it gave out, the
highest step a quorum reached, whether the run finished, and which groups (in which
incarnation) committed the last step holding valid state, that is, who may hold the job's
newest state.

Written whole to a temporary file beside the target, fsynced, renamed over it and the
directory fsynced: a kill at any moment leaves the old file or the new one, never a mix.
Membership changes (a new quorum, new holders, a finish, a new run) are written before any
participant is told; the growing ``high_step`` is written at most once a second (it is a lower
bound: the rule that prevents a roll-back rests on the holders, not on this number).

The format is plain JSON, read with ``json`` and checked field by field: no pickle, and a
file that is not what this module writes is refused in one line that names it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "freescale-lighthouse-state/1"


class StateFileError(ValueError):
    pass


@dataclass
class DurableState:
    run_id: str | None = None
    quorum_id: int = 0
    high_step: int = -1
    finished_step: int | None = None
    holders_quorum_id: int = 0
    """The quorum the holders below committed in (or reported, to a lighthouse without a file)."""
    holders: dict[str, int] = field(default_factory=dict)
    """replica_id -> incarnation: the groups that committed the last step holding valid state."""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @staticmethod
    def from_json(body: Any, where: str) -> DurableState:
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise StateFileError(f"{where}: not a lighthouse state file (expected format '{FORMAT}')")

        def number(name: str) -> int:
            value = body.get(name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise StateFileError(f"{where}: field '{name}' must be an integer, got {value!r}")
            return value

        holders = body.get("holders")
        if not isinstance(holders, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in holders.items()):
            raise StateFileError(f"{where}: field 'holders' must map replica ids to incarnations")
        run_id = body.get("run_id")
        if run_id is not None and not isinstance(run_id, str):
            raise StateFileError(f"{where}: field 'run_id' must be a string or null")
        finished_step = None if body.get("finished_step") is None else number("finished_step")
        return DurableState(run_id=run_id, quorum_id=number("quorum_id"), high_step=number("high_step"),
                            finished_step=finished_step, holders_quorum_id=number("holders_quorum_id"),
                            holders=dict(holders))


def load(path: str | os.PathLike[str]) -> DurableState | None:
    """The state saved at ``path``; None when there is no file yet (a first start)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateFileError(f"{p}: cannot read the lighthouse state: {exc.strerror or exc}") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise StateFileError(f"{p}: the lighthouse state is not JSON ({exc})") from None
    return DurableState.from_json(body, str(p))


def _temp_beside(p: Path) -> tuple[int, str]:
    """A new temporary file in ``p``'s directory (made if missing), where ``save`` writes before it replaces ``p``."""
    p.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)


def check_writable(path: str | os.PathLike[str]) -> None:
    """Whether ``save`` can write ``path`` (its directory made, a file created there and removed): at start, so a
    state file the lighthouse cannot write stops it before it serves, not at its first change of state."""
    p = Path(path)
    try:
        fd, probe = _temp_beside(p)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(f"lighthouse: cannot write its state file {p} ({exc.strerror or type(exc).__name__})") from None


def save(path: str | os.PathLike[str], state: DurableState) -> None:
    """Replace ``path`` with ``state`` atomically and durably (module docstring)."""
    p = Path(path)
    fd, tmp = _temp_beside(p)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(state.to_json(), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
