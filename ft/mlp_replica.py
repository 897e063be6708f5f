"""A replica that trains an MLP with the fault-tolerance core: demo, tests and ``bench_ft``.

    python -m freescale.ft.mlp_replica --lighthouse URL --replica-id a --steps 20 --out DIR
        [--batch 32] [--kill-at STEP:PHASE[:DELAY_MS]] [--hidden 128] [--snapshots]

    python -m freescale.ft.mlp_replica --mode ddp --rank 0 --world-size 2 --master 127.0.0.1:PORT ...
        (the baseline: the same model under torch DDP over gloo, no fault tolerance;
         --mode allreduce: one flat gloo all-reduce after backward instead)

Each step: quorum request (overlapping the forward), forward/backward on this
replica's own data (seeded by step and replica, ``--batch`` samples) with the
weighted FTAR of each gradient bucket started during backward, AdamW update, then one JSON line in
``<out>/<replica>.jsonl``: step, quorum id, participants, attempts, seconds and
a SHA-256 of the parameters after the update.  ``--kill-at 5:reduce:20`` makes
the process SIGKILL itself 20 ms after entering step 5's reduce (a real
signal, mid-collective; the time is written to ``<out>/<replica>.killed``);
``5:forward`` before step 5's backward.  ``--layers`` hidden layers of width
``--hidden`` over 256 inputs: the default (1 x 1024) has 264k parameters, ``--layers 2``
(``bench_ft``'s model) 1.31M.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from freescale.ft.catchup import SnapshotServer
from freescale.ft.client import LighthouseClient
from freescale.ft.ftar import ReplicaSync
from freescale.ft.overlap import OverlappedFTAR


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


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Everything a replica must copy to be identical: parameters and AdamW moments."""
    out = {f"param{i}": p.detach() for i, p in enumerate(model.parameters())}
    for i, s in optimizer.state_dict()["state"].items():
        out.update({f"optim{i}.{k}": v for k, v in s.items()})
    return out


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(tensors[f"param{i}"])
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("optim"):
            index, key = name[len("optim"):].split(".", 1)
            moments.setdefault(int(index), {})[key] = t
    optimizer.load_state_dict({"state": moments, "param_groups": optimizer.state_dict()["param_groups"]})


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def parse_kill_at(spec: str) -> tuple[int, str, float]:
    """``STEP:PHASE[:DELAY_MS]`` -> (step, phase, delay in seconds); ``""`` -> no kill."""
    if not spec:
        return -1, "", 0.0
    parts = spec.split(":")
    return int(parts[0]), parts[1], float(parts[2]) / 1000 if len(parts) > 2 else 0.0


def _die(args: argparse.Namespace) -> None:
    (Path(args.out) / f"{args.replica_id}.killed").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


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
    parser.add_argument("--kill-at", default="")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--wait-for", type=int, default=0,
                        help="start step 0 only once the lighthouse sees this many healthy replicas (a late joiner "
                             "would have to catch up, which is not built yet)")
    parser.add_argument("--save-params", action="store_true", help="torch.save the final parameters to <out>/<replica>.pt")
    parser.add_argument("--snapshots", action="store_true", help="serve snapshots so a restarted peer can catch up")
    parser.add_argument("--first-bucket-kb", type=int, default=1024,
                        help="cap of the first gradient bucket reduced during backward (the others: 25 MiB)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = open(Path(args.out) / f"{args.replica_id}.jsonl", "a")
    if args.mode in ("ddp", "allreduce"):
        run_ddp(args, model, optimizer, log)
        return
    client = LighthouseClient(args.lighthouse, args.replica_id, args.incarnation, request_timeout_s=60).start()
    server = SnapshotServer() if args.snapshots else None
    if server is not None:
        server.start()
    sync = ReplicaSync(client, timeout_s=args.timeout, snapshot_server=server)
    reduction = OverlappedFTAR(list(model.parameters()), first_bucket_bytes=args.first_bucket_kb * 1024)
    deadline = time.monotonic() + 60
    while args.wait_for and time.monotonic() < deadline:
        healthy = [g for g in client.status()["groups"].values() if g["healthy"]]
        if len(healthy) >= args.wait_for:
            break
        time.sleep(0.02)
    kill_step, kill_phase, kill_delay = parse_kill_at(args.kill_at)

    def apply(averaged: list[torch.Tensor]) -> None:
        for p, g_avg in zip(model.parameters(), averaged):
            p.grad = g_avg
        optimizer.step()

    step = 0
    while step < args.steps:
        sync.start_step(step)
        x, y = batch(step, args.replica_id, args.batch)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == kill_step and kill_phase == "forward":
            _die(args)
        if args.step_sleep:  # more "compute" (before backward: the gradient reduction stays at the step's end)
            time.sleep(args.step_sleep)
        reduction.begin(weight=args.batch)
        sync.begin_overlapped(step, reduction)
        loss.backward()
        if step == kill_step and kill_phase == "reduce":
            threading.Timer(kill_delay, _die, (args,)).start()
        result = sync.reduce_and_commit(step, [p.grad for p in model.parameters()], weight=args.batch,
                                        overlapped=reduction)
        committed = time.time()
        stage_s = 0.0
        if not result.recovering:
            apply(result.tensors)
        if result.stage_snapshot:
            stage_s = sync.stage(result.step, state(model, optimizer))
        caught_up = sync.poll_catch_up(lambda t: load(model, optimizer, t), lambda r: apply(r.tensors))
        if not sync.recovering:
            log.write(json.dumps({
                "step": result.step, "time": time.time(), "committed": committed, "quorum_id": result.quorum.quorum_id,
                "participants": list(result.quorum.replica_ids), "attempts": result.attempts,
                "seconds": result.seconds, "quorum_wait_s": result.quorum_wait_s, "reduce_s": result.reduce_s,
                "vote_s": result.vote_s, "digest": digest(model), "loss": float(loss.detach()),
                "stage_s": stage_s, **({"catch_up": sync.catch_up_log} if caught_up else {}),
            }) + "\n")
            log.flush()
        step = result.step + 1
    log.close()
    if args.save_params:
        torch.save([p.detach() for p in model.parameters()], Path(args.out) / f"{args.replica_id}.pt")
    client.close()
    sys.stdout.flush()
    os._exit(0)  # gloo groups of dead quorums may still hold threads: skip C++ teardown


if __name__ == "__main__":
    main()
