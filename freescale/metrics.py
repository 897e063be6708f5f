"""Click-model metrics over all ranks: loss, AUC and normalized entropy (NE).

NE is the mean log loss divided by the entropy of the base click rate: 1.0 means
no better than always predicting the average click rate; lower is better.  The
numbers are for the global set of samples of every rank, not rank 0's share,
and no rank ever holds every sample: ranks reduce metric *state*.

What is reduced, and what it costs (n samples in all, over W ranks):

* loss and NE: three sums per rank, accumulated as each step is added (BCE with
  logits in float64, the sample count, the sum of the labels).  They travel in
  the final all-gather of a few floats per rank (O(W)), which every rank sums in
  rank order, so every rank gets the same bits.
* AUC: exact, computed as the Mann-Whitney statistic over the sigmoid scores,
  with tied scores counted half, which is the area under the ROC curve whose
  points are the distinct thresholds, as torchmetrics' ``binary_auroc`` draws it.
  The state is a table of distinct scores with their (positive, negative) counts.
  A distributed sample sort puts each score range on one rank: each rank
  tallies its own scores, the ranks all-gather 256 quantile candidates each
  (O(W) floats per rank) to choose W-1 splitters, and one ``all_to_all`` sends
  every table row to the rank that owns its range.  Equal scores always go to
  the same rank, so each rank counts its ties exactly.  Each rank then adds up
  its part of the statistic, and the final all-gather carries that part and the
  rank's positive and negative counts.  Each distinct score of each rank travels
  once: O(n) traffic in all.  Each rank holds about n/W rows, give or take
  2n/256 (from how the splitters are chosen), and never O(n x W).

Why not torchrec's AUC (``torchrec.metrics.auc``, torchrec 1.8): its state is the
raw predictions, all-gathered to every rank (``gather_all_tensors``), which is
the O(n x W) traffic and memory this module replaces.  It also integrates over
every *sample* in sorted order (``trapz`` of per-sample cumulative sums), so
tied scores do not count half and the result depends on the order of the ties.
Gathering to rank 0 instead is exact but leaves rank 0 with all n samples and
the whole sort while the other ranks wait.

The reference value is exact: U / (P x N) in float64, with U summed from counts
that are exact integers (or halves) up to 2**53.  torchmetrics' ``binary_auroc``
works in float32 (it builds its cumulative counts from ``target * 1.0``), so it
agrees only to about 1e-7, and less well beyond 2**24 samples.  ``click_metrics``
computes the same exact value on one process.

Memory of a ``MetricWindow`` while it accumulates: 5 bytes per sample (the float32
logit and a bool click flag; the loss sums are folded in at ``add``), against 8
before.  ``add`` never waits on the device.  Exact AUC needs one entry for each
distinct score, so a window kept for a whole run still grows with the run.  Scores
are float64 sigmoids of the float32 logits, computed at ``compute`` on the device
of the group's collectives (the CPU for gloo, as ``click_metrics`` on CPU tensors
does; the GPU for NCCL, whose float64 sigmoid may differ in the last bit, which
can only make or break a tie between two scores one ulp apart); with no group,
on the logits' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale.distributed import collective_device

_CANDIDATES = 256
"""Splitter candidates each rank offers (quantiles of its scores): the ranks' slices
differ from n/W by at most about 2n/_CANDIDATES rows."""


@dataclass
class ClickMetrics:
    loss: float
    auc: float
    ne: float
    samples: int


def click_metrics(logits: torch.Tensor, labels: torch.Tensor) -> ClickMetrics:
    """Metrics of one set of logits/labels (all the samples, on this process).

    AUC counts a label as a click when ``labels.long() == 1``, as torchmetrics does.
    """
    logits, labels = logits.detach().reshape(-1), labels.detach().reshape(-1)
    sums = _loss_sums(logits, labels)
    _, pos, neg, nans = _tally_samples(logits, _clicked(labels))
    u, p, n = _mann_whitney(pos, neg)
    return _finish(float(sums[0]), labels.numel(), float(sums[1]), float(u), float(p), float(n), int(nans))


class MetricWindow:
    """This rank's samples since the last reset; ``compute`` gives the metrics of every rank's.

    ``group`` is the process group to reduce over (default: the world).  With no
    process group initialised, or a group of one, it computes locally.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._logits: list[torch.Tensor] = []
        self._clicks: list[torch.Tensor] = []
        self._sums: torch.Tensor | None = None
        """float64 (BCE sum, label sum), on the device the logits come on."""
        self._count = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Fold one step in: the loss sums at once, the logits (float32) and click flags (bool) kept for AUC.

        No host synchronisation: everything stays on the logits' device.
        """
        logits, labels = logits.detach().reshape(-1), labels.detach().reshape(-1)
        sums = _loss_sums(logits, labels)
        self._sums = sums if self._sums is None else self._sums + sums.to(self._sums.device)
        self._count += labels.numel()
        self._logits.append(logits.float())
        self._clicks.append(_clicked(labels))

    def compute(self, reset: bool = True) -> ClickMetrics:
        """Metrics over every rank's window.  Collective: every rank of the group calls it at the same point.

        Collectives: an all-gather of 256 pairs of floats per rank, two ``all_to_all``
        (the row counts, then the score table: O(distinct scores) in all), an
        all-gather of 7 floats per rank.  Returns the same numbers on every rank.
        """
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1
        if distributed:
            device = collective_device(self._group)
        else:
            device = self._logits[0].device if self._logits else torch.device("cpu")
        if len(self._logits) > 1:  # one tensor each from now on: a later compute (reset=False) concatenates less
            self._logits, self._clicks = [torch.cat(self._logits)], [torch.cat(self._clicks)]
        logits = self._logits[0].to(device) if self._logits else torch.zeros(0, device=device)
        clicks = self._clicks[0].to(device) if self._clicks else torch.zeros(0, dtype=torch.bool, device=device)
        sums = self._sums.to(device) if self._sums is not None else torch.zeros(2, dtype=torch.float64, device=device)
        count = self._count
        if reset:
            self.reset()

        keys, pos, neg, nans = _tally_samples(logits, clicks)
        if distributed:
            keys, pos, neg = _redistribute(keys, pos, neg, self._group)
        u, p, n = _mann_whitney(pos, neg)
        stats = torch.stack([
            sums[0], torch.tensor(float(count), dtype=torch.float64, device=device), sums[1],
            u, p, n, nans.to(torch.float64),
        ])
        if not distributed:
            bce, total, label_sum, u_sum, p_sum, n_sum, nan_sum = stats.tolist()
            return _finish(bce, int(total), label_sum, u_sum, p_sum, n_sum, int(nan_sum))
        world = dist.get_world_size(self._group)
        parts = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(parts, stats, group=self._group)
        table = torch.stack(parts)  # (world, 7); row r: the loss sums of rank r, the AUC part of score slice r
        # Positives of slice r outrank every negative of the slices below it.
        negatives_below = torch.cumsum(table[:, 5], 0) - table[:, 5]
        u_total = table[:, 3].sum() + (table[:, 4] * negatives_below).sum()
        totals = table.sum(0)
        bce, total, label_sum, _, p_sum, n_sum, nan_sum = totals.tolist()
        return _finish(bce, int(total), label_sum, float(u_total), p_sum, n_sum, int(nan_sum))

    def reset(self) -> None:
        """Forget every sample added (local: no collective)."""
        self._logits.clear()
        self._clicks.clear()
        self._sums = None
        self._count = 0


def _clicked(labels: torch.Tensor) -> torch.Tensor:
    """The click flag AUC uses: ``labels.long() == 1`` (torchmetrics' binary target)."""
    return labels.long() == 1


def _loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 (sum of BCE with logits, sum of labels) of one batch."""
    x, y = logits.double(), labels.double()
    return torch.stack([F.binary_cross_entropy_with_logits(x, y, reduction="sum"), y.sum()])


def _tally_samples(
    logits: torch.Tensor, clicks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct float64 sigmoid scores (ascending) with their float64 positive and negative counts,
    and the number of NaN scores (left out of the table: any makes AUC NaN)."""
    scores = torch.sigmoid(logits.double())
    valid = ~torch.isnan(scores)
    nans = (~valid).sum()
    scores, flags = scores[valid], clicks[valid].to(torch.float64)
    return (*_tally(scores, flags, 1.0 - flags), nans)


def _tally(
    keys: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge rows with equal keys: (distinct keys ascending, summed pos, summed neg)."""
    keys, order = torch.sort(keys)
    distinct, inverse = torch.unique_consecutive(keys, return_inverse=True)
    merged_pos = torch.zeros(distinct.numel(), dtype=torch.float64, device=keys.device)
    merged_neg = torch.zeros_like(merged_pos)
    merged_pos.index_add_(0, inverse, pos[order])
    merged_neg.index_add_(0, inverse, neg[order])
    return distinct, merged_pos, merged_neg


def _mann_whitney(pos: torch.Tensor, neg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U, positives, negatives) of a table sorted by score: U counts each (positive, negative)
    pair where the positive scores higher as 1 and each tie as 1/2."""
    negatives_below = torch.cumsum(neg, 0) - neg
    u = (pos * (negatives_below + 0.5 * neg)).sum()
    return u, pos.sum(), neg.sum()


def _redistribute(
    keys: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample sort of the score tables: afterwards rank r holds the merged table of the r-th score
    range (ranges ascending with the rank), every score of the group in exactly one range."""
    world = dist.get_world_size(group)
    device = keys.device
    splitters = _splitters(keys, pos + neg, world, group)
    if splitters is None:  # no sample on any rank
        return keys, pos, neg
    # Rank r gets the keys k with splitters[r-1] < k <= splitters[r]: equal keys go to one rank.
    bounds = torch.searchsorted(keys, splitters, right=True)
    edges = torch.cat([bounds.new_zeros(1), bounds, bounds.new_full((1,), keys.numel())])
    send = torch.diff(edges)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    rows = torch.stack([keys, pos, neg], dim=1)
    recv_sizes = recv.tolist()
    received = torch.empty(sum(recv_sizes), 3, dtype=torch.float64, device=device)
    dist.all_to_all_single(received, rows, output_split_sizes=recv_sizes,
                           input_split_sizes=send.tolist(), group=group)
    return _tally(received[:, 0], received[:, 1], received[:, 2])


def _splitters(keys: torch.Tensor, counts: torch.Tensor, world: int,
               group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """world-1 ascending score splitters that cut the group's samples into near-equal shares
    (None when the group has no sample).  Each rank offers _CANDIDATES quantiles of its
    samples, each weighted by its share of them."""
    device = keys.device
    candidates = torch.zeros(_CANDIDATES, 2, dtype=torch.float64, device=device)
    if keys.numel():
        cumulative = torch.cumsum(counts, 0)
        total = cumulative[-1]
        targets = (torch.arange(_CANDIDATES, dtype=torch.float64, device=device) + 0.5) * (total / _CANDIDATES)
        at = torch.searchsorted(cumulative, targets).clamp_(max=keys.numel() - 1)
        candidates[:, 0] = keys[at]
        candidates[:, 1] = total / _CANDIDATES
    parts = [torch.empty_like(candidates) for _ in range(world)]
    dist.all_gather(parts, candidates, group=group)
    offered = torch.cat(parts)
    values, order = torch.sort(offered[:, 0])
    weight = torch.cumsum(offered[order, 1], 0)
    if float(weight[-1]) == 0.0:
        return None
    targets = torch.arange(1, world, dtype=torch.float64, device=device) * (weight[-1] / world)
    return values[torch.searchsorted(weight, targets).clamp_(max=values.numel() - 1)]


def _finish(bce: float, count: int, label_sum: float, u: float, positives: float, negatives: float,
            nans: int) -> ClickMetrics:
    if count == 0:
        return ClickMetrics(float("nan"), float("nan"), float("nan"), 0)
    loss = bce / count
    rate = label_sum / count
    if 0.0 < rate < 1.0:
        entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        ne = loss / entropy
        auc = u / (positives * negatives) if positives > 0 and negatives > 0 and nans == 0 else float("nan")
    else:
        ne, auc = float("nan"), float("nan")
    return ClickMetrics(loss=loss, auc=auc, ne=ne, samples=count)
