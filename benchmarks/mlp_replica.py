"""A replica that trains a small MLP through ``freescale.ft.FaultTolerance``: tests and ``bench_ft``.

    python benchmarks/mlp_replica.py --lighthouse URL --replica-id a --steps 20 --out DIR
        [--batch 32] [--hidden 128] [--snapshots] [--wait-for 3]

    python benchmarks/mlp_replica.py --mode ddp --rank 0 --world-size 2 --master 127.0.0.1:PORT ...
        (the baseline: the same model under torch DDP over gloo, no fault tolerance;
         --mode allreduce: one flat gloo all-reduce after backward instead)

A user's own loop over a model that is not freescale's (no torchrec here):
each step asks for the quorum (overlapping the forward), trains this
replica's own data (seeded by step and replica, ``--batch`` samples) with the
weighted FTAR of each gradient bucket started during backward, commits, and
writes one JSON line to ``<out>/<replica>.jsonl``: step, quorum id,
participants, attempts, seconds and a SHA-256 of the parameters after the
update.  Replica ids ``a``, ``b``, ``c``, ... are groups 0, 1, 2, ...: faults
come from ``FREESCALE_FAULTS`` (``freescale.testing``; e.g. ``2:0:5:reduce:20``
SIGKILLs replica c 20 ms into step 5's exchange and writes the time to
``<out>/c/rank0.killed``).  ``--layers`` hidden layers of width ``--hidden``
over 256 inputs: the default (1 x 1024) has 264k parameters, ``--layers 2``
(``bench_ft``'s model) 1.31M.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

BOOT = {"process": time.time()}
"""When this process reached its first line, built its model and optimizer, and had its fault tolerance ready (the
restarted replica's start-up, in its first log line)."""
if os.environ.get("BENCH_CPUS"):  # bench_ft --own-core: this replica's CPUs, set before its imports
    os.sched_setaffinity(0, {int(c) for c in os.environ["BENCH_CPUS"].split(",")})

import torch  # noqa: E402

from freescale.ft import FaultTolerance, FTConfig
from freescale.testing import hooks_from_env


INPUTS = 256


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights
    widths = [INPUTS] + [hidden] * layers
    modules: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        modules += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules, torch.nn.Linear(widths[-1], 1))


def batch(step: int, replica: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's samples of ``step`` (deterministic across processes)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{step}:{replica}".encode()))
    x = torch.randn(size, INPUTS, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2]


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def group_of(replica_id: str) -> int:
    """``a`` -> 0, ``b`` -> 1, ...: the replica's group index (fault specs and the FT config use it)."""
    return ord(replica_id[0]) - ord("a")


def run_ddp(args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer, log: Any) -> None:
    """Baselines without fault tolerance over gloo: ``ddp`` torch DDP (buckets reduced during
    backward), ``allreduce`` one flat all-reduce of the gradients after backward."""
    import torch.distributed as dist

    host, _, port = args.master.rpartition(":")
    store = dist.TCPStore(host, int(port), args.world_size, is_master=args.rank == 0)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size)
    params = list(model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model) if args.mode == "ddp" else model
    for step in range(args.steps):
        x, y = batch(step, args.replica_id, args.batch)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if args.mode == "allreduce":  # one flat all-reduce after backward
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= args.world_size
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        optimizer.step()
        log.write(json.dumps({"step": step, "time": time.time(), "committed": time.time(),
                              "digest": digest(model)}) + "\n")
        log.flush()
    log.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--mode", choices=["ftar", "ddp", "allreduce"], default="ftar")
    parser.add_argument("--rank", type=int, default=0, help="ddp mode")
    parser.add_argument("--world-size", type=int, default=2, help="ddp mode")
    parser.add_argument("--master", default="127.0.0.1:29531", help="ddp mode: host:port of rank 0's store")
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--wait-for", type=int, default=0,
                        help="start step 0 only once the lighthouse sees this many healthy replicas (a late joiner "
                             "would have to catch up, which is not built yet)")
    parser.add_argument("--save-params", action="store_true", help="torch.save the final parameters to <out>/<replica>.pt")
    parser.add_argument("--snapshots", action="store_true", help="serve snapshots so a restarted peer can catch up")
    parser.add_argument("--first-bucket-kb", type=int, default=1024,
                        help="cap of the first gradient bucket reduced during backward (the others: 25 MiB)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
    parser.add_argument("--log-name", default="", help="the log's file name (default: the replica id)")
    parser.add_argument("--join", choices=["record", "wait"], default="record",
                        help="how a restarted replica joins ([ft] join): record the step in progress, or wait: the "
                             "others wait for its gradients in that step")
    parser.add_argument("--standby-lock", default="",
                        help="hold this lock while active; a second process with the same lock and --incarnation 1 is "
                             "a warm standby that takes over when the first dies (ft/standby.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    BOOT["imported"] = time.time()
    model = build_model(args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    BOOT["built"] = time.time()
    if args.mode in ("ddp", "allreduce"):
        run_ddp(args, model, optimizer, open(Path(args.out) / f"{args.replica_id}.jsonl", "a"))
        return
    run_ftar(args, model, optimizer)


def run_ftar(args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(args.incarnation)  # what torchrun would tell a restarted group
    group = group_of(args.replica_id)
    cfg = FTConfig(lighthouse=args.lighthouse, replicas=max(args.wait_for, group + 1), replica_index=group,
                   name=args.replica_id, timeout_s=args.timeout, snapshots=args.snapshots,
                   first_bucket_kb=args.first_bucket_kb, wait_for_replicas_s=60.0 if args.wait_for else 0.0,
                   standby_lock=args.standby_lock, join=args.join)
    hooks = hooks_from_env(group, 0, args.incarnation, Path(args.out) / args.replica_id)
    ft = FaultTolerance(model, optimizer, cfg, hooks=hooks)  # a standby waits in here for the active one to die
    if args.standby_lock:
        (Path(args.out) / f"{args.replica_id}.took_over").write_text(str(time.time()))
    log = open(Path(args.out) / f"{args.log_name or args.replica_id}.jsonl", "a")
    ft.start(wait_for=args.wait_for)
    BOOT["ready"] = time.time()
    step = 0
    while step < args.steps:
        step = ft.begin_step(step)  # a waiting join returns the quorum's step, its snapshot loaded
        loss = None
        if ft.can_train(step):
            x, y = batch(step, args.replica_id, args.batch)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if args.step_sleep:  # more "compute" (before backward: the gradient reduction stays at the step's end)
                time.sleep(args.step_sleep)
            ft.backward(loss, weight=args.batch)
        commit = ft.step()
        committed = time.time()
        events = {e["event"]: e for e in ft.events}
        ft.events.clear()
        if commit.applied:
            record = ft.record
            log.write(json.dumps({
                "step": commit.step, "time": time.time(), "committed": committed,
                "quorum_id": record["quorum_id"], "participants": record["participants"],
                "contributing": bool(record.get("contributing", True)),
                "attempts": record["attempts"], "seconds": record["exchange_s"],
                "quorum_wait_s": record["quorum_wait_s"], "reduce_s": record["reduce_s"],
                "prepare_s": record["prepare_s"], "vote_s": record["vote_s"], "failed_at": record["failed_at"],
                "digest": digest(model), "loss": float(loss.detach()) if loss is not None else float("nan"),
                "stage_s": events["stage"]["stage_s"] if "stage" in events else 0.0,
                **({"catch_up": events["catch_up"]["catch_up"], "boot": BOOT} if "catch_up" in events else {}),
            }) + "\n")
            log.flush()
        step = commit.step + 1
    log.close()
    ft.finish(args.steps - 1)
    if args.save_params:
        torch.save([p.detach() for p in model.parameters()], Path(args.out) / f"{args.replica_id}.pt")
    ft.close()
    sys.stdout.flush()
    os._exit(0)  # gloo groups of dead quorums may still hold threads: skip C++ teardown


if __name__ == "__main__":
    main()
