"""``freescale report``: pages from logs, one-line errors.  In-process, seconds (the real 2-group
SIGKILL run's report is checked in ``tests/test_ft_torchrec.py``; ``freescale simulate`` in
``tests/test_simulate.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from freescale import cli
from freescale.report import logs, write_report
from freescale.report.logs import Kill, read_run


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
    assert "download 0.15 s" in page and "load + replay, first contributing step 0.20 s" in page
    assert "step 6 committed after 2 attempts" in page and page.count("data:image/png;base64,") == 3
    assert "per log window (every train.log_every steps), not per step" in page
    root = fake_run(tmp_path / "again")  # one group's log named: the whole run's page, not one group's
    assert write_report(root / "replica1" / "train_log.jsonl") == root / "report.html"


def test_report_of_a_run_without_fault_tolerance(tmp_path: Path) -> None:
    """A plain run's commits carry no quorum fields: the per-step figures, no timeline."""
    commits = [{"event": "commit", "time": 1.0 + s, "step": s, "samples": 64, "seconds": 0.1, "batch_wait_s": 0.001,
                "busy_s": 0.05} for s in range(5)]
    checks = [{"event": "validate", "time": 1.5 + s, "step": s, "auc": 0.7 + 0.01 * s} for s in (2, 4)]
    checks += [{"event": "validation_decision", "time": 5.5, "step": 4, "best_step": 4}]
    summary = {"event": "summary", "time": 6.0, "eval_metrics": {"auc": 0.74},
               "validation": {"best_step": 4, "evaluated_best": True}}
    _write(tmp_path / "train_log.jsonl", [{"event": "start", "time": 0.5, "world_size": 2, "incarnation": 0,
                                            "config": {"model": {"kind": "dlrm"}}}, *commits, *checks,
                                           {"event": "eval", "time": 5.9, "auc": 0.74, "best_step": 4}, summary])
    page = write_report(tmp_path, tmp_path / "new" / "out.html").read_text()  # --out's directory is created
    assert "AUC 0.7400 (best validated step 4)" in page
    assert page.count("data:image/png;base64,") == 2 and "Fault tolerance timeline" not in page
    assert "no kill, restart, catch-up or redo" in page and "Reading the logs" not in page
    assert write_report(tmp_path / "train_log.jsonl") == tmp_path / "report.html"  # the log named: its run's page


def test_report_tolerates_killed_writers_a_reused_directory_and_stale_kill_files(tmp_path: Path) -> None:
    """Group 1's writer died mid-line and the restarted incarnation appended to that line; the
    directory also holds an earlier run (both logs) and that run's kill file."""
    root = fake_run(tmp_path)
    for g in (0, 1):
        log = root / f"replica{g}" / "train_log.jsonl"
        earlier = [{"event": "start", "time": 10.0, "world_size": 2, "incarnation": 0},
                   _commit(0, 10.5, ["replica0", "replica1"])]
        lines = log.read_text().splitlines(keepends=True)
        if g == 1:  # the line before incarnation 1's start: cut mid-line, the start glued to it
            lines[6:8] = [lines[6][:40] + lines[7]]
        log.write_text("".join(json.dumps(e) + "\n" for e in earlier) + "".join(lines))
    (root / "replica0" / "rank0.killed").write_text("10.7")
    run = read_run(root)
    assert [g.earlier_runs for g in run.groups] == [1, 1] and [len(g.garbled) for g in run.groups] == [0, 1]
    assert run.kills == [Kill(1, 1, 100.65)] and run.groups[1].of("start")[-1]["incarnation"] == 1
    assert min(c["time"] for g in run.groups for c in g.commits) > 100
    page = write_report(root).read_text()
    assert "holds 2 runs (the output_dir was reused)" in page and "1 truncated line skipped" in page
    assert "1 kill file older than the reported run left out" in page and "incarnation 1 started" in page


def test_long_runs_are_thinned_for_the_figures_keeping_every_notable_commit(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "THIN_ABOVE", 20)
    both = ["replica0", "replica1"]
    events = [_commit(s, 1.0 + s, both, attempts=2 if s == 151 else 1) for s in range(300)]
    events[200:210] = [_commit(s, 1.0 + s, ["replica0"]) for s in range(200, 210)]
    _write(tmp_path / "train_log.jsonl", events)
    (tmp_path / "rank3.killed").write_text("199.5")  # beside a log in the run directory itself: group 0
    run = read_run(tmp_path)
    group = run.groups[0]
    assert group.total_commits == 300 and group.stride > 1 and len(group.commits) < 60
    kept = {c["step"] for c in group.commits}
    assert {0, 151, 200, 210, 299} <= kept  # first, the redo, the quorum changes, the last
    assert any("figures show every" in n for n in run.notes) and run.kills == [Kill(0, 3, 199.5)]


@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: None, "no such run directory"),
    (lambda p: p.mkdir(), "no train_log.jsonl"),
    (lambda p: _write(p / "replica0" / "train_log.jsonl", [{"event": "start", "time": 1.0}]), "no committed step"),
    (lambda p: (p / "replica0").mkdir(parents=True) or (p / "replica0" / "train_log.jsonl").write_text(
        '{"event": "start", "time": 1}\n{"event": "commit", "ti\n'), "no committed step"),  # killed writer: tolerated
    (lambda p: (p / "replica0").mkdir(parents=True) or (p / "replica0" / "train_log.jsonl").write_bytes(
        b'{"event": "start", "time": 1}\n\x00\xff\xfe\n'), "no committed step"),  # not UTF-8: one garbled line
    (lambda p: p.mkdir() or (p / "train_log.jsonl").write_text("step,loss\n1,0.5\n"),
     "train_log.jsonl:1: not a JSON line (no log event"),
    (lambda p: p.mkdir() or (p / "train_log.jsonl").write_text('{"event": "start", "time": 1}\nx\ny\nz\n'),
     "train_log.jsonl:2: not a JSON line (3 garbled lines: more than killed writers leave"),
    (lambda p: _write(p / "train_log.jsonl", [{"time": 1.0}]), "train_log.jsonl:1: not a log event"),
    (lambda p: _write(p / "train_log.jsonl", [{**_commit(0, 1.0, []), "step": "6"}]),
     "train_log.jsonl:1: commit event's 'step' is '6', not an integer"),
    (lambda p: _write(p / "train_log.jsonl", [{"event": "catch_up", "time": 1.0, "catch_up": {"started": "x"}}]),
     "train_log.jsonl:1: catch_up event's 'catch_up.started' is 'x', not a number"),
    (lambda p: _write(p / "train_log.jsonl", [{"event": "checkpoint", "time": 1.0}]),
     "train_log.jsonl:1: checkpoint event has no 'step'"),
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
