"""``freescale report``: pages from logs, one-line errors.  In-process, seconds (the real 2-group
SIGKILL run's report is checked in ``tests/test_ft_torchrec.py``; ``freescale simulate`` in
``tests/test_simulate.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from freescale import cli
from freescale.report import write_report


def _write(path: Path, events: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def _commit(step: int, t: float, participants: list[str], contributing: bool = True, attempts: int = 1) -> dict:
    return {"event": "commit", "time": t, "step": step, "samples": 64, "seconds": 0.1, "batch_wait_s": 0.001,
            "busy_s": 0.05, "quorum_id": len(participants), "participants": participants, "attempts": attempts,
            "contributing": contributing, "weight": 64.0 if contributing else 0.0}


def fake_run(root: Path) -> Path:
    """Two groups; group 1 killed at t=100.65 (in step 6), restarted, caught up at step 10."""
    both, alone = ["replica0", "replica1"], ["replica0"]
    g0 = [{"event": "start", "time": 100.0, "world_size": 2, "incarnation": 0, "config": {"model": {"kind": "hstu"}}}]
    g0 += [_commit(s, 100.1 + 0.1 * s, both) for s in range(6)]
    g0 += [_commit(6, 103.0, alone, attempts=2)] + [_commit(s, 103.0 + 0.1 * (s - 6), alone) for s in range(7, 10)]
    g0 += [_commit(s, 103.4 + 0.1 * (s - 10), both) for s in range(10, 20)]
    g0 += [{"event": "step", "time": 105.0, "step": 19, "loss": 0.6, "auc": 0.7, "imbalance": 1.01, "bubble": 0.2}]
    g1 = g0[:7] + [{"event": "start", "time": 102.0, "world_size": 2, "incarnation": 1, "pid": 7},
                   {"event": "catch_up", "time": 103.35, "step": 10, "catch_up": {
                       "joined_step": 9, "snapshot_step": 9, "started": 103.1, "group_ready": 103.15,
                       "finished": 103.3, "bytes": 1000, "bytes_per_s": 1e9, "replayed": 1, "source": "h:1"}},
                   _commit(10, 103.4, both, contributing=False)]
    g1 += [_commit(s, 103.4 + 0.1 * (s - 10), both) for s in range(11, 20)]
    _write(root / "replica0" / "train_log.jsonl", g0)
    _write(root / "replica1" / "train_log.jsonl", g1)
    (root / "replica1" / "rank1.killed").write_text("100.65")
    return root


def test_report_names_the_kill_the_restart_the_catch_up_and_the_redo(tmp_path: Path) -> None:
    page = write_report(fake_run(tmp_path)).read_text()
    assert "SIGKILL" in page and "rank 1 killed (FREESCALE_FAULTS) during step 6" in page
    assert "incarnation 1 started" in page and "joined at step 9" in page
    assert "step 6 committed after 2 attempts" in page and page.count("data:image/png;base64,") == 3


def test_report_of_a_run_without_replica_groups(tmp_path: Path) -> None:
    _write(tmp_path / "train_log.jsonl", [_commit(s, 1.0 + s, ["replica0"]) for s in range(5)])
    page = write_report(tmp_path, tmp_path / "out.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "no kill, restart, catch-up or redo" in page


@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: None, "no such run directory"),
    (lambda p: p.mkdir(), "no train_log.jsonl"),
    (lambda p: _write(p / "replica0" / "train_log.jsonl", [{"event": "start", "time": 1.0}]), "no committed step"),
    (lambda p: (p / "replica0").mkdir(parents=True) or (p / "replica0" / "train_log.jsonl").write_text(
        '{"event": "start", "time": 1}\n{"event": "commit", "ti\n'), "train_log.jsonl:2: not a JSON line"),
    (lambda p: _write(p / "train_log.jsonl", [{"time": 1.0}]), "train_log.jsonl:1: not a log event"),
])
def test_report_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: Any,
                                      message: str) -> None:
    run = tmp_path / "run"
    setup(run)
    assert cli.main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_report_without_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["report", str(fake_run(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[report]'" in err and len(err.strip().splitlines()) == 1
