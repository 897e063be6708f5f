"""What a rank says on the user's terminal when a fault is handled, and where the detail goes.

Under the elastic agent (``freescale launch``, torchrun) a rank whose peer dies or hangs sees its
own collectives fail; the agent then stops the group and, with restarts left, starts it again
(with replica groups it catches up from the others).  That is a handled fault: it gets **one
line** on stderr (which group, which rank, what happened, what happens next) and the traceback
goes to the rank's log file, ``<train.output_dir>/[replica<g>/]rank<r>.log``.  An error that is
not a peer's failure (a bug) keeps its traceback on the terminal.

The same file receives every thread's Python stack when the rank gets ``SIGUSR1``
(``faulthandler``): ``kill -USR1 <pid>`` on each rank of a stuck job says where each one is, with
no py-spy needed.  The rank's pid is in ``rank<r>.pid`` beside its log (under ``freescale launch`` the
process the agent started is a client of the fork server, ``freescale.forkserver``, which passes
signals on; this is the rank itself).  A restarted incarnation says so in one line as it starts.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_PEER_FAILURE = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                 "timed out", "socket closed", "replica group:", "of the group are gone")
"""Words of the errors a collective raises when a peer died or hung (gloo, NCCL, the store,
``freescale.ft.replica_group`` giving up on a lost quorum, the SM-free backend: ``kernels/sm_free_backend.py``)."""

_SAW_FAILURE = ".saw_failure"
"""``rank<r>.saw_failure`` beside the rank's log: it ended on a peer's failure, it is not the peer that failed."""

_state: dict[str, Any] = {}

_REFUSALS = ("fault tolerance:", "freescale.ft")
"""How the layer's refusals of a model or a loop begin (``ft/sparse_sync.py``, ``ft/layer.py``, ``ft.shard``)."""


def _group() -> str:
    group = os.environ.get("FREESCALE_REPLICA_INDEX")
    return f"replica group {group}" if group is not None else "the group"


def install(output_dir: str, replica_id: str | None) -> Path:
    """The rank's log file (``SIGUSR1`` dumps every thread's stack into it); returns its path.
    A restarted incarnation's rank 0 says so on stderr."""
    directory = Path(output_dir) / (replica_id or "")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{os.environ.get('RANK', '0')}.log"
    pid_file = directory / f"rank{os.environ.get('RANK', '0')}.pid"
    stream: IO[str] = path.open("a", buffering=1)
    _state.update(path=path, stream=stream, pid_file=pid_file)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)
    from freescale.ft.config import incarnation
    from freescale.ft.standby import STANDBY_ENV

    if os.environ.get(STANDBY_ENV):  # active or a warm standby: the lock decides (``took_over``)
        return path
    pid_file.write_text(str(os.getpid()))
    with contextlib.suppress(OSError):  # (an earlier incarnation's)
        path.with_name(f"rank{os.environ.get('RANK', '0')}{_SAW_FAILURE}").unlink()
    restarts = incarnation()
    if restarts and os.environ.get("RANK", "0") == "0":  # what it then starts from, the trainer says once known
        from freescale.group_sizes import FORMED_ENV

        formed = os.environ.get(FORMED_ENV) if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None
        say(f"freescale: {_group()} {formed} (incarnation {restarts})" if formed
            else f"freescale: {_group()} restarted (incarnation {restarts}) after a failure")
    return path


def took_over(incarnation: int) -> None:
    """This process holds its group's standby lock (``freescale.ft.standby``): it is the rank now; its pid in
    ``rank<r>.pid``, and a standby that took over a failed process says so."""
    pid_file = _state.get("pid_file")
    if pid_file is not None:
        pid_file.write_text(str(os.getpid()))
    if incarnation:
        say(f"freescale: {_group()}'s warm standby took over (incarnation {incarnation}) after a failure")


def rank_pid(output_dir: str | Path, replica_id: str | None, rank: int) -> int | None:
    """The pid of ``rank`` (of replica group ``replica_id``) of the run writing to ``output_dir``, while
    that process runs (not a dead incarnation's, not a zombie), else None."""
    from freescale.lifetime import alive

    try:
        pid = int((Path(output_dir) / (replica_id or "") / f"rank{rank}.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def peer_failure(exc: BaseException) -> bool:
    """The error is a collective's report that a peer died or hung (not a bug of this rank)."""
    import torch.distributed as dist

    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError)
                                                and any(word in text for word in _PEER_FAILURE))


def report_handled(exc: BaseException) -> bool:
    """A peer's failure under the elastic agent: its traceback to the rank's log, one line to the
    terminal; True when it was reported so (the caller exits non-zero: the agent restarts the group)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "stream" not in _state or not peer_failure(exc):
        return False
    stream: IO[str] = _state["stream"]
    stream.write("".join(traceback.format_exception(exc)))
    stream.flush()
    from freescale.lifetime import stopping

    if stopping():  # the job is being stopped and a peer ended first: the launcher says so, once
        return True
    me = os.environ.get("RANK", "0")
    marker = _state["path"].with_name(f"rank{me}{_SAW_FAILURE}")
    with contextlib.suppress(OSError):
        marker.write_text("")  # a peer checking after this rank has exited does not name it as the lost one
    what = _short(str(exc)) or type(exc).__name__
    from freescale.group_sizes import AFTER_FAILURE_ENV

    left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    then = os.environ.get(AFTER_FAILURE_ENV) if left <= 0 else None
    then = then or ("its group restarts" if left > 0 else "no restart left: the group stops")
    lost = _lost_peers(int(me))
    found = (f"{_group()}: {lost} (rank {me}'s collective failed: {what})" if lost
             else f"{_group()} rank {me}: a peer failed ({what})")
    print(f"freescale: {found}; {then} (traceback in {_state['path']})", file=sys.stderr, flush=True)
    return True


def _lost_peers(me: int) -> str:
    """Which other ranks of this group are gone or stopped (``rank 0 is gone``), read from their pid files and
    ``/proc``; empty where that cannot be told (ranks on other machines, no ``/proc``, nobody found).  A rank that
    ended on seeing the failure itself (its ``.saw_failure`` marker) is not named."""
    from freescale.lifetime import process_state

    world = os.environ.get("WORLD_SIZE", "1")
    if world != os.environ.get("LOCAL_WORLD_SIZE", world) or not Path("/proc/self/stat").exists():
        return ""
    directory: Path = _state["path"].parent
    found = []
    for rank in range(int(world)):
        if rank == me:
            continue
        try:
            pid = int((directory / f"rank{rank}.pid").read_text())
        except (OSError, ValueError):
            continue  # no pid file: nothing to tell
        state = process_state(pid)
        if state in ("Z", "X") and not (directory / f"rank{rank}{_SAW_FAILURE}").exists():
            found.append(f"rank {rank} is gone")
        elif state in ("T", "t"):
            found.append(f"rank {rank} is stopped")
    return ", ".join(found)


def _short(text: str, limit: int = 160) -> str:
    """A collective's error on one line: the source location gloo puts first dropped; a long one cut after its
    first sentence (gloo's advice follows it), else at a word."""
    words = " ".join(text.split())
    if words.startswith("[") and "] " in words:  # ``[../third_party/gloo/.../pair.cc:553] Connection closed ...``
        words = words.split("] ", 1)[1]
    if len(words) <= limit:
        return words
    first = words[:limit].find(". ")
    return words[:first + 1] if first > 0 else words[:limit].rsplit(" ", 1)[0] + " ..."


def say(line: str) -> None:
    """``line`` on stderr in one ``write`` (atomic on a pipe or terminal for a line this short): processes
    that share the terminal (replica groups, ranks) never glue their lines together, as two ``print``
    writes (the text, then the newline) can."""
    sys.stderr.flush()
    data = (line.rstrip("\n") + "\n").encode()
    try:
        os.write(sys.stderr.fileno(), data)
    except (OSError, ValueError, AttributeError):  # no real descriptor (captured in tests): the stream itself
        sys.stderr.write(data.decode())
        sys.stderr.flush()


def install_excepthook(output_dir: str | None = None, replica_id: str | None = None) -> None:
    """For a user's own loop (``freescale.ft.wrap``): an uncaught peer failure under the elastic agent ends
    the rank with one line, as in freescale's trainer (``report_handled``); anything else keeps Python's
    traceback.  The rank's log file goes to ``output_dir`` (default: a folder of the job under the
    system's temporary directory)."""
    import tempfile

    if "stream" not in _state:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        replica = replica_id or (f"replica{os.environ['FREESCALE_REPLICA_INDEX']}"
                                 if "FREESCALE_REPLICA_INDEX" in os.environ else None)
        install(output_dir or str(Path(tempfile.gettempdir()) / f"freescale-{run}"), replica)
    if _state.get("hooked"):
        return
    _state["hooked"] = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        from freescale.ft.client import LighthouseError, ProgressLost
        from freescale.launch import FutileRestart, report_user_error
        from freescale.step_types import NonFiniteError

        if isinstance(exc, FutileRestart):
            _leave(0)  # the error that ended the incarnation before is reported by the launcher
        if isinstance(exc, (ValueError, RuntimeError)) and str(exc).startswith(_REFUSALS):
            report_user_error(str(exc))  # a model or loop the layer refuses: no restart can fix it
            _leave(2)
        if isinstance(exc, (LighthouseError, NonFiniteError)):  # one line, as freescale's own trainer says it
            # A lighthouse out of reach may come back (a restart may help); a non-finite step or lost progress not.
            report_user_error(str(exc), restartable=isinstance(exc, LighthouseError) and not isinstance(exc, ProgressLost))
            _leave(2)
        if report_handled(exc):
            _leave(1)  # the agent restarts the group
        previous(kind, exc, tb)

    sys.excepthook = hook


_QUIET_LOGGERS = ("torchrec", "fbgemm_gpu", "torch.fx._symbolic_trace", "torch.distributed.checkpoint")
_QUIET_MODULES = ("torchrec", "fbgemm_gpu", "torch.distributed", "torch.fx", "torch.autograd", "torch.nn")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Within the block, torchrec/fbgemm chatter that says nothing to a user of freescale (its trainer,
    ``freescale.ft.shard``) is silenced: those loggers at ERROR, those modules' warnings ignored,
    torchrec's "Sharding spec not found" dropped at the root logger.  Everything is put back on the way
    out: a library leaves its host process's logging and warnings as it found them.  (The warnings filter
    is process-wide while the block runs: another thread's warning from those modules is dropped too.)"""
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    root = logging.getLogger()  # torchrec's planner warns on the root logger for every data_parallel table
    added = _no_sharding_spec not in root.filters
    with warnings.catch_warnings():
        for name in _QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        for module in _QUIET_MODULES:
            warnings.filterwarnings("ignore", module=module)
        if added:
            root.addFilter(_no_sharding_spec)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            if added:
                root.removeFilter(_no_sharding_spec)


def launched() -> bool:
    """This process is a rank ``freescale launch`` started (its agent's environment): the launcher owns it,
    and may set its process-wide hooks (``install_excepthook``)."""
    from freescale.launch import ERROR_DIR_ENV

    return bool(os.environ.get(ERROR_DIR_ENV))


def _no_sharding_spec(record: logging.LogRecord) -> bool:
    """False (drop) for torchrec's "Sharding spec not found for <table>": a data_parallel table has none."""
    return not (f"{os.sep}torchrec{os.sep}" in record.pathname and str(record.msg).startswith("Sharding spec not found"))


def _leave(code: int) -> None:
    """Exit without the interpreter's teardown: gloo's destructors can abort and print on the way out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

