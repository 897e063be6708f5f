"""A DeepFM written from scratch, made fault tolerant with the wrapper form: six lines of freescale.

The loop is a plain torchrec loop: an ``EmbeddingBagCollection`` of four tables
(one multi-hot feature), torchrec's own sharding planner, fused row-wise Adagrad
for the tables and Adam for the rest through ``CombinedOptimizer``, a warm-up LR
scheduler, plain ``dist.init_process_group``.  The lines that make it fault
tolerant across replica groups are marked ``# ft`` (6 of them):

1. ``import freescale.ft as ft``
2. ``ft.shard(...)`` instead of ``DistributedModelParallel(...)``: torchrec's planner
   and sharders, every table on a fused kernel (the planner would put small tables
   on ``data_parallel``) unless its constraint asks for ``data_parallel`` (here the
   20-row category table: whole on every rank, its gradient reduced with the dense
   ones, stepped by Adam with them), and no DDP around the dense part;
3. ``ft.StepSamples(...)``: which sample ids each group and rank trains each step,
   a dead group's share requeued (the loop maps ids to samples, ``features``);
4. ``ft.wrap(...)``: the optimizer, fault tolerant; it steps the scheduler;
5. ``optimizer.register_state(...)``: a counter of the loop's own travels in the
   snapshot a recovering group loads (as the scheduler, the RNGs and ``samples`` do),
   and advances with each committed step, also those a recovering group replays;
6. ``optimizer.steps(...)`` instead of ``range(...)``: the steps this group trains
   (catch-up, the finish, a job finished elsewhere happen inside).

Run it under the launcher (a lighthouse, one elastic agent per group, restarts)::

    freescale launch --replicas 2 --ranks-per-replica 2 --max-restarts 1 -- python examples/deepfm_ft.py --out runs/deepfm

and kill a rank for real (``freescale.testing``: rank 1 of group 1 SIGKILLs itself
as step 8's exchange begins; the group restarts and catches up from group 0)::

    FREESCALE_FAULTS=1:1:8:reduce:0 FREESCALE_FAULTS_DIR=runs/deepfm freescale launch ... -- python examples/deepfm_ft.py

With ``--on-rank-loss shrink`` instead of restarts, group 1 goes on at once on the rank it has left, holding both
ranks' tables, at a share in proportion (``StepSamples(per_rank=...)`` plans the same steps whatever the sizes).

Each group's rank 0 writes ``<out>/replica<g>.jsonl``, one line per step it trained:
the participants, the ids trained, the learning rate and a fingerprint of the group's
whole state (``freescale.digest.audit_digest``: equal across groups at every step, whatever
ranks each runs on; ``tests/test_examples.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed.planner import ParameterConstraints
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import freescale.ft as ft  # ft
from freescale.digest import audit_digest

USERS, ITEMS, CATEGORIES, TAGS, DIM = 1000, 500, 20, 50, 8
FEATURES = ("user", "item", "category", "tags")


class DeepFM(nn.Module):
    """Click logit: a bias, the factorization machine's pairwise term and an MLP, over four pooled fields."""

    def __init__(self) -> None:
        super().__init__()
        sizes = {"user": USERS, "item": ITEMS, "category": CATEGORIES, "tags": TAGS}
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"{name}_table", embedding_dim=DIM, num_embeddings=rows, feature_names=[name],
                               pooling=PoolingType.MEAN if name == "tags" else PoolingType.SUM)
            for name, rows in sizes.items()], device=torch.device("meta"))
        self.deep = nn.Sequential(nn.Linear(len(sizes) * DIM, 32), nn.ReLU(), nn.Linear(32, 1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        fields = torch.stack([pooled[name] for name in FEATURES], dim=1)  # [batch, fields, dim]
        pairwise = 0.5 * (fields.sum(1).pow(2) - fields.pow(2).sum(1)).sum(1)
        return self.bias + pairwise + self.deep(fields.flatten(1)).squeeze(1)


def features(ids: torch.Tensor) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Samples ``ids``: four fields (1 to 3 tags each) and a click label, each a fixed function of the id."""
    users, items = (ids * 7919) % USERS, (ids * 104729) % ITEMS
    tag_counts = 1 + ids % 3
    tags = torch.cat([(items[i] * 7 + 13 * torch.arange(int(n))) % TAGS for i, n in enumerate(tag_counts)]
                     or [torch.zeros(0, dtype=torch.int64)])
    ones = torch.ones(ids.numel(), dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(FEATURES), values=torch.cat([users, items, items % CATEGORIES, tags]),
        lengths=torch.cat([ones, ones, ones, tag_counts]))
    return kjt, ((users % 5) == (items % 5)).float()


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # every group starts from the same weights
    model = ft.shard(DeepFM(), torch.device("cpu"), fused_params={  # ft
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        constraints={"category_table": ParameterConstraints(sharding_types=["data_parallel"])})
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=1e-2))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    scheduler = torch.optim.lr_scheduler.LambdaLR(dense, lambda step: min(1.0, (step + 1) / 20))
    samples = ft.StepSamples(per_rank=args.batch)  # ft
    optimizer = ft.wrap(model, optimizer, data=samples, scheduler=scheduler)  # ft
    seen = {"samples": 0}  # a counter of the loop's own: samples trained by every group, per committed step

    def count(commit: ft.Commit) -> None:
        seen["samples"] += len(samples.last_trained)

    optimizer.register_state("seen", lambda: dict(seen), seen.update, on_commit=count)  # ft
    log = _log(args.out) if dist.get_rank() == 0 else None
    for step in optimizer.steps(args.steps):  # ft
        kjt, labels = features(samples.mine(step))
        optimizer.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(kjt), labels)
        loss.backward()
        commit = optimizer.step()
        digest = audit_digest(model, optimizer)  # the test's check (any group size), not fault tolerance: a collective
        if log is not None and commit is not None and commit.applied:  # (not applied: left behind, catching up)
            log.write(json.dumps({"step": commit.step, "participants": optimizer.record["participants"],
                                  "trained": samples.last_trained, "lr": scheduler.get_last_lr()[0],
                                  "scheduler": scheduler.state_dict()["last_epoch"], "seen": seen["samples"],
                                  "digest": digest}) + "\n")
            log.flush()
    if log is not None:
        log.write(json.dumps({"pending": samples.carry}) + "\n")
        log.close()
    dist.barrier()
    dist.destroy_process_group()


def _log(out: str):  # type: ignore[no-untyped-def]
    group = os.environ.get("FREESCALE_REPLICA_INDEX", "0")
    Path(out).mkdir(parents=True, exist_ok=True)
    return (Path(out) / f"replica{group}.jsonl").open("a")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--out", default="runs/deepfm")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
