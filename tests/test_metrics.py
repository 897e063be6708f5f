"""Click metrics from reduced state equal the metrics of all samples in one place.

One process: ``click_metrics`` against a brute-force pair count and torchmetrics, and
``MetricWindow`` against ``click_metrics``.  Two real processes (spawn, gloo on
loopback) with unequal sample counts, one rank empty, ties across ranks: every rank
gets the numbers ``click_metrics`` gives on the concatenated data.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from freescale.metrics import ClickMetrics, MetricWindow, click_metrics
from tests.procs import free_port

WORLD = 2


def _batch(seed: int, n: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """n (logit, label) pairs; with ``ties`` many logits repeat (rounded to 0.25) and some
    saturate (sigmoid of logits above ~37 is exactly 1.0 in float64: distinct logits, tied scores)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, generator=g) * 2 - 1
    if ties:
        logits[: n // 2] = torch.round(logits[: n // 2] * 4) / 4
        logits[n // 2 : n // 2 + n // 10] = 40 + torch.rand(n // 10, generator=g) * 5
    labels = (torch.rand(n, generator=g) < torch.sigmoid(logits)).float()
    return logits, labels


# case -> per rank: the sizes of the batches it adds (0: an empty batch).
CASES: dict[str, list[list[int]]] = {
    "unequal": [[300, 0, 411, 7], [129]],
    "rank0_empty": [[], [250, 250]],
    "rank1_empty": [[1000], []],
    "all_empty": [[], []],
    "single_sample": [[1], []],
    "larger": [[20_000, 13_000], [5_000]],
}


def _case(name: str, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seed = sorted(CASES).index(name) * 1000 + rank * 100
    return [_batch(seed + i, n, ties=name != "larger" or i == 0) for i, n in enumerate(CASES[name][rank])]


def _concatenated(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    batches = [b for r in range(WORLD) for b in _case(name, r)]
    if not batches:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def _as_list(m: ClickMetrics) -> list[float]:
    return [m.loss, m.auc, m.ne, float(m.samples)]


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        results: dict[str, list[float]] = {}
        for name in sorted(CASES):
            window = MetricWindow()
            for logits, labels in _case(name, rank):
                window.add(logits, labels)
            results[name] = _as_list(window.compute())
            assert window.compute().samples == 0  # reset by the first compute

        # reset=False keeps the samples; an explicit group; a second window alongside.
        group = dist.new_group([0, 1], backend="gloo")
        window, other = MetricWindow(group=group), MetricWindow()
        first, second = _case("unequal", rank)[:1], _case("unequal", rank)[1:]
        for logits, labels in first:
            window.add(logits, labels)
            other.add(logits, labels)
        results["partial"] = _as_list(window.compute(reset=False))
        for logits, labels in second:
            window.add(logits, labels)
        results["kept"] = _as_list(window.compute())
        results["other"] = _as_list(other.compute())

        # The sample sort gives each rank about half the rows.
        from freescale.metrics import _CANDIDATES, _redistribute, _tally_samples

        logits = torch.cat([b[0] for b in _case("larger", rank)[1:]] or [torch.zeros(0)])
        if rank == 1:
            logits = torch.cat([logits, torch.randn(15_000, generator=torch.Generator().manual_seed(7))])
        keys, pos, neg, _ = _tally_samples(logits, torch.zeros(logits.numel(), dtype=torch.bool))
        mine = _redistribute(keys, pos, neg, None)
        rows = float((mine[1] + mine[2]).sum())
        results["slice_rows"] = [rows, float(mine[0].min()) if mine[0].numel() else math.nan,
                                 float(mine[0].max()) if mine[0].numel() else math.nan, float(_CANDIDATES)]

        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _close(got: list[float], want: ClickMetrics) -> None:
    loss, auc, ne, samples = got
    assert samples == want.samples
    for value, expected, tol in ((loss, want.loss, 1e-9), (auc, want.auc, 1e-12), (ne, want.ne, 1e-9)):
        if math.isnan(expected):
            assert math.isnan(value), (got, want)
        else:
            assert value == pytest.approx(expected, rel=0, abs=tol), (got, want)


def _brute_force_auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    s = torch.sigmoid(logits.double())
    p, n = s[labels == 1], s[labels == 0]
    greater = (p[:, None] > n[None, :]).sum().item()
    equal = (p[:, None] == n[None, :]).sum().item()
    return (greater + 0.5 * equal) / (p.numel() * n.numel())


def test_click_metrics_exact_auc_loss_and_ne() -> None:
    from torchmetrics.functional.classification import binary_auroc

    for seed, ties in ((0, True), (1, False)):
        logits, labels = _batch(seed, 3000, ties)
        m = click_metrics(logits, labels)
        assert m.samples == 3000
        assert m.auc == pytest.approx(_brute_force_auc(logits, labels), rel=0, abs=1e-12)
        # torchmetrics works in float32.
        tm = float(binary_auroc(torch.sigmoid(logits.double()), labels.long()))
        assert m.auc == pytest.approx(tm, rel=0, abs=1e-6)
        loss = float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))
        assert m.loss == pytest.approx(loss, rel=1e-12)
        rate = float(labels.double().mean())
        assert m.ne == pytest.approx(loss / -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)), rel=1e-12)


def test_click_metrics_degenerate() -> None:
    empty = click_metrics(torch.zeros(0), torch.zeros(0))
    assert empty.samples == 0 and all(math.isnan(v) for v in (empty.loss, empty.auc, empty.ne))
    for label in (0.0, 1.0):
        m = click_metrics(torch.randn(10), torch.full((10,), label))
        assert m.samples == 10 and math.isfinite(m.loss) and math.isnan(m.auc) and math.isnan(m.ne)
    nan = click_metrics(torch.tensor([0.1, float("nan"), -0.3]), torch.tensor([1.0, 0.0, 0.0]))
    assert math.isnan(nan.auc)


def test_window_without_process_group_equals_click_metrics() -> None:
    assert not dist.is_initialized()
    batches = [_batch(10 + i, n, ties=True) for i, n in enumerate((500, 0, 37, 1200))]
    window = MetricWindow()
    for logits, labels in batches[:2]:
        window.add(logits, labels)
    partial = window.compute(reset=False)
    _close(_as_list(partial), click_metrics(torch.cat([b[0] for b in batches[:2]]),
                                            torch.cat([b[1] for b in batches[:2]])))
    for logits, labels in batches[2:]:
        window.add(logits.view(-1, 1), labels.view(-1, 1))  # any shape: flattened
    got = window.compute()
    want = click_metrics(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    _close(_as_list(got), want)  # the loss is summed step by step: equal to rounding
    empty = window.compute()
    assert empty.samples == 0 and math.isnan(empty.loss)


def test_window_with_group_of_one_equals_click_metrics() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        logits, labels = _batch(3, 800, ties=True)
        window = MetricWindow()
        window.add(logits, labels)
        _close(_as_list(window.compute()), click_metrics(logits, labels))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_equal_click_metrics_of_the_concatenation(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for name in CASES:
        want = click_metrics(*_concatenated(name))
        for results in per_rank:
            _close(results[name], want)
        assert json.dumps(per_rank[0][name]) == json.dumps(per_rank[1][name])  # same bits on every rank
    first = [_case("unequal", r)[0] for r in range(WORLD)]
    partial = click_metrics(torch.cat([b[0] for b in first]), torch.cat([b[1] for b in first]))
    whole = click_metrics(*_concatenated("unequal"))
    for results in per_rank:
        _close(results["partial"], partial)
        _close(results["kept"], whole)
        _close(results["other"], partial)

    # Sample sort: rank 0 holds the lower scores, each rank about half of the 28k rows.
    rows0, _, high0, candidates = per_rank[0]["slice_rows"]
    rows1, low1, _, _ = per_rank[1]["slice_rows"]
    total = 13_000 + 15_000  # rank 0: its second "larger" batch; rank 1: 15k fresh scores
    assert rows0 + rows1 == total
    assert abs(rows0 - total / 2) <= 2 * total / candidates + 1
    assert high0 < low1


def test_a_progress_line_of_a_window_with_nothing_trained_says_so(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A group that sat a whole window out (catching up, or not yet planned in) prints that, not ``loss nan``."""
    from freescale.run_log import Progress, RunLog

    progress = Progress(RunLog(tmp_path / "log.jsonl"), 100, 0, "dlrm", True, True, 64, label="group 1  ")
    progress.report(25, 0, 0)
    progress.close()
    assert capsys.readouterr().out.strip() == "group 1  step 25/100  nothing trained since the last line"
    assert json.loads((tmp_path / "log.jsonl").read_text())["step"] == 25  # the record is written as ever
