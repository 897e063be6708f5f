"""One torchft replica training the MLP of ``mlp_replica.py``: the other side of ``bench_ft``.

    python benchmarks/torchft_replica.py --lighthouse http://127.0.0.1:PORT --replica-id a --steps 60 --out DIR
        [--wait-for 2] [--hidden 1024] [--layers 1] [--step-sleep 0.02]

Needs torchft (``torchft-nightly``), which is not a freescale dependency: bench_ft
prints how to install it.  Same model, same AdamW (lr 1e-3), same batches
(``batch(step, replica, size)``) and the same per-step SHA-256 digest as
mlp_replica; fault tolerance is torchft's own: a ``torchft.Manager`` (async
quorum overlapping the forward, ``min_replica_size=1``) over a reconfigurable
``torchft.ProcessGroupGloo`` with one rank per replica group, healing through
the Manager's default checkpoint transport (``HTTPTransport``).  The gradients
are averaged with one flat ``manager.allreduce`` per step, like mlp_replica's
``--mode ddp`` baseline, and the optimizer steps only when
``manager.should_commit()`` says so.

``step`` is this process's data step: it advances on every attempt, as a data
loader would in torchft's training loops, so a step that torchft discards
(``should_commit`` false) leaves a hole in the committed steps.  One JSON line
per attempt in ``<out>/<replica>.jsonl``: ``step``, ``time``, ``committed``
(time the commit decision's update was applied), ``should_commit`` (whether the step was
committed), ``manager_step`` (torchft's count of committed steps),
``participating`` (false while healing: a zero gradient), ``healed`` (this
attempt loaded a checkpoint from a peer), ``quorum_id``, ``participants``,
``digest``, ``loss``; on the healing attempt also ``heal_fetch_s`` (the
checkpoint fetch time torchft logs), ``heal_fetch_ended`` (when that log line came: its last byte), ``heal_load_s`` (its ``load_state_dict``) and ``heal_bytes`` (model + optimizer
state fetched).  ``FREESCALE_FAULTS=<group>:0:20:reduce:0`` (``freescale.testing``; replica
``a`` is group 0, ``b`` 1, ...) SIGKILLs the process from a timer started just before step 20's
all-reduce (the time goes to ``<out>/<replica>/rank0.killed``); ``...:20:forward`` kills it
before step 20's backward.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

BOOT = {"process": time.time()}
"""When this process reached its first line, imported torchft, built its model and optimizer, and had its manager
up (the restarted replica's start-up, in its first attempt's log line; ``mlp_replica.BOOT`` is freescale's)."""
if os.environ.get("BENCH_CPUS"):  # bench_ft --own-core: this replica's CPUs, set before its imports
    os.sched_setaffinity(0, {int(c) for c in os.environ["BENCH_CPUS"].split(",")})

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from freescale.testing import hooks_from_env
from mlp_replica import batch, build_model, digest, group_of


class _FetchTimes(logging.Handler):
    """Collects the checkpoint fetch times that torchft's HTTPTransport logs ("fetching checkpoint from URL took Xs")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []
        self.ended: list[float] = []  # when each fetch's last byte was in (the log record's time)

    def emit(self, record: logging.LogRecord) -> None:
        match = re.match(r"fetching checkpoint from .* took ([0-9.e-]+)s$", record.getMessage())
        if match:
            self.seconds.append(float(match.group(1)))
            self.ended.append(record.created)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True, help="torchft lighthouse address, http://host:port")
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--steps", type=int, default=20, help="committed steps to train")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds: collectives, commit, checkpoint fetch")
    parser.add_argument("--wait-for", type=int, default=0,
                        help="start step 0 only once this many replicas have their torchft manager up (ready files in "
                             "--out), so that the first quorum holds them all")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
    parser.add_argument("--sync-quorum", action="store_true",
                        help="use_async_quorum=False: the quorum (and a heal) before the forward, so a healed replica "
                             "contributes in the healing step itself (what torchft's LocalSGD/DiLoCo require)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)

    from torchft import Manager, ProcessGroupGloo

    BOOT["imported"] = time.time()

    fetch_times = _FetchTimes()
    transport_logger = logging.getLogger("torchft.checkpointing.http_transport")
    transport_logger.setLevel(logging.INFO)
    transport_logger.addHandler(fetch_times)
    transport_logger.propagate = False

    model = build_model(args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    BOOT["built"] = time.time()

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    load_times: list[float] = []

    def load_state_dict(sd: dict[str, Any]) -> None:
        start = time.perf_counter()
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])
        load_times.append(time.perf_counter() - start)

    timeout = timedelta(seconds=args.timeout)
    # The replica group's own store (one rank per group): the Manager publishes its server address there.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=1, use_async_quorum=not args.sync_quorum, replica_id=args.replica_id, lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1",
        timeout=timeout, quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30),
        init_sync=False,  # every replica builds the same weights (build_model seeds them)
    )
    BOOT["ready"] = time.time()
    if args.wait_for:
        (out / f"{args.replica_id}.ready").touch()
        deadline = time.monotonic() + 60
        while len(list(out.glob("*.ready"))) < args.wait_for and time.monotonic() < deadline:
            time.sleep(0.01)

    # Faults as for freescale's replicas (``FREESCALE_FAULTS``, ``freescale.testing``): same points, same syntax.
    hooks = hooks_from_env(group_of(args.replica_id), 0, 0, out / args.replica_id)

    params = list(model.parameters())
    log = open(out / f"{args.replica_id}.jsonl", "a")
    step = 0
    while manager.current_step() < args.steps:
        started = time.time()
        fetched_before = len(fetch_times.seconds)
        manager.start_quorum()  # async: the lighthouse round trip overlaps the forward
        optimizer.zero_grad()
        x, y = batch(step, args.replica_id, args.batch)
        loss = torch.nn.functional.mse_loss(model(x), y)
        hooks.at("forward", step)
        if args.step_sleep:  # more "compute" (before backward: the gradient reduction stays at the step's end)
            time.sleep(args.step_sleep)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        hooks.at("reduce", step)
        manager.allreduce(flat).wait()  # averaged over the participants; errors are recorded, not raised
        # A checkpoint fetched in this step's quorum (async: during the forward; sync: before it, where the
        # manager's healing flag is already cleared when the step goes on).
        healing = manager._healing or len(fetch_times.seconds) > fetched_before  # noqa: SLF001
        participating = manager.is_participating()
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        should_commit = manager.should_commit()  # loads the fetched checkpoint first when healing
        if should_commit:
            optimizer.step()
        committed = time.time()  # the step's update applied (freescale's replicas time the same point)
        heal: dict[str, Any] = {}
        if healing and fetch_times.seconds:
            heal = {"heal_fetch_s": fetch_times.seconds[-1], "heal_fetch_ended": fetch_times.ended[-1],
                    "heal_load_s": load_times[-1] if load_times else None,
                    "heal_bytes": sum(t.numel() * t.element_size() for t in _tensors(state_dict()))}
        log.write(json.dumps({
            "step": step, "time": time.time(), "committed": committed, "started": started,
            "should_commit": should_commit, "manager_step": manager.current_step(),
            "participating": participating, "healed": healing, "quorum_id": manager._quorum_id,  # noqa: SLF001
            "participants": manager.num_participants(), "digest": digest(model), "loss": float(loss.detach()),
            **heal, **({"boot": BOOT} if step == 0 else {}),
        }) + "\n")
        log.flush()
        step += 1
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)  # skip gloo / Rust runtime teardown


if __name__ == "__main__":
    main()
