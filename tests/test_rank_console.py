"""What a rank prints when a peer fails (one line; the traceback to its log file), and SIGUSR1 stack dumps."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env


def test_a_peer_failure_is_one_line_with_the_traceback_in_the_rank_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from freescale import rank_console

    for name, value in {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "3",
                        "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "1", "FREESCALE_REPLICA_INDEX": "2"}.items():
        monkeypatch.setenv(name, value)
    log = rank_console.install(str(tmp_path), "replica2")
    try:
        raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer. GLHF!")
    except RuntimeError as exc:
        assert rank_console.report_handled(exc)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "replica group 2 rank 1: a peer failed" in err and "its group restarts" in err
    assert str(log) in err and log == tmp_path / "replica2" / "rank1.log"
    assert "Traceback" in log.read_text() and "Connection reset by peer" in log.read_text()
    assert not rank_console.report_handled(KeyError("a bug"))  # not a peer's failure: its traceback stays


def test_the_line_names_the_rank_that_is_gone_or_stopped_not_the_one_that_saw_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every rank of the group on this machine: the peers' pid files and ``/proc`` say which one died (a rank that
    ended on seeing the failure itself is not named), gloo's source location is dropped, a long error cut at a word."""
    from freescale import rank_console

    for name, value in {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0",
                        "RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "FREESCALE_REPLICA_INDEX": "2"}.items():
        monkeypatch.setenv(name, value)
    log = rank_console.install(str(tmp_path), "replica2")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # exited and reaped: gone
    stopped = subprocess.Popen(["sleep", "30"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        (log.parent / "rank0.pid").write_text(str(ended.pid))
        (log.parent / "rank2.pid").write_text(str(stopped.pid))
        error = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33204. " * 4
        assert rank_console.report_handled(RuntimeError(error))
        err = capsys.readouterr().err
        assert err.startswith("freescale: replica group 2: rank 0 is gone, rank 2 is stopped (rank 1's collective "
                              "failed: Connection closed by peer [127.0.0.1]:33204.); its group restarts"), err
        assert err.count("\n") == 1 and "pair.cc" not in err, err
        # rank 0 ended on seeing the failure itself (its marker): not named; nobody else is gone
        (log.parent / "rank0.saw_failure").write_text("")
        stopped.send_signal(signal.SIGCONT)
        time.sleep(0.2)
        assert rank_console.report_handled(RuntimeError("Connection reset by peer"))
        assert "replica group 2 rank 1: a peer failed (Connection reset by peer)" in capsys.readouterr().err
    finally:
        stopped.kill()
        stopped.wait()


def test_sigusr1_dumps_every_threads_stack_into_the_rank_log(tmp_path: Path) -> None:
    code = ("import sys, time; from freescale import rank_console; "
            f"rank_console.install({str(tmp_path)!r}, None); print('ready', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        log = tmp_path / "rank0.log"
        deadline = time.monotonic() + 10
        while "Current thread" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 'File "<string>", line 1' in log.read_text() and proc.poll() is None  # dumped, still running
    finally:
        proc.kill()
        proc.wait()
