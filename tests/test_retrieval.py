"""Retrieval's loss and metrics, one process (the sharded rank counts: ``test_reshard``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from freescale.retrieval import (
    ItemShard,
    RankCounter,
    RetrievalWindow,
    expected_log_count,
    rank_metrics,
    sampled_softmax_loss,
)


def test_with_the_whole_vocabulary_as_negatives_the_sampled_softmax_is_the_full_softmax() -> None:
    """Every item once as a negative (the positive among them, masked as an accidental hit) and a correction
    that is the same for every item: the cross-entropy of the full softmax, exactly."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 8, generator=g, dtype=torch.float64)
    query = torch.randn(7, 8, generator=g, dtype=torch.float64)
    positive = torch.randint(0, 50, (7,), generator=g)
    full = F.cross_entropy(query @ table.T / 0.1, positive, reduction="none")
    everything = torch.arange(50)
    plain = sampled_softmax_loss(query, table[positive], positive, table, everything, temperature=0.1)
    uniform = expected_log_count(torch.full((50,), 1 / 50, dtype=torch.float64), 0, 50, 50)
    corrected = sampled_softmax_loss(query, table[positive], positive, table, everything, temperature=0.1,
                                     log_count_N=uniform[positive].double(), log_count_M=uniform.double())
    torch.testing.assert_close(plain, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(corrected, full, rtol=1e-6, atol=1e-6)  # float32 log counts


def test_logq_correction_and_accidental_hits() -> None:
    """A negative equal to the positive is ignored; the correction subtracts each item's log expected count."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(6, 4, generator=g)
    query = torch.randn(2, 4, generator=g)
    positive = torch.tensor([1, 4])
    negatives = torch.tensor([0, 1, 2])
    loss = sampled_softmax_loss(query, table[positive], positive, table[negatives], negatives, temperature=1.0)
    logits0 = torch.stack([query[0] @ table[1], query[0] @ table[0], query[0] @ table[2]])
    assert torch.isclose(loss[0], -torch.log_softmax(logits0, 0)[0])
    probs = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    counts = expected_log_count(probs, in_batch=8, uniform=4, vocab=6)
    assert torch.allclose(counts.exp(), 8 * probs + 4 / 6)
    corrected = sampled_softmax_loss(query, table[positive], positive, table[negatives], negatives, temperature=1.0,
                                     log_count_N=counts[positive], log_count_M=counts[negatives])
    logits1 = torch.stack([query[1] @ table[4] - counts[4]] + [query[1] @ table[n] - counts[n] for n in (0, 1, 2)])
    assert torch.isclose(corrected[1], -torch.log_softmax(logits1, 0)[0])


@pytest.mark.parametrize(("greater", "ties", "want"), [
    (0, 0, {"hr@1": 1, "hr@10": 1, "ndcg@10": 1, "mrr": 1}),
    (3, 0, {"hr@1": 0, "hr@10": 1, "ndcg@10": 1 / math.log2(5), "mrr": 1 / 4}),
    (0, 1, {"hr@1": 0.5, "ndcg@10": (1 + 1 / math.log2(3)) / 2, "mrr": 0.75}),  # tied with one: first or second
    (9, 2, {"hr@10": 1 / 3, "ndcg@10": 1 / math.log2(11) / 3, "mrr": (1 / 10 + 1 / 11 + 1 / 12) / 3}),
    (60, 0, {"hr@50": 0, "ndcg@50": 0, "mrr": 1 / 61}),
    (48, 4, {"hr@50": 2 / 5, "ndcg@50": (1 / math.log2(50) + 1 / math.log2(51)) / 5}),
])
def test_metrics_of_one_held_out_item_by_hand(greater: int, ties: int, want: dict[str, float]) -> None:
    got = rank_metrics(torch.tensor([greater]), torch.tensor([ties]))
    for name, value in want.items():
        assert float(got[name][0]) == pytest.approx(value, rel=1e-12), name


def test_window_means_and_no_queries() -> None:
    window = RetrievalWindow()
    assert window.compute().queries == 0 and math.isnan(window.compute().values["mrr"])
    window.add(torch.tensor([0, 3]), torch.tensor([0, 0]))
    window.add(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))  # a batch with none
    result = window.compute()
    assert result.queries == 2 and result.values["mrr"] == pytest.approx((1 + 1 / 4) / 2)
    assert result.values["hr@1"] == 0.5 and result.values["hr@10"] == 1.0


@pytest.mark.parametrize("column_split", [False, True])
def test_counts_on_one_process_split_by_rows_or_columns_equal_a_full_sort(column_split: bool) -> None:
    """Small integers: every score is exact in any order of summation, and many tie."""
    g = torch.Generator().manual_seed(2)
    table = torch.randint(-2, 3, (30, 6), generator=g).float()
    if column_split:
        shards = [ItemShard(0, 0, table[:, :2]), ItemShard(0, 2, table[:, 2:])]
    else:
        shards = [ItemShard(0, 0, table[:11]), ItemShard(11, 0, table[11:])]
    counter = RankCounter(shards, 30, column_split, chunk_bytes=3 * 4 * 30)  # three queries a chunk
    query = torch.randint(-2, 3, (8, 6), generator=g).float()
    target = torch.tensor([3, 7, 0, 29, 11, 10, 5, 3])
    greater, ties = counter.count(query, target)
    scores = query @ table.T
    at = scores.gather(1, target.view(-1, 1))
    assert torch.equal(greater, (scores > at).sum(1))
    assert torch.equal(ties, (scores == at).sum(1) - 1) and ties.sum() > 0
