"""Make your own torchrec training loop fault tolerant with ``freescale.ft.FaultTolerance``.

Your model, your optimizer, your data, your loop; freescale adds the quorum,
the sample-weighted all-reduce of dense gradients across replica groups, the
deferred union update of the fused embedding tables, the commit vote, the
requeue of a dead group's samples, and catch-up of a restarted group from a
live one, at four points of the loop (``train`` below).

    python examples/user_loop_ft.py --replicas 2 --ranks-per-replica 2 --steps 60 --out runs/user_loop

starts a lighthouse in this process and each replica group as its own
``torchrun`` job (``--max-restarts``: a group that loses a rank is restarted
and catches up while the others keep training).  Kill one for real::

    FREESCALE_FAULTS=1:1:20:reduce:0 python examples/user_loop_ft.py --replicas 2 --ranks-per-replica 2

(rank 1 of group 1 SIGKILLs itself as step 20's gradient exchange begins;
``freescale.testing``).  Each group's rank 0 writes ``<out>/replica<g>.jsonl``:
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
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from freescale.digest import state_digest
from freescale.distributed import DistConfig, init_distributed
from freescale.ft import Commit, FaultTolerance, FTConfig, JobFinished
from freescale.parallelize import NoDataParallel, dense_named_parameters
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


class SampleQueue:
    """Your data side, as ``FaultTolerance`` sees it (``freescale.ft.DataState``): which samples
    each group trains at each step, and the samples of groups that did not train a step requeued
    into the next one.  Every group plans a step the same way after the previous one committed."""

    def __init__(self, group: int, groups: int, ranks: int, rank: int, batch: int) -> None:
        self.group, self.ranks, self.rank, self.batch = group, ranks, rank, batch
        self.global_batch = batch * ranks * groups
        self.ready, self.carry = list(range(groups)), []  # type: ignore[var-annotated]
        self._plans: dict[int, dict[int, list[int]]] = {}
        self.last_trained: list[int] = []

    def plan(self, step: int) -> dict[int, list[int]]:
        """Group -> its samples of ``step`` (the step's own samples and the carried ones)."""
        if step not in self._plans:
            ids = self.carry + list(range(step * self.global_batch, (step + 1) * self.global_batch))
            self.carry = []
            self._plans[step] = {g: ids[i::len(self.ready)] for i, g in enumerate(self.ready)}
        return self._plans[step]

    def mine(self, step: int) -> torch.Tensor:
        """This rank's share of its group's samples."""
        return torch.tensor(self.plan(step).get(self.group, [])[self.rank::self.ranks], dtype=torch.int64)

    def weight(self, step: int) -> float:
        return float(len(self.plan(step).get(self.group, [])))

    def commit(self, commit: Commit) -> None:
        plan = self.plan(commit.step)
        del self._plans[commit.step]
        self.last_trained = sorted(i for g, ids in plan.items() if g in commit.trained for i in ids)
        self.carry = sorted(i for g, ids in plan.items() if g not in commit.trained for i in ids)
        self.ready = sorted(commit.ready)

    def state_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "carry": self.carry}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ready, self.carry, self._plans = list(state["ready"]), list(state["carry"]), {}


def train(args: argparse.Namespace) -> None:
    """One rank of one replica group (run by torchrun)."""
    # Like dist.init_process_group, plus a store prefix per torchrun restart: a restarted group's ranks
    # would otherwise read the dead attempt's addresses from the agent's store (torchrun reuses it).
    ctx = init_distributed(DistConfig(backend="gloo"))
    rank, ranks = ctx.rank, ctx.world_size
    cfg = FTConfig()
    cfg.resolve_env()  # lighthouse URL, replica count and this group's index, from the launcher
    torch.manual_seed(0)  # every group starts from the same weights
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                          "learning_rate": 0.05})
    # No DDP around the dense part: FaultTolerance reduces the dense gradients, in the group and across.
    dmp = DistributedModelParallel(TwoTower(), device=torch.device("cpu"), sharders=[sharder],  # type: ignore[list-item]
                                   data_parallel_wrapper=NoDataParallel())
    dense = KeyedOptimizerWrapper(dense_named_parameters(dmp), lambda ps: torch.optim.Adam(ps, lr=1e-2))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    data = SampleQueue(cfg.replica_index, cfg.replicas, ranks, rank, args.batch)
    out = Path(args.out)
    hooks = hooks_from_env(cfg.replica_index, rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                           out / cfg.replica_id)
    ft = FaultTolerance(dmp, optimizer, cfg, data=data, hooks=hooks)
    log = (out / f"{cfg.replica_id}.jsonl").open("a") if rank == 0 else None
    ft.start()
    step = 0
    while step < args.steps:
        ft.begin_step(step)                                   # 1. the quorum request
        if ft.can_train(step) and data.weight(step) > 0:
            kjt, labels = features(data.mine(step))
            logits = dmp(kjt)
            # sum over this rank's samples x ranks / group's samples: the in-group mean is the group's mean
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
            ft.backward(loss * ranks / data.weight(step), weight=data.weight(step))   # 2. backward + exchange
        try:
            commit = ft.step()                                # 3. vote, commit, update (or redo, or catch up)
        except JobFinished:                                   # the others finished the run meanwhile
            break
        if commit.applied:                                    # 4. valid state: log it
            digest = state_digest(dmp, optimizer)
            if log is not None:
                log.write(json.dumps({"step": commit.step, "participants": ft.record["participants"],
                                      "trained": data.last_trained, "digest": digest,
                                      "caught_up": commit.restored}) + "\n")
                log.flush()
        ft.events.clear()  # catch-up, staging, skipped steps: events for a log (this example keeps none)
        step = commit.step + 1
    ft.finish(args.steps - 1)
    if log is not None:
        log.write(json.dumps({"pending": data.carry}) + "\n")
        log.close()
    ft.close()
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
         "--batch", str(args.batch), "--out", args.out],
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
