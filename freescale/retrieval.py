"""Next-item retrieval: the sampled softmax it trains with, and HR / NDCG / MRR over the whole vocabulary.

Training (``sampled_softmax_loss``).  Each supervised position has a query ``q`` (the sequence
model's output there) and a positive item (the item that came next).  Scoring every item of a
vocabulary of millions per position is what the full softmax would cost; instead the positive
competes with a shared set of sampled negatives: the batch's own positives (in-batch) and/or
ids drawn uniformly from the vocabulary.  In-batch negatives are drawn in proportion to item
popularity, so without a correction popular items are pushed down for being popular: every
logit, the positive's included, is corrected by the log of the item's expected count in the
sample set (``log_q``; Bengio & Senecal's sampled softmax, the logQ correction of Yi et al.,
RecSys'19), ``n_in_batch * p(item) + n_uniform / V``.  A negative equal to the positive (an
accidental hit) is masked.  With the whole vocabulary as the negatives the loss is the full
softmax's cross-entropy exactly (the tests check it).

Evaluation (``RankCounter``, ``RetrievalWindow``).  One held-out item per query (leave-one-out):
its rank among all items is all HR@K, NDCG@K and MRR need, so no top-k list is ever formed.
The item table stays sharded as torchrec placed it: every rank scores every query against the
rows it holds and counts the items scoring above the held-out one (and tied with it): an
all-reduce of the held-out items' scores (one float per query: its owner's) and one of two
integers per query add it up.  Queries travel (an all-gather of
``[n, D]`` per rank), the table never does.  A table split by columns (column-wise sharding)
holds partial scores: those are summed with an all-reduce of ``[queries, items]`` in chunks
before counting (exact, more traffic; a row-wise or table-wise plan needs none).  Ties count as
a random order would: the held-out item is equally likely at each tied position.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale.distributed import collective_device, spans_ranks

HIT_KS = (1, 10, 50)
NDCG_KS = (10, 50)


# ----------------------------------------------------------------------------------------- training
def expected_log_count(item_probs: torch.Tensor, in_batch: int | torch.Tensor, uniform: int,
                       vocab: int) -> torch.Tensor:
    """``log(in_batch * p(item) + uniform / V)``: the log of an item's expected count among ``in_batch``
    negatives drawn by popularity (``item_probs``: p of the items asked about; p sums to 1 over the
    vocabulary of ``vocab`` items) and ``uniform`` drawn uniformly."""
    return torch.log(in_batch * item_probs.double() + uniform / vocab).float()


def sampled_softmax_loss(
    query_ND: torch.Tensor, positive_ND: torch.Tensor, positive_ids_N: torch.Tensor,
    negative_MD: torch.Tensor, negative_ids_M: torch.Tensor, *, temperature: float,
    log_count_N: torch.Tensor | None = None, log_count_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-query cross-entropy of the positive against the shared negatives (module docstring); ``[N]``.

    ``log_count_*``: the logQ correction of each positive and negative (omit both for none)."""
    positive_N = (query_ND * positive_ND).sum(-1) / temperature
    negative_NM = query_ND @ negative_MD.T / temperature
    if log_count_N is not None and log_count_M is not None:
        positive_N = positive_N - log_count_N
        negative_NM = negative_NM - log_count_M.unsqueeze(0)
    hit_NM = positive_ids_N.unsqueeze(1) == negative_ids_M.unsqueeze(0)
    negative_NM = negative_NM.masked_fill(hit_NM, float("-inf"))
    logits = torch.cat([positive_N.unsqueeze(1), negative_NM], dim=1)
    return F.cross_entropy(logits, torch.zeros_like(positive_ids_N), reduction="none")


# --------------------------------------------------------------------------------------- evaluation
def rank_metrics(greater: torch.Tensor, ties: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-query HR@K, NDCG@K and reciprocal rank (float64) of a held-out item that ``greater`` items
    outscore and ``ties`` other items equal, with the tied order random (its position uniform over
    ``greater .. greater + ties``)."""
    g, t = greater.double(), ties.double()
    spread = t + 1
    out = {f"hr@{k}": ((k - g).clamp(min=0).minimum(spread) / spread) for k in HIT_KS}
    for k in NDCG_KS:
        position = torch.arange(k, dtype=torch.float64, device=g.device)
        inside = (position >= g.unsqueeze(1)) & (position <= (g + t).unsqueeze(1))
        out[f"ndcg@{k}"] = (inside / torch.log2(position + 2)).sum(1) / spread
    # sum_{p=g}^{g+t} 1/(p+1) = H(g+t+1) - H(g), H(n) = digamma(n+1) + Euler's constant
    out["mrr"] = (torch.special.digamma(g + t + 2) - torch.special.digamma(g + 1)) / spread
    return out


@dataclass
class RetrievalMetrics:
    values: dict[str, float]
    """``hr@1``, ``hr@10``, ``hr@50``, ``ndcg@10``, ``ndcg@50``, ``mrr`` (NaN without queries)."""
    queries: int


class RetrievalWindow:
    """Sums of the per-query metrics on this rank; ``compute`` gives their means over every rank's queries."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._sums: dict[str, float] = {}
        self._count = 0

    def add(self, greater: torch.Tensor, ties: torch.Tensor) -> None:
        for name, values in rank_metrics(greater, ties).items():
            self._sums[name] = self._sums.get(name, 0.0) + float(values.sum())
        self._count += int(greater.numel())

    def compute(self) -> RetrievalMetrics:
        """Collective over the group (one all-reduce of 7 float64)."""
        names = [f"hr@{k}" for k in HIT_KS] + [f"ndcg@{k}" for k in NDCG_KS] + ["mrr"]
        sums = torch.tensor([self._sums.get(n, 0.0) for n in names] + [float(self._count)], dtype=torch.float64)
        if spans_ranks(self._group):
            sums = sums.to(collective_device(self._group))
            dist.all_reduce(sums, group=self._group)
        count = int(sums[-1])
        return RetrievalMetrics({n: float(s) / count if count else math.nan for n, s in zip(names, sums.tolist())},
                                count)


@dataclass(frozen=True)
class ItemShard:
    """Rows ``row0 ..`` and columns ``col0 ..`` of the item table, held by this rank."""

    row0: int
    col0: int
    weight: torch.Tensor


class RankCounter:
    """Counts, for every query, the items of the whole (sharded) table that outscore its held-out item.

    Collective: every rank of ``group`` calls ``count`` the same number of times (module docstring)."""

    def __init__(self, shards: list[ItemShard], num_items: int, column_split: bool,
                 group: dist.ProcessGroup | None = None, chunk_bytes: int = 64 << 20, replicated: bool = False) -> None:
        self.shards, self.num_items, self.column_split = shards, num_items, column_split
        self.group = group
        self.chunk_bytes = chunk_bytes
        self.replicated = replicated
        """Every rank holds the whole table (data-parallel, or one process): no collective at all."""

    @classmethod
    def of_sharded(cls, weight: object, group: dist.ProcessGroup | None = None) -> RankCounter:
        """From the item table's weight in the model's state dict: a ``ShardedTensor`` (its local
        shards are views of the table, nothing is copied) or, unsharded, a plain tensor."""
        if isinstance(weight, torch.Tensor) and not hasattr(weight, "local_shards"):
            return cls([ItemShard(0, 0, weight.detach())], weight.shape[0], False, group, replicated=True)
        with warnings.catch_warnings():  # torchrec 1.8's state dict is ShardedTensors, which warn of their future
            warnings.simplefilter("ignore", FutureWarning)
            rows, width = weight.size()  # type: ignore[attr-defined]
            shards = [ItemShard(int(s.metadata.shard_offsets[0]), int(s.metadata.shard_offsets[1]), s.tensor.detach())
                      for s in weight.local_shards()]  # type: ignore[attr-defined]
            split = any(m.shard_sizes[1] != width for m in weight.metadata().shards_metadata)  # type: ignore[attr-defined]
        return cls(shards, int(rows), split, group)

    def count(self, query_ND: torch.Tensor, target_ids_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(items scoring above each query's target, other items scoring equal), for this rank's queries."""
        queries, targets, mine = self._gather(query_ND.detach().float(), target_ids_N.to(query_ND.device))
        greater = torch.zeros(queries.shape[0], dtype=torch.int64, device=queries.device)
        ties = torch.zeros_like(greater)
        step = max(1, self.chunk_bytes // (4 * max(self.num_items, 1)))  # the same chunks on every rank
        for start in range(0, queries.shape[0], step):
            rows = slice(start, start + step)
            g, t = (self._count_split if self.column_split else self._count_rows)(queries[rows], targets[rows])
            greater[rows], ties[rows] = g, t
        return greater[mine], ties[mine]

    def _count_rows(self, query: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole rows on each rank: the target's score from its owner, then each rank counts its rows."""
        local = [(s, query @ s.weight.float().T) for s in self.shards]
        target_score = torch.zeros(query.shape[0], dtype=torch.float32, device=query.device)
        for shard, scores in local:
            at = target - shard.row0
            own = (at >= 0) & (at < shard.weight.shape[0])
            target_score[own] = scores[own, at[own]]
        self._all_reduce(target_score)  # one owner per target: the sum is its score
        counts = torch.zeros(2, query.shape[0], dtype=torch.int64, device=query.device)
        for shard, scores in local:
            counts += self._tally(scores, target_score, target - shard.row0)
        self._all_reduce(counts)
        return counts[0], counts[1]

    def _count_split(self, query: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Column pieces: each rank's partial scores summed over the vocabulary, then counted."""
        scores = torch.zeros(query.shape[0], self.num_items, dtype=torch.float32, device=query.device)
        for s in self.shards:
            cols = slice(s.col0, s.col0 + s.weight.shape[1])
            scores[:, s.row0:s.row0 + s.weight.shape[0]] += query[:, cols] @ s.weight.float().T
        self._all_reduce(scores)
        target_score = scores.gather(1, target.view(-1, 1)).squeeze(1)
        counts = self._tally(scores, target_score, target)
        return counts[0], counts[1]

    @staticmethod
    def _tally(scores: torch.Tensor, target_score: torch.Tensor, target_at: torch.Tensor) -> torch.Tensor:
        """[2, n]: per query, the columns of ``scores`` above its target's score, and those equal (the
        target's own column, ``target_at`` when inside, not counted)."""
        above = (scores > target_score.unsqueeze(1)).sum(1)
        equal = (scores == target_score.unsqueeze(1)).sum(1)
        inside = (target_at >= 0) & (target_at < scores.shape[1])
        return torch.stack([above, equal - inside.long()])

    def _gather(self, query: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, slice]:
        """Every rank's queries and targets, and where this rank's are among them."""
        if not self._distributed:
            return query, target.long(), slice(0, query.shape[0])
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        device = collective_device(self.group)  # the CPU under gloo, this process's GPU under NCCL
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([query.shape[0]], device=device), group=self.group)
        counts = [int(s) for s in sizes]
        longest = max(counts)
        padded_q = torch.zeros(longest, query.shape[1], dtype=query.dtype, device=device)
        padded_q[:query.shape[0]] = query
        padded_t = torch.zeros(longest, dtype=torch.int64, device=device)
        padded_t[:query.shape[0]] = target
        qs = [torch.empty_like(padded_q) for _ in range(world)]
        ts = [torch.empty_like(padded_t) for _ in range(world)]
        dist.all_gather(qs, padded_q, group=self.group)
        dist.all_gather(ts, padded_t, group=self.group)
        start, home = sum(counts[:rank]), query.device  # scored where the shards are
        return (torch.cat([q[:n] for q, n in zip(qs, counts)]).to(home),
                torch.cat([t[:n] for t, n in zip(ts, counts)]).to(home), slice(start, start + counts[rank]))

    @property
    def _distributed(self) -> bool:
        return not self.replicated and spans_ranks(self.group)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """In place; through the collective device when the tensor lives elsewhere."""
        if self._distributed:
            device = collective_device(self.group)
            moved = tensor.to(device)
            dist.all_reduce(moved, group=self.group)
            if moved is not tensor:
                tensor.copy_(moved)
