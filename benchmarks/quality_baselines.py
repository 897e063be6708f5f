"""The non-neural baselines of ``bench_quality.py``, scored on exactly the held-out items the models are.

Each is fit on the training positions of every user's sequence (``freescale prepare``'s ``[1, train_end)``: never
a validation or test item) and scores, for each evaluated sample, every item given the user's history before it
(the validation item included, as the models see it).  Equal scores count as a random order would
(``freescale.retrieval.rank_metrics``: the expected rank among the ties), so no baseline gains from how ties fall.
No weight below was tuned on a held-out item: each is fixed here, before any run.

  most popular              items by their count as training targets
  last-item co-occurrence   how often each item followed the user's last item in training (ties: random order)
  order-2 Markov (backoff)  the next item given the last two, Dirichlet-smoothed towards the order-1 estimate,
                            itself smoothed towards popularity (weights 1 and 1)
  item-kNN over history     cosine similarity of items over the users whose training sequences hold them, summed
                            over the user's whole history, the most recent items weighted up (1 / sqrt(age))
  transitions + history kNN the last item's transition probabilities plus kNN over the history in training
                            transitions (the reference of earlier figures)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.dataset as pads
import torch

from freescale.retrieval import rank_metrics


def users_of(data: Any) -> dict[str, Any]:
    """Every user's sequence: flat item ids and labels, offsets, and where training and validation end (data
    without a validation split: ``valid_end = train_end``)."""
    dataset = pads.dataset(sorted(str(p) for p in data.glob("users-*.parquet")), format="parquet")
    columns = ["item_ids", "labels", "length", "train_end"]
    has_valid = "valid_end" in dataset.schema.names
    table = dataset.to_table(columns=columns + (["valid_end"] if has_valid else []))
    items, labels = table.column("item_ids").combine_chunks(), table.column("labels").combine_chunks()
    offsets = items.offsets.to_numpy().astype(np.int64)
    train_end = table.column("train_end").to_numpy().astype(np.int64)
    return {"items": items.values.to_numpy(), "labels": labels.values.to_numpy(), "start": offsets[:-1],
            "length": table.column("length").to_numpy().astype(np.int64), "train_end": train_end,
            "valid_end": table.column("valid_end").to_numpy().astype(np.int64) if has_valid else train_end}


def positions(u: dict[str, Any], split: str = "eval") -> tuple[np.ndarray, np.ndarray]:
    """Flat positions of ``split``'s samples (``eval``: the test part; ``valid``) and of the training targets."""
    at = np.arange(u["items"].size) - np.repeat(u["start"], u["length"])
    train_end, valid_end = (np.repeat(u[k], u["length"]) for k in ("train_end", "valid_end"))
    low, high = (train_end, valid_end) if split == "valid" else (valid_end, np.repeat(u["length"], u["length"]))
    chosen = np.nonzero((at >= np.maximum(low, 1)) & (at < high))[0]
    return chosen, np.nonzero((at >= 1) & (at < train_end))[0]


def ranked(scores: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """HR/NDCG/MRR of ``target`` under per-query item ``scores`` [queries, items] (ties in random order)."""
    s = torch.from_numpy(scores)
    at = s.gather(1, torch.from_numpy(target).view(-1, 1))
    metrics = rank_metrics((s > at).sum(1), (s == at).sum(1) - 1)
    return {k: float(v.mean()) for k, v in metrics.items()}


def training_counts(u: dict[str, Any], train: np.ndarray, num_items: int) -> tuple[np.ndarray, np.ndarray]:
    """How often each item is a training target, and how often each item followed each other ``[from, to]``."""
    items, n = u["items"], num_items
    popularity = np.bincount(items[train], minlength=n).astype(np.float64)
    follows = np.bincount(items[train - 1] * n + items[train], minlength=n * n).astype(np.float64).reshape(n, n)
    return popularity, follows


def baselines(u: dict[str, Any], num_items: int, split: str = "eval") -> dict[str, dict[str, float]]:
    """Every baseline's HR/NDCG/MRR on ``split`` (module docstring)."""
    evaluate, train = positions(u, split)
    items, n = u["items"], num_items
    target, last = items[evaluate], items[evaluate - 1]
    popularity, follows = training_counts(u, train, n)
    prior = (popularity + 1) / (popularity.sum() + n)
    order1 = (follows + prior) / (follows.sum(1, keepdims=True) + 1)  # Dirichlet towards popularity, weight 1
    return {
        "most popular": ranked(np.tile(popularity, (target.size, 1)), target),
        "last-item co-occurrence": ranked(follows[last], target),
        "order-2 Markov (backoff)": ranked(order2(u, evaluate, train, order1), target),
        "item-kNN over history": ranked(history_item_knn(u, evaluate, train, n), target),
        "transitions + history kNN": ranked(transitions_knn(u, evaluate, follows, popularity), target),
    }


def order2(u: dict[str, Any], evaluate: np.ndarray, train: np.ndarray, order1: np.ndarray) -> np.ndarray:
    """P(next | the last two) from training triples, Dirichlet-smoothed (weight 1) towards ``order1[last]``."""
    items, n = u["items"], order1.shape[0]
    second = train[(train >= 2) & _same_user(u, train - 2, train)]  # targets with two items before them
    pair_of = items[second - 2] * n + items[second - 1]
    order = np.argsort(pair_of, kind="stable")
    pairs, nexts = pair_of[order], items[second][order]
    scores = np.empty((evaluate.size, n))
    for row, at in enumerate(evaluate):
        prior = order1[items[at - 1]]
        if at - 2 < u["start"][_owner(u, at)]:  # no second-to-last item: order 1 alone
            scores[row] = prior
            continue
        key = items[at - 2] * n + items[at - 1]
        lo, hi = np.searchsorted(pairs, key), np.searchsorted(pairs, key, side="right")
        scores[row] = (np.bincount(nexts[lo:hi], minlength=n) + prior) / (hi - lo + 1)
    return scores


def history_item_knn(u: dict[str, Any], evaluate: np.ndarray, train: np.ndarray, num_items: int) -> np.ndarray:
    """Items scored by cosine similarity (over the users whose training sequences hold both) to the user's history,
    each history item weighted by 1 / sqrt(its age in interactions); an item never scores from itself."""
    owner = np.repeat(np.arange(u["length"].size), u["length"])
    held = np.zeros((u["length"].size, num_items), dtype=np.float32)
    held[owner[train], u["items"][train]] = 1.0
    held[owner[train - 1], u["items"][train - 1]] = 1.0  # every training position's history too
    together = held.T @ held
    degree = np.sqrt(np.maximum(np.diag(together), 1.0))
    similar = together / degree[:, None] / degree[None, :]
    np.fill_diagonal(similar, 0.0)
    scores = np.empty((evaluate.size, num_items))
    for row, at in enumerate(evaluate):
        history = u["items"][u["start"][owner[at]]:at]
        weights = 1.0 / np.sqrt(np.arange(history.size, 0, -1, dtype=np.float64))
        scores[row] = np.bincount(history, weights, minlength=num_items) @ similar
    return scores


def transitions_knn(u: dict[str, Any], evaluate: np.ndarray, follows: np.ndarray, popularity: np.ndarray) -> np.ndarray:
    """The last item's transition probabilities plus item-kNN over the user's whole history in training
    transitions (either way), weights fixed beforehand (1 : 1); popularity breaks ties."""
    transitions = follows / np.maximum(follows.sum(1, keepdims=True), 1)
    neighbours = follows + follows.T
    neighbours = neighbours / np.maximum(neighbours.sum(1, keepdims=True), 1)
    owner = np.repeat(np.arange(u["length"].size), u["length"])
    scores = np.empty((evaluate.size, follows.shape[0]))
    for row, at in enumerate(evaluate):
        history = u["items"][u["start"][owner[at]]:at]
        profile = np.bincount(history, minlength=follows.shape[0]) / max(history.size, 1)
        scores[row] = transitions[u["items"][at - 1]] + profile @ neighbours
    return scores + 1e-9 * popularity / (popularity.max() + 1)


def _owner(u: dict[str, Any], at: int) -> int:
    return int(np.searchsorted(u["start"], at, side="right") - 1)


def _same_user(u: dict[str, Any], first: np.ndarray, then: np.ndarray) -> np.ndarray:
    """Whether flat positions ``first`` and ``then`` belong to one user."""
    owner = np.repeat(np.arange(u["length"].size), u["length"])
    return owner[np.clip(first, 0, None)] == owner[then]
