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
thread of it holds a lock at the fork) and reaps its ranks there (``SIGCHLD`` wakes the loop), so it
can tell each client how its rank ended.  The pid the agent sees is the client's: the rank's own pid
is in its group's folder (``rank_console``'s ``rank<R>.pid``) and in the log's ``start`` event.

Plain start instead (the client ``exec``s ``python -m freescale.cli``, keeping its pid; one line
says why): ``FREESCALE_FORKSERVER`` unset or ``off``, the server gone, or CUDA initialized in the
server while importing (a forked child could not use it).  Not for a user's own command
(``launch -- python my_loop.py``): that one is the user's process and starts as such.
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

FORKSERVER_ENV = "FREESCALE_FORKSERVER"
"""The server's socket path (``launch`` sets it for the ranks), or ``off``: every rank starts plain."""
SERVER_PID_ENV = "FREESCALE_FORKSERVER_PID"
WARM_MODULES = ("torch", "torch.distributed", "torchrec", "torchrec.distributed.model_parallel",
                "torchrec.distributed.planner", "fbgemm_gpu", "freescale.trainer", "freescale.parallelize",
                "freescale.pipeline", "freescale.models.dlrm", "freescale.models.hstu", "freescale.checkpoint",
                "freescale.ft.layer", "freescale.ft.sparse_sync", "freescale.ft.catchup")
"""What ``freescale train`` imports on every start (the rest it imports when first used, as before)."""
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

        self.directory = tempfile.mkdtemp(prefix="freescale-fork-")
        self.path = str(Path(self.directory) / "forkserver.sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "freescale.forkserver", "--serve", self.path,
                                      ",".join(modules)],
                                     stdin=subprocess.PIPE, env={**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})

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


def started() -> contextlib.AbstractContextManager[ForkServer | None]:
    """A ``ForkServer`` for ``freescale launch`` (started first: it imports while the launcher checks the
    config and the agents start), or none under ``FREESCALE_FORKSERVER=off``."""
    return contextlib.nullcontext() if os.environ.get(FORKSERVER_ENV) == "off" else ForkServer()


def running() -> bool:
    """A server was started for this process's ranks (its address is in the environment)."""
    return os.environ.get(FORKSERVER_ENV, "off") != "off"


# ---------------------------------------------------------------------------- the server
def serve(path: str, modules: tuple[str, ...] = WARM_MODULES) -> int:
    """Import ``modules``, then fork a rank per client until stdin closes."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():
        print("freescale: fork server: CUDA was initialized while importing; ranks start plain", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.replace(path + ".tmp", path)  # clients connect only once everything is imported
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


def _fork_rank(listener: socket.socket, ranks: dict[int, socket.socket], closing: tuple[Any, int, int]) -> None:
    conn, _ = listener.accept()
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
    _send(conn, {"pid": pid})


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
        sys.argv = ["freescale", *request["argv"]]
        _fresh_process_state()
        _watch_client(conn)
        from freescale.cli import main

        code = int(main(request["argv"]) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # what the interpreter would print for an uncaught error
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fresh_process_state() -> None:
    """What a new interpreter would have had differently from the server: torch's intra-op threads from
    this rank's ``OMP_NUM_THREADS`` (OpenMP read the server's at import), fresh random seeds."""
    import random

    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    random.seed()


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
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="freescale-forkserver-client", daemon=True).start()


# ---------------------------------------------------------------------------- the client (each rank as the agent sees it)
def run_client(argv: list[str]) -> int:
    """Ask the server for a rank running ``freescale ARGV``; return (or die) as it ended.  Falls back to
    a plain start (``exec``, same pid) when there is no server to ask."""
    path, why = os.environ.get(FORKSERVER_ENV, ""), ""
    conn = None
    if path and path != "off":
        conn, why = _connect(path, int(os.environ.get(SERVER_PID_ENV, "0") or 0))
    if conn is None:
        if why:
            print(f"freescale: rank starts without the fork server: {why}", file=sys.stderr, flush=True)
        os.execv(sys.executable, [sys.executable, "-m", "freescale.cli", *argv])
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
    conn.sendall(request)
    reader = conn.makefile("rb")
    first = reader.readline()
    if not first:  # refused (or the server died): nothing started yet
        print("freescale: rank starts without the fork server: it refused the request", file=sys.stderr, flush=True)
        os.execv(sys.executable, [sys.executable, "-m", "freescale.cli", *argv])
    pid = json.loads(first)["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    line = reader.readline()
    if not line:  # the server died first: wait for the rank itself, its status is lost with the server
        while Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        print(f"freescale: the fork server ended before rank pid {pid}; its exit status is unknown",
              file=sys.stderr)
        return 1
    status = json.loads(line)["status"]
    if os.WIFSIGNALED(status):
        ended = os.WTERMSIG(status)
        if ended in FORWARDED:
            signal.signal(ended, signal.SIG_DFL)  # ours passed it on; now it ends this process too
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
            if server_pid and not Path(f"/proc/{server_pid}").exists():
                return None, f"the server (pid {server_pid}) is gone"
            time.sleep(0.02)
    return None, f"no server at {path} after {CONNECT_WAIT_S:.0f} s"


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
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
    request = json.loads(body)
    if len(fds) != 3 or not isinstance(request, dict) or {"argv", "env", "cwd"} - set(request):
        for fd in fds:
            os.close(fd)
        raise ValueError("a request needs argv, env, cwd and the three standard streams")
    return request, list(fds)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:  # --serve PATH [MODULE,MODULE,...]
        return serve(argv[1], tuple(m for m in argv[2].split(",") if m) if len(argv) > 2 else WARM_MODULES)
    return run_client(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
