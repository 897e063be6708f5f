"""Checkpoint save and load: freescale's logical checkpoints beside plain DCP, and what a save costs a step.

Two ranks (gloo, CPU) shard a DLRM-sized set of tables (column-wise, so the row-wise Adagrad state
is in torchrec's plan-dependent layout) with fused row-wise Adagrad, plus a dense MLP under AdamW.
Each row is the slowest rank's time, on this machine's local disk:

- ``plain DCP save/load``: ``dcp.save``/``dcp.load`` of torchrec's own state dicts (the peer);
- ``freescale save/load``: ``reshard.to_logical`` + DCP (the row-wise state as fragments);
- ``freescale load, another plan``: the same checkpoint into a table-wise plan (the reshard-on-load);
- the steps around a save: median step time without one, the step with a synchronous save, the step
  that stages an asynchronous save copying the whole state at the step (``CheckpointWriter``), and the
  trainer's default: the save step copying only the dense state, the steps after it copying the
  tables within ``--budget`` of a step (copy-on-write, ``staging.py``), the step that finishes that
  copy; and the median step while each background save is written.

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


ZIPF: dict[str, torch.Tensor] = {}
"""With ``--ids zipf``: the cumulative distribution of row ranks, and where each rank's row sits."""


def ids(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` ids: uniform over the rows, or Zipf-distributed (exponent 1.05, hot rows scattered)."""
    if not ZIPF:
        return torch.randint(0, rows, (n,), generator=gen)
    ranks = torch.searchsorted(ZIPF["cdf"], torch.rand(n, generator=gen, dtype=torch.float64)).clamp_(max=rows - 1)
    return ZIPF["row_of_rank"][ranks]


def step(dmp: Any, optimizer: Any, rows: int, gen: torch.Generator) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.randint(1, 8, (TABLES * 512,), generator=gen)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(TABLES)], lengths=lengths,
                            values=ids(rows, int(lengths.sum()), gen))
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


def worker(rank: int, port: int, rows: int, root: str, out: str, budget: float, zipf: bool) -> None:
    import warnings

    warnings.simplefilter("ignore")  # ShardedTensor's deprecation warnings, once per call
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    if zipf:
        weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
        ZIPF["cdf"] = torch.cumsum(weights, 0) / weights.sum()
        ZIPF["row_of_rank"] = torch.randperm(rows, generator=torch.Generator().manual_seed(7))
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
    results.update(step_costs(dmp, optimizer, rows, gen, Path(root) / "steps", budget))
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def step_costs(dmp: Any, optimizer: Any, rows: int, gen: torch.Generator, root: Path,
               budget: float) -> dict[str, float]:
    """What a save costs the steps (each the slowest rank's): the median step without one; the step with a
    synchronous save; the step staging an asynchronous one whose whole state is copied at the step, and
    the median step while it is written; and the trainer's default (``lazy_cycle``, the median of 5).  The
    baseline step is the median of the 20 steps before and the 10 before each default save."""
    from freescale import checkpoint, reshard
    from freescale.staging import LazySaves, RowTracker

    lazy = LazySaves(RowTracker(dmp), budget)
    found: dict[str, float] = {}

    def one(save: Any = None) -> float:
        dist.barrier()
        start = time.perf_counter()
        step(dmp, optimizer, rows, gen)
        if save is not None:
            save()
        return slowest(time.perf_counter() - start)

    def logical(live: dict[str, Any], group: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        app, layouts = reshard.to_logical(live["model"], live["optim"], group)
        return app, {"layouts": layouts}

    def live() -> dict[str, Any]:
        return {"model": dmp.state_dict(), "optim": optimizer.state_dict()}

    def written(writer: Any) -> list[float]:
        during: list[float] = []
        while len(during) < 400:  # until every rank's files are written (the same number of steps everywhere)
            during.append(one())
            if slowest(float(writer.writing)) == 0:
                break
        writer.wait()
        return during

    found["making the host buffers (at the start, rank-local)"] = lazy.prepare(live())
    plain = [one() for _ in range(20)]
    for seconds in plain:
        lazy.boundary(0, seconds)  # the step times its pace follows
    found["step with a synchronous save"] = one(lambda: checkpoint.save(root / "sync", 1, *logical(live())))
    writer = checkpoint.CheckpointWriter(True, dist.new_group(backend="gloo"))
    found["step staging an asynchronous save (all at the step)"] = one(
        lambda: writer.start(root / "async", 1, live(), {}, convert=logical))
    found["step while it is written"] = statistics.median(written(writer))
    cycles = [lazy_cycle(one, lazy, writer, live, logical, written, root, 2 + i) for i in range(5)]
    before = [s for c in cycles for s in c.pop("before")]
    for key in cycles[0]:
        found[key] = statistics.median(c[key] for c in cycles)
    found["step"] = statistics.median(plain + before)
    return found


def lazy_cycle(one: Any, lazy: Any, writer: Any, live: Any, logical: Any, written: Any, root: Path,
               step: int) -> dict[str, Any]:
    """One save as the trainer makes it by default: 10 plain steps, the save step, the steps copying its
    tables, the step finishing the copy (and starting the write), the steps while it is written."""
    before = [one() for _ in range(10)]
    held: dict[str, Any] = {}

    def begin() -> None:
        agree = lambda steps: int(slowest(float(steps)))  # noqa: E731  the slowest rank's count, as the trainer
        t0 = time.perf_counter()
        state = live()
        held["live_s"] = time.perf_counter() - t0
        lazy.begin(state, 1, agree, reuse=not writer.writing)

    at_save = one(begin)
    copying, done, previous, due = [], 1, statistics.median(before), {}
    while True:  # each step, then its share of the copy (as the trainer: the step's boundary)
        done += 1
        seconds = one(lambda: due.update(now=lazy.boundary(done, previous)))  # noqa: B023
        if due["now"]:
            break
        copying.append(seconds)
        previous = seconds
    snapshot = lazy.take()
    assert snapshot is not None

    def finish() -> None:
        t0 = time.perf_counter()
        held["taken"] = snapshot.finish()
        writer.start(root / "lazy", step, snapshot.assemble, {}, convert=logical)
        held["finish_call_s"] = time.perf_counter() - t0

    finishing = one(finish)
    found = {"before": before, "step saving, tables copied after it (default)": at_save,
             "step while its tables are copied": statistics.median(copying) if copying else float("nan"),
             "step finishing the tables' copy (starts the write)": finishing,
             "step while that save is written": statistics.median(written(writer)),
             "steps while its tables are copied": float(len(copying)), "rows kept at a lookup": held["taken"]["rows_kept"]}
    taken, n = held["taken"], max(1, len(copying))
    # The training thread's own time in save work (timed around the calls; the slowest rank's): steadier
    # than differences of whole steps on a shared 2-core machine.
    found["save work in the save step"] = slowest(held["live_s"] + taken["at_step_s"])
    found["save work per copying step (copy)"] = slowest(taken["copy_s"] / n)
    found["save work per copying step (rows kept at lookups)"] = slowest(taken["keep_s"] / n)
    found["save work in the finishing step"] = slowest(held["finish_call_s"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--budget", type=float, default=0.05, help="checkpoint.stage_budget (default %(default)s)")
    parser.add_argument("--ids", choices=["uniform", "zipf"], default="uniform",
                        help="the ids each step looks up: uniform over the rows (every row as likely: the most rows "
                             "kept at lookups while a save copies) or Zipf (exponent 1.05, as interaction logs)")
    args = parser.parse_args()
    rows = 100_000 if args.quick else 2_000_000  # x 2 tables x 64 dims x 4 bytes: 0.1 / 1.0 GB of weights
    from tests.procs import free_port

    root = tempfile.mkdtemp(prefix="freescale-bench-ckpt-")
    try:
        out = Path(root) / "result.pt"
        mp.start_processes(worker, args=(free_port(), rows, root, str(out), args.budget, args.ids == "zipf"), nprocs=2,
                           start_method="spawn")
        r = torch.load(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = r["state_gb"]
    table = [{"what": k, "seconds": round(v, 3), "GB/s": round(gb / v, 2),
              "vs plain DCP": round(v / r["plain DCP save" if "save" in k else "plain DCP load"], 2)}
             for k, v in r.items() if k.startswith(("plain", "freescale"))]
    steps = [{"what": k, "seconds": round(v, 4), "vs a step": round(v / r["step"], 2)}
             for k, v in r.items() if k.startswith("step ")]
    from freescale.tables import print_table

    print(f"2 ranks, {gb:.2f} GB of table weights (+ optimizer state), local disk")
    print_table(table, ["what", "seconds", "GB/s", "vs plain DCP"])
    print_table(steps, ["what", "seconds", "vs a step"])
    print(f"the tables' copy took {int(r['steps while its tables are copied'])} steps at a budget of "
          f"{args.budget:.0%} of a step; {int(r['rows kept at a lookup'])} rows were kept at a lookup first")
    work = [{"what": k, "seconds": round(v, 5), "share of a step": round(v / r["step"], 3)}
            for k, v in r.items() if k.startswith("save work")]
    print_table(work, ["what", "seconds", "share of a step"])
    per_copying_step = (r["save work per copying step (copy)"] + r["save work per copying step (rows kept at lookups)"])
    targets = {"the save step": r["save work in the save step"], "a copying step": per_copying_step,
               "the finishing step": r["save work in the finishing step"]}
    for what, seconds in targets.items():
        share = seconds / r["step"]
        print(f"target: a save adds <= 10% to a step; {what}: +{share:.1%} of save work "
              f"({'met' if share <= 0.10 else 'NOT met'})")
    if args.json:
        write_json(args.json, "bench_checkpoint", {"quick": args.quick, "rows_per_table": rows, "tables": TABLES,
                                                   "dim": DIM, "ranks": 2, "stage_budget": args.budget,
                                                   "ids": args.ids},
                   table + steps + work + [{"raw": r}])


if __name__ == "__main__":
    main()
