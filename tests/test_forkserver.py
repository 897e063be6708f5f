"""Ranks forked from the warm server (``freescale.forkserver``): real server and client processes.

The server here imports only the CLI and numpy (its module list is a parameter); its ranks run light
``freescale`` commands: ``lighthouse`` (runs until signalled) and ``gen-data`` with a bad flag (exits
2 with one line).  ``freescale launch`` runs every other multi-rank test through the real server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from freescale.forkserver import FORKSERVER_ENV, SERVER_PID_ENV, ForkServer
from tests.conftest import REPO, cli_env
from tests.procs import wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    with ForkServer(modules=("freescale.cli", "numpy.random")) as started:
        assert wait_for(lambda: Path(started.path).exists(), timeout=30), "the server never listened"
        yield started


def client(server: ForkServer, *argv: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "freescale.forkserver", *argv], cwd=REPO,
                            env={**cli_env(), **server.env}, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)  # type: ignore[call-overload]


def forked(server: ForkServer) -> list[int]:
    """The server's live children (its ranks)."""
    task = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children")
    return [int(p) for p in task.read_text().split()]


def test_exit_status_and_output_pass_through(server: ForkServer) -> None:
    proc = client(server, "gen-data", "--rows", "many")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "--rows" in err and "Traceback" not in err, err


def test_signals_pass_on_and_a_killed_client_takes_its_rank_with_it(server: ForkServer) -> None:
    """``SIGTERM`` to the client reaches the rank (the lighthouse stops on it and exits 0, and so does
    the client: what torch's agent sees); a ``SIGKILL``ed client (the agent gave up on it) leaves no
    orphan training on."""
    before = set(forked(server))
    terminated = client(server, "lighthouse", "--bind", "127.0.0.1:0")
    import select

    assert select.select([terminated.stdout], [], [], 30)[0], "the lighthouse never said it serves"
    assert "serving" in terminated.stdout.readline()  # type: ignore[union-attr]  # its handlers are installed
    (rank,) = set(forked(server)) - before
    terminated.send_signal(signal.SIGTERM)
    assert terminated.wait(timeout=20) == 0
    assert wait_for(lambda: rank not in forked(server), timeout=10)

    killed = client(server, "lighthouse", "--bind", "127.0.0.1:0")
    assert wait_for(lambda: set(forked(server)) - before, timeout=20)
    (rank,) = set(forked(server)) - before
    killed.kill()
    killed.wait(timeout=10)
    assert wait_for(lambda: rank not in forked(server), timeout=10), "the rank outlived its client"


def test_a_rank_killed_by_a_signal_ends_its_client_by_that_signal(server: ForkServer) -> None:
    before = set(forked(server))
    proc = client(server, "lighthouse", "--bind", "127.0.0.1:0")
    assert wait_for(lambda: set(forked(server)) - before, timeout=20)
    (rank,) = set(forked(server)) - before
    os.kill(rank, signal.SIGKILL)
    assert proc.wait(timeout=20) == -signal.SIGKILL


def test_a_bad_request_is_refused_and_the_server_stays_up(server: ForkServer) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server.path)
        sock.sendall(b"\x00\x00\x00\x05hello")  # no descriptors, not JSON
        assert sock.recv(1) == b""  # closed without an answer
    test_exit_status_and_output_pass_through(server)


def test_without_a_server_the_rank_starts_plain_and_says_why(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])  # a zombie until reaped: gone all the same
    assert wait_for(lambda: Path(f"/proc/{dead.pid}/stat").read_text().split(") ")[1][0] == "Z", timeout=10)
    env = {**cli_env(), FORKSERVER_ENV: str(tmp_path / "none.sock"), SERVER_PID_ENV: str(dead.pid)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "freescale.forkserver", "gen-data", "--rows", "many"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--rows" in proc.stderr
    assert f"rank starts without the fork server: the server (pid {dead.pid}) is gone" in proc.stderr
    assert time.monotonic() - start < 30
    dead.wait()


def test_a_users_script_and_module_run_as_main_with_their_arguments(server: ForkServer, tmp_path: Path) -> None:
    """``launch -- python my_loop.py ARGS`` (or ``python -m pkg.loop ARGS``): the rank runs the script as
    ``__main__``, with its argv and its folder first on ``sys.path``, as the interpreter would; its exit
    code comes back."""
    from freescale.forkserver import client_command

    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    script = tmp_path / "loop.py"
    script.write_text("import sys, helper_mod\nprint(__name__, sys.argv[1:], helper_mod.VALUE)\nsys.exit(3)\n")
    args = client_command([sys.executable, str(script), "--lr", "0.1"])
    assert args == ["--script", str(script), "--lr", "0.1"]
    proc = client(server, *args)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and out.strip() == "__main__ ['--lr', '0.1'] 7", (out, err)
    assert client_command([sys.executable, "-u", str(script)]) is None  # interpreter flags: started plain
    assert client_command(["/bin/sh", str(script)]) is None  # not this interpreter
    module = client(server, *client_command([sys.executable, "-m", "json.tool", "--help"]) or [])
    out, _ = module.communicate(timeout=30)
    assert module.returncode == 0 and "json.tool" in out


def test_sys_exit_codes_are_the_interpreters(server: ForkServer, tmp_path: Path) -> None:
    """``sys.exit()`` is 0, ``sys.exit("why")`` prints why and is 1; what a rank prints under
    ``PYTHONUNBUFFERED`` is out before it is SIGKILLed."""
    cases = {"import sys; sys.exit()": (0, ""), "import sys; sys.exit('no data')": (1, "no data"),
             "import numpy, sys; print(numpy.random.randint(1 << 30), file=sys.stderr)": (0, ""),
             "import os, signal; print('said', flush=False); os.kill(os.getpid(), signal.SIGKILL)":
                 (-signal.SIGKILL, "")}
    for i, (code, (rc, err_text)) in enumerate(cases.items()):
        script = tmp_path / f"case{i}.py"
        script.write_text(code + "\n")
        proc = client(server, "--script", str(script))
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == rc and err_text in err, (code, proc.returncode, err)
        if rc == -signal.SIGKILL:
            assert out.strip() == "said"
        if "numpy" in code:  # numpy's global generator: seeded afresh in every rank, not the server's state
            again = client(server, "--script", str(script))
            assert again.communicate(timeout=30)[1] != err


def test_an_uncaught_error_goes_through_sys_excepthook(server: ForkServer, tmp_path: Path) -> None:
    """As in an interpreter: ``freescale.ft.wrap`` installs a hook that reports a peer's failure in one
    line; a forked rank must call it, not print the traceback itself."""
    script = tmp_path / "hooked.py"
    script.write_text("import sys\nsys.excepthook = lambda kind, value, tb: print('hooked:', value, file=sys.stderr)\n"
                      "raise RuntimeError('a peer failed')\n")
    proc = client(server, "--script", str(script))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and err.strip() == "hooked: a peer failed", err
