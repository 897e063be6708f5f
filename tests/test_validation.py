"""Training to convergence (``freescale.validation``): the best validated step, early stopping, the agreement
across replica groups, and a run that validates trains exactly as one that does not."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from freescale.audit import commits_by_step
from freescale.testing import AUDIT_ENV
from freescale.validation import BEST_NAME, BestTracker, ValidationShare, parse_every, validation_steps
from tests.conftest import REPO


def test_the_tracker_keeps_the_best_and_stops_after_the_patience() -> None:
    auc = BestTracker("auc", patience=2)
    assert [auc.observe(s, v) for s, v in ((10, 0.7), (20, 0.8), (30, math.nan), (40, 0.8))] == [True, True, False, False]
    assert (auc.best_step, auc.best_value, auc.since_best, auc.stop_at) == (20, 0.8, 2, 40)  # a tie is no better
    assert auc.observe(50, 0.9) and auc.stop_at == 40  # (the stop, once set, stays)
    loss = BestTracker("loss")
    assert [loss.observe(s, v) for s, v in ((1, 0.5), (2, 0.6), (3, 0.4))] == [True, False, True]
    assert loss.stop_at is None  # no patience: never stops
    copy = BestTracker("loss")
    copy.load_state_dict(json.loads(json.dumps(loss.state_dict())))
    assert copy == loss
    assert parse_every("1e") == (1.0, True) and parse_every("250") == (250, False) and parse_every("x") is None
    assert validation_steps("0.5e", 157) == 78 and validation_steps("0", 157) == 0 and validation_steps("40", 7) == 40


def test_replica_groups_decide_from_the_lowest_groups_value_in_every_bit() -> None:
    """Two groups whose evaluations differ in the last bit (one ran on fewer ranks): both decide from group 0's."""
    ours, theirs = ValidationShare(BestTracker("ndcg@10")), ValidationShare(BestTracker("ndcg@10"))
    value = 0.123456789
    ours.offer(100, value)
    theirs.offer(100, float(np.nextafter(value, 1.0)))
    headers = {0: ours.header(), 1: theirs.header()}
    assert bool((ours.header() == 0).all())  # told once
    for share in (theirs, ours):
        share.on_commit(None, {1: headers[1], 0: headers[0]})  # type: ignore[arg-type]  # (the commit is not read)
        assert share.decided == [(100, value, True)]
        share.on_commit(None, headers)  # type: ignore[arg-type]  # the same step again (a replay): no second decision
        assert len(share.tracker.history) == 1
    assert ours.tracker == theirs.tracker


def _train(tiny_data: Path, out: Path, steps: int, *extra: str) -> list[dict[str, Any]]:
    from freescale.cli import main

    assert main(["train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}",
                 "--data.batch_size=64", f"--train.steps={steps}", f"--train.output_dir={out}",
                 "--train.progress=false", "--checkpoint.every=0", "--checkpoint.keep=1", *extra]) == 0
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_early_stop_keeps_the_best_step_and_validating_changes_no_step(
        tiny_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that validates every 10 steps stops 2 validations after its best; the best checkpoint survives
    ``checkpoint.keep = 1`` and the final test evaluation runs on it; resumed, it trains no further.  A run without validation trained to that
    best step took the same steps, bit for bit (the state hash of every step), and scores the same on the test
    split: validating changed nothing, and the kept checkpoint is the best step's state."""
    monkeypatch.setenv(AUDIT_ENV, "1")
    validated = _train(tiny_data, tmp_path / "validated", 300, "--eval.every=10", "--train.early_stop=2",
                       "--optim.dense_lr=0.03")
    checks = {e["step"]: e["auc"] for e in validated if e["event"] == "validate"}
    decisions = [e for e in validated if e["event"] == "validation_decision"]
    best = max(checks, key=lambda s: (checks[s], -s))
    stopped = [e["step"] for e in validated if e["event"] == "early_stop"]
    assert stopped == [best + 20] and max(checks) == best + 20 < 300, (checks, stopped)
    assert decisions[-1]["best_step"] == best and decisions[-1]["stop_at"] == best + 20
    root = tmp_path / "validated" / "checkpoints"
    assert json.loads((root / BEST_NAME).read_text())["step"] == best
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{best:09d}", f"step_{best + 20:09d}"]
    final = [e for e in validated if e["event"] == "eval"]
    assert len(final) == 1 and final[0]["best_step"] == best
    # Resumed from its last checkpoint (the stop's): it trains nothing more, and tests the best step again.
    again = _train(tiny_data, tmp_path / "validated", 300, "--eval.every=10", "--train.early_stop=2",
                   "--optim.dense_lr=0.03", "--checkpoint.resume=true")[len(validated):]
    assert not [e for e in again if e["event"] == "commit"]
    assert [e.get("resumed") for e in again if e["event"] == "early_stop"] == [True]
    assert [e["best_step"] for e in again if e["event"] == "eval"] == [best]
    plain = _train(tiny_data, tmp_path / "plain", best, "--optim.dense_lr=0.03")
    assert not any(e["event"] == "validate" for e in plain)
    ours, theirs = commits_by_step(validated), commits_by_step(plain)
    assert all(ours[s]["digest"] == theirs[s]["digest"] for s in range(best)), "validating changed a step"
    (plain_final,) = [e for e in plain if e["event"] == "eval"]
    assert {k: plain_final[k] for k in ("loss", "auc", "ne")} == {k: final[0][k] for k in ("loss", "auc", "ne")}


def test_epochs_set_the_steps_and_a_validation_needs_its_split_and_metric(
        tiny_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from freescale.cli import main

    log = _train(tiny_data, tmp_path / "epochs", 1, "--train.epochs=1", "--eval.every=0.4e", "--train.eval=false")
    start = next(e for e in log if e["event"] == "start")
    assert start["config"]["train"]["steps"] == 20_000 // 64 == 312  # one pass over the training split
    assert [e["step"] for e in log if e["event"] == "validate"] == [125, 250, 312]  # every 0.4 epoch, and the last
    base = ["train", "--config", str(REPO / "configs" / "tiny_dlrm.toml"), f"--data.path={tiny_data}",
            f"--train.output_dir={tmp_path / 'bad'}", "--train.progress=false", "--train.steps=20"]
    assert main([*base, "--train.early_stop=3"]) == 2
    assert "train.early_stop: stops after validations without improvement, and eval.every is 0" in capsys.readouterr().err
    assert main([*base, "--eval.every=10", "--eval.metric=ndcg@10"]) == 2
    err = capsys.readouterr().err
    assert "eval.metric: 'ndcg@10' is not one a ranking evaluation reports (loss, auc, ne)" in err
    assert "Traceback" not in err
    assert main([*base, "--eval.every=10", "--eval.split=eval"]) == 2
    assert "eval.split: 'eval' is the test split" in capsys.readouterr().err
    assert main([*base, "--eval.every=10", "--eval.split=holdout"]) == 2
    assert "has no samples in its 'holdout' split" in capsys.readouterr().err
    torch.manual_seed(0)  # (the in-process runs above reseeded it: leave a known state)
