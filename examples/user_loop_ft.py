"""Make your own torchrec training loop fault tolerant with the explicit form, ``freescale.ft.FaultTolerance``.

Your model, your optimizer, your data, your loop; freescale adds the quorum,
the sample-weighted all-reduce of dense gradients across replica groups, the
deferred union update of the fused embedding tables, the commit vote, the
requeue of a dead group's samples (``ft.StepSamples``), and catch-up of a
restarted group from a live one, at four points of the loop (``train`` below).
``examples/deepfm_ft.py`` does the same with the wrapper form (``ft.wrap``) and
``freescale launch``; this one keeps the four calls visible and brings its own
launcher (a lighthouse and one ``torchrun`` per group).

    python examples/user_loop_ft.py --replicas 2 --ranks-per-replica 2 --steps 60 --out runs/user_loop

starts a lighthouse in this process and each replica group as its own
``torchrun`` job (``--max-restarts``: a group that loses a rank is restarted
and catches up while the others keep training).  Kill one for real::

    FREESCALE_FAULTS=1:1:20:reduce:0 python examples/user_loop_ft.py --replicas 2 --ranks-per-replica 2

(rank 1 of group 1 SIGKILLs itself as step 20's gradient exchange begins;
``freescale.testing``).  ``--join wait`` (``[ft] join``): the restarted group trains
the step in progress, its share planned in by the commit before, instead of
sitting it out.  Each group's rank 0 writes ``<out>/replica<g>.jsonl``:
one line per committed step with the participants, the samples trained and a
SHA-256 of the group's whole state (equal across groups at every step).

The model is a two-tower click model that is not one of freescale's: an
``EmbeddingBagCollection`` of a user and an item table, an MLP over the two
pooled embeddings.  Its data is synthetic: global step ``s`` holds samples
``s*B .. s*B+B-1`` (B = ``--batch`` x ranks x replicas), each one's features
a function of its id, split over the ranks of the groups that are ready.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import freescale.ft as ft
from freescale.digest import state_digest
from freescale.testing import hooks_from_env

USERS, ITEMS, DIM = 1000, 500, 16


class TwoTower(nn.Module):
    """Click probability from a user and an item embedding (pooled bags of one id each)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="user_table", embedding_dim=DIM, num_embeddings=USERS, feature_names=["user"]),
            EmbeddingBagConfig(name="item_table", embedding_dim=DIM, num_embeddings=ITEMS, feature_names=["item"]),
        ], device=torch.device("meta"))
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        return self.mlp(torch.cat([pooled["user"], pooled["item"]], dim=1)).squeeze(1)


def features(ids: torch.Tensor) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Samples ``ids``: user and item ids and a label, each a fixed function of the sample id."""
    users, items = (ids * 7919) % USERS, (ids * 104729) % ITEMS
    labels = ((users % 5) == (items % 5)).float()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.cat([users, items]),
                                              lengths=torch.ones(2 * ids.numel(), dtype=torch.int64))
    return kjt, labels


def train(args: argparse.Namespace) -> None:
    """One rank of one replica group (run by torchrun)."""
    ft.init_process_group("gloo")  # dist.init_process_group, safe across torchrun's restarts (its store is reused)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    cfg = ft.FTConfig.from_env(join=args.join)  # lighthouse URL, replica count and group index: the launcher's
    torch.manual_seed(0)  # every group starts from the same weights
    dmp = ft.shard(TwoTower(), torch.device("cpu"), fused_params={  # fused tables, no DDP: the layer reduces
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    data = ft.StepSamples(per_step=args.batch * ranks * cfg.replicas)  # a dead group's share requeued
    out = Path(args.out)
    hooks = hooks_from_env(cfg.replica_index, rank, ft.incarnation(),
                           out / cfg.replica_id)
    layer = ft.FaultTolerance(dmp, optimizer, cfg, data=data, hooks=hooks)
    log = (out / f"{cfg.replica_id}.jsonl").open("a") if rank == 0 else None
    layer.start()
    step = 0
    while step < args.steps:
        started = layer.begin_step(step)                      # 1. the quorum request (a waiting join: a later step)
        joined, step = started != step, started
        if layer.can_train(step):                             # not catching up (and planned in)
            kjt, labels = features(data.mine(step))
            logits = dmp(kjt)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)  # the mean over my samples
            layer.backward(loss)                              # 2. backward + exchange (weight, scale: from data)
        try:
            commit = layer.step()                             # 3. vote, commit, update (or redo, or catch up)
        except ft.JobFinished:                                # the others finished the run meanwhile
            break
        if commit.applied:                                    # 4. valid state: log it
            digest = state_digest(dmp, optimizer)
            if log is not None:
                log.write(json.dumps({"step": commit.step, "participants": layer.record["participants"],
                                      "trained": data.last_trained, "digest": digest, "weight": layer.record["weight"],
                                      "caught_up": commit.restored or joined}) + "\n")
                log.flush()
        step = commit.step + 1
    layer.finish(args.steps - 1)
    if log is not None:
        log.write(json.dumps({"pending": data.carry}) + "\n")
        log.close()
    layer.close()
    dist.barrier()
    dist.destroy_process_group()


def launch(args: argparse.Namespace) -> int:
    """A lighthouse here, and each replica group as its own torchrun job."""
    from freescale.ft.config import LIGHTHOUSE_ENV, REPLICA_INDEX_ENV, REPLICAS_ENV, RUN_ID_ENV
    from freescale.ft.lighthouse import Lighthouse, LighthouseConfig

    lighthouse = Lighthouse(LighthouseConfig(min_replicas=1, heartbeat_timeout_s=3.0))
    url = lighthouse.start_in_thread()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:16]
    groups = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks_per_replica),
         "--max-restarts", str(args.max_restarts), __file__, "--worker", "--steps", str(args.steps),
         "--batch", str(args.batch), "--out", args.out, "--join", args.join],
        env={**os.environ, LIGHTHOUSE_ENV: url, REPLICAS_ENV: str(args.replicas), REPLICA_INDEX_ENV: str(g),
             RUN_ID_ENV: run_id, "OMP_NUM_THREADS": "1"}) for g in range(args.replicas)]
    codes = [g.wait() for g in groups]
    lighthouse.stop_thread()
    return max(codes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ranks-per-replica", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--out", default="runs/user_loop")
    parser.add_argument("--join", choices=["record", "wait"], default="record",
                        help="[ft] join: how a restarted group joins (wait: it trains the step in progress)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
