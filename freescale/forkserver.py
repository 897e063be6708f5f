"""Rank processes forked from a warm server: torch, torchrec and the trainer imported once per node.

A rank of ``freescale train`` spends most of its start-up importing: torch ~2 s and torchrec with
fbgemm ~3 s more of one core on the 2-core CI machine.  Ranks that start together on a few cores
wait for the sum, and a replica group restarting after a failure pays it while the survivors train
beside it.  So ``freescale launch`` starts one ``serve`` process per node that has imported all of it
(``WARM_MODULES``), and torch's elastic agent runs each rank as ``python -m freescale.forkserver
train ARGS``: a client that imports nothing heavy, connects to the server's Unix socket and hands it
the rank's arguments, environment, working directory and standard streams (the descriptors
themselves, ``SCM_RIGHTS``).  The server forks a rank that runs ``freescale train`` with them; the
client forwards the signals the agent sends (``SIGTERM`` on a group's shutdown) and exits as the rank
exited, with its code or killed by its signal, so the agent monitors, restarts and stops ranks as
before.  A rank whose client dies (``SIGKILL`` from the agent after its grace period) kills itself:
it watches the client's end of the connection.

Overlaps: the server imports while the groups' agents start; a client waits for the socket (bound
only once the imports are done).  The server forks from a single-threaded ``selectors`` loop (no
Python thread of it holds a lock at the fork; the one native thread an import starts, jemalloc's
background thread, has its own fork handlers) and reaps its ranks there (``SIGCHLD`` wakes the loop), so it
can tell each client how its rank ended.  The pid the agent sees is the client's: the rank's own pid
is in its group's folder (``rank_console``'s ``rank<R>.pid``) and in the log's ``start`` event.

A user's own loop (``launch -- python my_loop.py ARGS`` or ``-- python -m pkg.loop ARGS``, with this
very interpreter) is forked the same way from a server that imported ``LOOP_MODULES``: the rank runs
the script as ``__main__`` (``runpy``) with its argv and its folder first on ``sys.path``, as
``python my_loop.py`` would.  Any other command (another interpreter, interpreter flags, not Python)
starts as given.

Plain start instead (the client ``exec``s the interpreter command, keeping its pid; one line says
why): ``FREESCALE_FORKSERVER=off``, the server gone, or CUDA initialized in the server while
importing (a forked child could not use it).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from freescale.lifetime import alive

FORKSERVER_ENV = "FREESCALE_FORKSERVER"
"""The server's socket path (``launch`` sets it for the ranks), or ``off``: every rank starts plain."""
SERVER_PID_ENV = "FREESCALE_FORKSERVER_PID"
WARM_MODULES = ("torch", "torch.distributed", "torchrec", "torchrec.distributed.model_parallel",
                "torchrec.distributed.planner", "fbgemm_gpu", "freescale.trainer", "freescale.parallelize",
                "freescale.pipeline", "freescale.models.dlrm", "freescale.models.hstu", "freescale.checkpoint",
                "freescale.ft.layer", "freescale.ft.sparse_sync", "freescale.ft.catchup")
"""What ``freescale train`` imports on every start (the rest it imports when first used, as before)."""
LOOP_MODULES = ("torch", "torch.distributed", "torchrec", "torchrec.distributed.model_parallel", "fbgemm_gpu",
                "freescale.ft", "freescale.ft.layer", "freescale.ft.sparse_sync", "freescale.ft.catchup",
                "freescale.ft.wrapper")
"""What a user's own loop under ``launch -- python my_loop.py`` likely imports (torch, torchrec, the layer)."""
CONNECT_WAIT_S = 600.0
"""How long a client waits for a live server's socket (the server is still importing)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
"""Signals the client passes on to its rank (``SIGUSR1``: dump the rank's stacks into its log)."""


# ---------------------------------------------------------------------------- the launcher's side
class ForkServer:
    """One server process for this node's ranks, for the duration of a ``with`` block, which puts its
    address into this process's environment (the agents and their ranks inherit it).  The server ends
    with the block (at once if the block raised: it may still be importing) or when this process dies
    (it watches its stdin, a pipe from here)."""

    def __init__(self, modules: tuple[str, ...] = WARM_MODULES) -> None:
        import subprocess
        import tempfile

        # A short path: a Unix socket's is at most 107 bytes, and TMPDIR may be long.
        self.directory = tempfile.mkdtemp(prefix="fs-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.path = str(Path(self.directory) / "s")
        # Its own session: a terminal's ^C or hang-up reaches the launcher and the agents, which stop the
        # ranks through their clients, not the server or its ranks directly.
        self.proc = subprocess.Popen([sys.executable, "-m", "freescale.forkserver", "--serve", self.path,
                                      ",".join(modules)], stdin=subprocess.PIPE, start_new_session=True,
                                     env={**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1"})

    @property
    def env(self) -> dict[str, str]:
        return {FORKSERVER_ENV: self.path, SERVER_PID_ENV: str(self.proc.pid)}

    def __enter__(self) -> ForkServer:
        os.environ.update(self.env)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        for name in self.env:
            os.environ.pop(name, None)
        self.close(at_once=kind is not None)

    def close(self, at_once: bool = False) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the server's loop sees the end of its stdin and exits
        try:
            self.proc.wait(timeout=0 if at_once else 5)
        except Exception:  # a server stuck in an import: it must not outlive the launcher
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def started(modules: tuple[str, ...] = WARM_MODULES) -> contextlib.AbstractContextManager[ForkServer | None]:
    """A ``ForkServer`` for ``freescale launch`` (started first: it imports while the launcher checks the
    config and the agents start), or none under ``FREESCALE_FORKSERVER=off``."""
    return contextlib.nullcontext() if _off() else ForkServer(modules)


def running() -> bool:
    """A server was started for this process's ranks (its address is in the environment)."""
    return bool(os.environ.get(FORKSERVER_ENV)) and not _off()


def _off() -> bool:
    return os.environ.get(FORKSERVER_ENV, "").strip().lower() in ("off", "0", "false", "no")


# ---------------------------------------------------------------------------- the server
def serve(path: str, modules: tuple[str, ...] = WARM_MODULES) -> int:
    """Import ``modules``, then fork a rank per client until stdin closes."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    why = _cuda_unforkable()
    if why:
        print(f"freescale: fork server: {why}; ranks start plain", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.replace(path + ".tmp", path)  # clients connect only once everything is imported
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # it ends when its stdin does (the launcher is done or dead)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of each exit
    ranks: dict[int, socket.socket] = {}
    loop = selectors.DefaultSelector()
    loop.register(listener, selectors.EVENT_READ, "accept")
    loop.register(wake_r, selectors.EVENT_READ, "wake")
    loop.register(sys.stdin.fileno(), selectors.EVENT_READ, "launcher")
    try:
        while True:
            for key, _ in loop.select(timeout=1.0):
                if key.data == "launcher" and not os.read(sys.stdin.fileno(), 4096):
                    return 0  # the launcher is done (or dead)
                if key.data == "wake":
                    os.read(wake_r, 4096)
                if key.data == "accept":
                    _fork_rank(listener, ranks, (loop, wake_r, wake_w))
            _reap(ranks)
    finally:
        listener.close()
        Path(path).unlink(missing_ok=True)


def _cuda_unforkable() -> str:
    """Why a forked rank could not use CUDA, or "" when it can (or there is no GPU): torch initialized CUDA
    while importing, or a probe child forked now fails to create a CUDA tensor (a library that initialized
    the driver behind torch's back).  ``PYTORCH_NVML_BASED_CUDA_CHECK`` (set by ``ForkServer``) keeps
    ``is_available`` itself from initializing it.  Not yet run on a GPU machine."""
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialized while importing"
    if not torch.cuda.is_available():
        return ""
    probe = os.fork()
    if probe == 0:
        try:
            torch.zeros(1, device="cuda").add_(1)
            os._exit(0)
        except BaseException:  # any failure means the same: forked ranks cannot use CUDA
            os._exit(1)
    _, status = os.waitpid(probe, 0)
    return "" if os.waitstatus_to_exitcode(status) == 0 else "a forked process cannot use CUDA here"


def _fork_rank(listener: socket.socket, ranks: dict[int, socket.socket], closing: tuple[Any, int, int]) -> None:
    try:
        conn, _ = listener.accept()
    except OSError:
        return  # the client gave up between connect and accept
    try:
        conn.settimeout(10)
        request, fds = _receive_request(conn)
        conn.settimeout(None)
    except (OSError, ValueError) as exc:  # a client that died or sent garbage: it gets nothing, the server stays
        print(f"freescale: fork server: a bad request ({exc}); refused", file=sys.stderr)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the rank
        loop, wake_r, wake_w = closing
        loop.close()
        listener.close()
        for fd in (wake_r, wake_w):
            os.close(fd)
        for other in ranks.values():
            other.close()
        _run_rank(request, fds, conn)  # never returns
    for fd in fds:
        os.close(fd)
    ranks[pid] = conn
    try:
        _send(conn, {"pid": pid})
    except OSError:
        pass  # the client died already: the rank sees its end closed and kills itself; reaped as any other


def _reap(ranks: dict[int, socket.socket]) -> None:
    """Tell each finished rank's client how it ended (the raw wait status)."""
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is not None:
            try:
                _send(conn, {"status": status})
            except OSError:
                pass  # its client is gone: nobody to tell
            conn.close()


def _run_rank(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the forked child: become the rank the client asked for, run ``freescale train``, exit."""
    code = 1
    try:
        os.setsid()  # its own process group, as torch's agent starts a rank: signalled with its children
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_streams()
        _fresh_process_state()
        _watch_client(conn)
        code = _run_target(request["argv"])
    except SystemExit as exc:  # as the interpreter: None is 0, an int is the code, anything else is printed
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT  # as the interpreter: it ends by SIGINT itself
    except BaseException:  # as the interpreter: sys.excepthook reports it (freescale.ft.wrap's gives one line
        sys.excepthook(*sys.exc_info())  # for a peer's failure under the agent; Python's prints the traceback)
    finally:
        _exit_as_interpreter(code)


def _exit_as_interpreter(code: int) -> None:
    """What the interpreter does at exit: join non-daemon threads (a checkpoint writer, an executor's
    pending work), run the ``atexit`` functions, flush the streams; then end (``-SIG``: by that signal)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own exit step
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _run_target(argv: list[str]) -> int:
    """What the rank runs, as its interpreter would have: ``freescale ARGV``, or a user's script
    (``--script PATH ARGS``: ``python PATH ARGS``) or module (``--module NAME ARGS``: ``python -m NAME ARGS``)
    as ``__main__``."""
    import runpy

    if argv[:1] == ["--script"]:
        sys.argv = argv[1:]
        sys.path[0] = str(Path(argv[1]).resolve().parent)  # what `python PATH` puts first
        runpy.run_path(argv[1], run_name="__main__")
        return 0
    if argv[:1] == ["--module"]:
        sys.argv = [argv[1], *argv[2:]]  # runpy replaces argv[0] with the module's file
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    from freescale.cli import main

    sys.argv = ["freescale", *argv]
    return int(main(argv) or 0)


def plain_command(argv: list[str]) -> list[str]:
    """The interpreter command that runs what ``argv`` asks the server for (a start without it)."""
    if argv[:1] == ["--script"]:
        return [sys.executable, *argv[1:]]
    if argv[:1] == ["--module"]:
        return [sys.executable, "-m", *argv[1:]]
    return [sys.executable, "-m", "freescale.cli", *argv]


def client_command(command: list[str]) -> list[str] | None:
    """``freescale.forkserver``'s arguments for a user's rank command, or None when the server cannot run
    it: only ``python SCRIPT ...`` and ``python -m MODULE ...`` with this very interpreter (the server's)."""
    import shutil

    found = shutil.which(command[0]) if command else None
    # The same interpreter: a python in the launcher's own bin folder (resolving links would equate every
    # virtual environment with its base interpreter, each with other packages).
    same = found is not None and os.path.dirname(os.path.abspath(found)) == os.path.dirname(
        os.path.abspath(sys.executable)) and os.path.basename(found).startswith("python")
    if not same or len(command) < 2:
        return None
    if command[1] == "-m" and len(command) > 2:
        return ["--module", *command[2:]]
    return ["--script", *command[1:]] if not command[1].startswith("-") else None


def _fresh_streams() -> None:
    """``sys.stdout`` and ``sys.stderr`` as this rank's interpreter would have opened them on its descriptors:
    unbuffered under ``PYTHONUNBUFFERED`` (what a rank prints must survive its SIGKILL), else buffered by
    line on a terminal or for stderr, by block otherwise (the server's streams were opened for its own)."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw), encoding=old.encoding, errors=old.errors,
            line_buffering=not unbuffered and (name == "stderr" or os.isatty(fd)), write_through=unbuffered))


def _fresh_process_state() -> None:
    """What a new interpreter would have had differently from the server: torch's intra-op threads from
    this rank's ``OMP_NUM_THREADS`` (OpenMP read the server's at import), and numpy's global generator
    seeded afresh (numpy seeds it from the OS once, at import: every rank forked from one server would
    draw the same numbers; Python's ``random`` re-seeds itself after a fork; torch's default seed is a
    constant in every interpreter anyway)."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _watch_client(conn: socket.socket) -> None:
    """A thread that kills this rank when its client's end of the connection closes (the client was
    killed: the agent has given up on this rank, which must not train on as an orphan)."""
    import threading

    def watch() -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.killpg(os.getpgid(0), signal.SIGKILL)  # the rank and anything it started

    threading.Thread(target=watch, name="freescale-forkserver-client", daemon=True).start()


# ---------------------------------------------------------------------------- the client (each rank as the agent sees it)
def run_client(argv: list[str]) -> int:
    """Ask the server for a rank running ``freescale ARGV`` (or a user's script or module: ``_run_target``);
    return (or die) as it ended.  Falls back to a plain start (``exec``, same pid) when there is no server
    to ask."""
    from freescale.lifetime import die_with_parent

    die_with_parent()  # the agent's death ends this client, and with it the rank (``_watch_client``)
    path, why = os.environ.get(FORKSERVER_ENV, ""), ""
    conn = None
    if running():
        conn, why = _connect(path, int(os.environ.get(SERVER_PID_ENV, "0") or 0))
    if conn is None:
        if why:
            print(f"freescale: rank starts without the fork server: {why}", file=sys.stderr, flush=True)
        os.execv(sys.executable, plain_command(argv))
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
    conn.sendall(request)
    reader = conn.makefile("rb")
    first = reader.readline()
    if not first:  # refused (or the server died): nothing started yet
        print("freescale: rank starts without the fork server: it refused the request", file=sys.stderr, flush=True)
        os.execv(sys.executable, plain_command(argv))
    pid = json.loads(first)["pid"]

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # it may have ended already
            os.killpg(pid, signum)  # the rank's group (it is its session's leader): its children too

    for sig in FORWARDED:
        signal.signal(sig, forward)
    line = reader.readline()
    if not line:  # the server died first: wait for the rank itself, its status is lost with the server
        while alive(pid):
            time.sleep(0.1)
        print(f"freescale: the fork server ended before rank pid {pid}; its exit status is unknown",
              file=sys.stderr)
        return 1
    status = json.loads(line)["status"]
    if os.WIFSIGNALED(status):
        ended = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(ended, signal.SIG_DFL)  # forwarded or ignored until now: it ends this process too
        os.kill(os.getpid(), ended)  # the agent sees the rank's own signal (a SIGKILL stays a SIGKILL)
    return os.waitstatus_to_exitcode(status)


def _connect(path: str, server_pid: int) -> tuple[socket.socket | None, str]:
    deadline = time.monotonic() + CONNECT_WAIT_S
    while time.monotonic() < deadline:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            return conn, ""
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if server_pid and not alive(server_pid):
                return None, f"the server (pid {server_pid}) is gone"
            time.sleep(0.02)
    return None, f"no server at {path} after {CONNECT_WAIT_S:.0f} s"


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    try:
        request = _request_body(conn, head)  # read whole first: closing on unread bytes resets the client
        if len(fds) != 3:
            raise ValueError("a request comes with the three standard streams")
        return request, list(fds)
    except BaseException:
        for fd in fds:  # a bad request keeps none of the client's descriptors open here
            os.close(fd)
        raise


def _request_body(conn: socket.socket, head: bytes) -> dict[str, Any]:
    while len(head) < 4:
        more = conn.recv(4 - len(head))
        if not more:
            raise ValueError("the client closed before its request")
        head += more
    size, body = struct.unpack("!I", head)[0], b""
    while len(body) < size:
        chunk = conn.recv(min(1 << 20, size - len(body)))
        if not chunk:
            raise ValueError("the client closed mid-request")
        body += chunk
    request = json.loads(body)  # a ValueError if it is not JSON
    if not isinstance(request, dict) or {"argv", "env", "cwd"} - set(request):
        raise ValueError("a request needs argv, env and cwd")
    return request


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:  # --serve PATH [MODULE,MODULE,...]
        return serve(argv[1], tuple(m for m in argv[2].split(",") if m) if len(argv) > 2 else WARM_MODULES)
    return run_client(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
