"""Checkpoint save and load: freescale's logical checkpoints beside plain DCP, and what a save costs a step.

Two ranks (gloo, CPU) shard a DLRM-sized set of tables (column-wise, so the row-wise Adagrad state
is in torchrec's plan-dependent layout) with fused row-wise Adagrad, plus a dense MLP under AdamW.
Each row is the slowest rank's time, on this machine's local disk:

- ``plain DCP save/load``: ``dcp.save``/``dcp.load`` of torchrec's own state dicts (the peer);
- ``freescale save/load``: ``reshard.to_logical`` + DCP (the row-wise state as fragments);
- ``freescale load, another plan``: the same checkpoint into a table-wise plan (the reshard-on-load);
- the step that saves: median step time without a save, the step with a synchronous save, the step
  that stages an asynchronous save (``CheckpointWriter``), and the median step while it is written.

    python benchmarks/bench_checkpoint.py [--quick] [--json benchmarks/results/checkpoint_cpu.json]

``--quick``: about 60 MB of state; default: about 1.1 GB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write_json  # noqa: E402

TABLES = 2
DIM = 64


def build(rows: int, sharding: str) -> tuple[Any, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name=f"t{i}_table", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"])
                for i in range(TABLES)], device=torch.device("meta"))
            self.mlp = torch.nn.Sequential(torch.nn.Linear(TABLES * DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

        def forward(self, kjt: Any) -> torch.Tensor:
            pooled = self.ebc(kjt)
            return self.mlp(torch.cat([pooled[f"f{i}"] for i in range(TABLES)], dim=1)).pow(2).mean()

    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    constraints = {f"t{i}_table": ParameterConstraints(sharding_types=[sharding], compute_kernels=["fused"],
                                                       min_partition=DIM // 2) for i in range(TABLES)}
    world = dist.get_world_size()
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu",
                                                         local_world_size=world), constraints=constraints)
    model = Model()
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = {n: p for n, p in dmp.named_parameters() if "mlp" in n}
    optimizer = CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(dense, lambda p: torch.optim.AdamW(p))])
    return dmp, optimizer


def step(dmp: Any, optimizer: Any, rows: int, gen: torch.Generator) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.randint(1, 8, (TABLES * 512,), generator=gen)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(TABLES)], lengths=lengths,
                            values=torch.randint(0, rows, (int(lengths.sum()),), generator=gen))
    optimizer.zero_grad()
    dmp(kjt).backward()
    optimizer.step()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn: Any, repeats: int = 2) -> float:
    """The best of ``repeats`` runs (the first pays one-off costs: thread pools, file creation)."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, slowest(time.perf_counter() - start))
    return best


def worker(rank: int, port: int, rows: int, root: str, out: str) -> None:
    import warnings

    warnings.simplefilter("ignore")  # ShardedTensor's deprecation warnings, once per call
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from freescale import checkpoint, reshard

    dmp, optimizer = build(rows, "column_wise")
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        step(dmp, optimizer, rows, gen)
    plain, ours = Path(root) / "plain", Path(root) / "ours"
    results: dict[str, float] = {}

    def native() -> dict[str, Any]:
        return {"model": dmp.state_dict(), "optim": optimizer.state_dict()}

    state_bytes = sum(s.tensor.numel() * s.tensor.element_size() for v in dmp.state_dict().values()
                      if hasattr(v, "local_shards") for s in v.local_shards())
    total = torch.tensor([float(state_bytes)])
    dist.all_reduce(total)
    results["state_gb"] = float(total) / 1e9
    fresh = iter(range(100))  # each save into a new directory, as freescale's (a new step_N each time)
    results["plain DCP save"] = timed(lambda: dcp.save(native(), checkpoint_id=str(plain / str(next(fresh)))))
    saves = iter(range(1, 100))

    def save_ours() -> None:  # a new step each time (as in training): no replacing of an old one timed
        app, layouts = reshard.to_logical(dmp.state_dict(), optimizer.state_dict())
        checkpoint.save(ours, next(saves), app, {"layouts": layouts}, keep=3)

    results["freescale save"] = timed(save_ours)
    results["plain DCP load"] = timed(lambda: dcp.load(native(), checkpoint_id=str(plain / "0")))
    meta = checkpoint.read_meta(checkpoint.latest(ours))  # type: ignore[arg-type]

    def load_ours(target: Any, opt: Any) -> None:
        state = {"model": target.state_dict(), "optim": opt.state_dict()}
        reshard.load_logical(lambda app: checkpoint.load(checkpoint.latest(ours), app), state["model"], state["optim"],
                             meta["layouts"])
        target.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    results["freescale load"] = timed(lambda: load_ours(dmp, optimizer))
    other, other_opt = build(rows, "table_wise")
    results["freescale load, another plan"] = timed(lambda: load_ours(other, other_opt))
    del other, other_opt
    results.update(step_costs(dmp, optimizer, rows, gen, Path(root) / "steps"))
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def step_costs(dmp: Any, optimizer: Any, rows: int, gen: torch.Generator, root: Path) -> dict[str, float]:
    """Median step, the step with a synchronous save, the step staging an asynchronous one, and the median
    step while it is written in the background (each the slowest rank's)."""
    from freescale import checkpoint, reshard

    def state() -> tuple[dict[str, Any], dict[str, Any]]:
        app, layouts = reshard.to_logical(dmp.state_dict(), optimizer.state_dict())
        return app, {"layouts": layouts}

    def one(save: Any = None) -> float:
        dist.barrier()
        start = time.perf_counter()
        step(dmp, optimizer, rows, gen)
        if save is not None:
            save()
        return slowest(time.perf_counter() - start)

    plain = [one() for _ in range(8)]
    sync_step = one(lambda: checkpoint.save(root / "sync", 1, *state()))
    writer = checkpoint.CheckpointWriter(True, dist.new_group(backend="gloo"))
    async_step = one(lambda: writer.start(root / "async", 1, *state()))
    during = []
    while writer.poll() is None and len(during) < 200:
        during.append(one())
    writer.wait()
    return {"step": statistics.median(plain), "step with a synchronous save": sync_step,
            "step staging an asynchronous save": async_step,
            "step while it is written": statistics.median(during) if during else float("nan"),
            "steps while it is written": float(len(during))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = 100_000 if args.quick else 2_000_000  # x 2 tables x 64 dims x 4 bytes: 0.1 / 1.0 GB of weights
    from tests.procs import free_port

    root = tempfile.mkdtemp(prefix="freescale-bench-ckpt-")
    try:
        out = Path(root) / "result.pt"
        mp.start_processes(worker, args=(free_port(), rows, root, str(out)), nprocs=2, start_method="spawn")
        r = torch.load(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = r["state_gb"]
    table = [{"what": k, "seconds": round(v, 3), "GB/s": round(gb / v, 2),
              "vs plain DCP": round(v / r["plain DCP save" if "save" in k else "plain DCP load"], 2)}
             for k, v in r.items() if k.startswith(("plain", "freescale"))]
    steps = [{"what": k, "seconds": round(v, 4), "vs a step": round(v / r["step"], 2)}
             for k, v in r.items() if k.startswith("step") and k != "steps while it is written"]
    from freescale.tables import print_table

    print(f"2 ranks, {gb:.2f} GB of table weights (+ optimizer state), local disk")
    print_table(table, ["what", "seconds", "GB/s", "vs plain DCP"])
    print_table(steps, ["what", "seconds", "vs a step"])
    print(f"the background write took {int(r['steps while it is written'])} steps")
    if args.json:
        write_json(args.json, "bench_checkpoint", {"quick": args.quick, "rows_per_table": rows, "tables": TABLES,
                                                   "dim": DIM, "ranks": 2}, table + steps + [{"raw": r}])


if __name__ == "__main__":
    main()
