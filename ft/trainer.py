"""One rank of a fault-tolerant replica group: torchrec training with FTAR, union updates, catch-up.

``Trainer.fit`` runs this when ``ft.lighthouse`` is set (``freescale launch
--replicas R --nproc-per-node G`` sets it).  Topology: R replica groups, each
a torchrun job of G ranks sharding the embedding tables among themselves with
the same plan; rank ``r`` of group ``g`` is global data rank ``g*G + r`` and
replica-dimension position ``r``.

One step on rank ``r`` of group ``g``::

    sync.start_step(s)                quorum request; the round trip overlaps the forward
    batch = loader.next_batch()       this rank's share of global batch s, planned over the
                                      ranks of the groups that were *ready* at step s-1's commit
    dmp(batch).backward()             in-group: input/output all-to-alls; fused embedding updates
                                      deferred (``sparse_sync``): each TBE's output gradient is
                                      caught; each dense gradient bucket, once backward made it,
                                      is averaged in the group, then its weighted FTAR across
                                      groups at position r starts (``overlap``; weight = the
                                      group's samples), both overlapping the rest of backward
    sync.reduce_and_commit(...)       one quorum attempt across groups at position r: the rest
                                      of the FTAR, all-gather of every TBE's ids and gradients,
                                      commit vote; on a failure: redo with the survivors (the
                                      group means this rank still holds, reduced after backward)
    apply                             AdamW on the averaged dense grads; each TBE's fused update
                                      over the union of all replicas' lookups (same on all)
    account                           rows planned for groups that did not commit are requeued
                                      into step s+1; the next step is planned over the groups
                                      that are ready now

A group restarted by torchrun (new incarnation = ``TORCHELASTIC_RESTART_COUNT``)
finds the quorum ahead, sits the steps out with weight 0 while each of its
ranks fetches its position's snapshot from a peer group (parameters, both
optimizers' state, embedding shards with their row-wise Adagrad state, the
loader's position and carry), and records every committed step's averages and
unions.  When *all* its ranks have their snapshot (an in-group all-reduce,
so the group turns ready at one step), each loads it and replays the recorded
steps (dense update, union update, data accounting), and the group is
bit-identical to the others.

A lost group recovers from its peers, never from a checkpoint.  Checkpoints
(``[checkpoint] every``, ``save_final``) are for losing every group at once:
the ready group with the lowest index writes them (all hold the same state),
and a new job with ``checkpoint.resume`` starts every group from the latest.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist

from freescale import checkpoint
from freescale.dataloader.loader import build_loader
from freescale.dataloader.schema import DatasetManifest
from freescale.digest import local_tensors, state_digest
from freescale.distributed import DistContext
from freescale.ft.catchup import SnapshotServer
from freescale.ft.client import JobFinished, LighthouseClient
from freescale.ft.config import RUN_ID_ENV, TOKEN_ENV, replica_index_of
from freescale.ft.ftar import ReplicaSync, StepResult
from freescale.ft.overlap import OverlappedFTAR
from freescale.ft.sparse_sync import UnionSparseUpdate
from freescale.metrics import MetricWindow
from freescale.models import build_model, cost_model_for
from freescale.parallelize import build_optimizer, dense_named_parameters, materialize_optimizer_state, shard_model

FAULT_ENV = "FREESCALE_FT_FAULT"
"""Tests and demos: comma-separated ``<replica index>:<rank>:<step>:<phase>[:<delay ms>][@<incarnation>]``;
each SIGKILLs that rank (a real signal) in that incarnation of its group (default 0) at:
``forward`` (the first step at or after ``step`` it trains in, before backward), ``reduce``
(``delay`` ms into step ``step``'s exchange), ``catchup`` (the first step at or after ``step``
that the group sits out while catching up, its snapshot download under way) or ``serve`` (while
this rank's snapshot server streams a snapshot of step ``step`` or later to a recovering peer:
the source dies mid-transfer).
``slow`` is no fault: from ``step`` on, each step of every incarnation sleeps ``delay`` ms after
backward (longer "compute", so survivors are still training when a restarted group is back).
``*`` as replica index or rank matches every one."""


@dataclass
class _Planned:
    live_ranks: tuple[int, ...]
    rows: tuple[np.ndarray, ...]


def _named_tensors(value: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor in a (nested) state dict, by path; sharded tensors as their local shards."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _named_tensors(value[key], f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _named_tensors(item, f"{prefix}/{i}")
    elif isinstance(value, torch.Tensor):
        for i, t in enumerate(local_tensors(value)):
            yield f"{prefix}#{i}", t


class ReplicaRank:
    """State and step of one rank of one replica group (see the module docstring)."""

    def __init__(self, cfg: Any, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        ft = cfg.ft
        self.group_size, self.group_index = ctx.world_size, ft.replica_index
        self.incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.out_dir = Path(cfg.train.output_dir) / ft.replica_id
        self.out_dir.mkdir(parents=True, exist_ok=True)
        token = os.environ.get(TOKEN_ENV, "")
        manifest = DatasetManifest.read(cfg.data.path)
        torch.manual_seed(cfg.train.seed)  # every group builds the same initial model
        model = build_model(cfg.model, manifest, max_seq_len=cfg.data.max_seq_len,
                            embedding_device=torch.device("meta"))
        # No DDP: the dense gradients are reduced in group and across groups bucket by bucket during
        # backward (``freescale.ft.overlap``), on a group of their own (never queued behind torchrec's
        # all-to-alls on the default group).
        self.dmp = shard_model(model, ctx, cfg.optim, data_parallel=False)
        self.optimizer = build_optimizer(self.dmp, cfg.optim)
        self.dense_optimizer = self.optimizer.optimizers[1][1]
        self.dense = list(dense_named_parameters(self.dmp).values())
        in_group = dist.new_group() if self.group_size > 1 else None
        if in_group is not None:
            with torch.no_grad():
                for p in self.dense:  # the same initial weights on every rank, as DDP would broadcast
                    dist.broadcast(p.data, src=0, group=in_group)
        self.reduction = OverlappedFTAR(self.dense, in_group=in_group, in_group_size=self.group_size,
                                        first_bucket_bytes=ft.first_bucket_kb * 1024,
                                        bucket_bytes=ft.bucket_kb * 1024)
        self.sparse = UnionSparseUpdate(self.dmp)
        self.loader = build_loader(
            cfg.data, "train", rank=self.group_index * self.group_size + ctx.rank,
            world_size=ft.replicas * self.group_size, sparse_features=list(model.sparse_feature_names),
            derived_cost=cost_model_for(cfg.model, manifest.dense_dim), seed=cfg.train.seed, training=True,
        )
        self.live: set[int] = set(range(ft.replicas))
        """Groups the next step's data is planned over: those ready at the last commit."""
        self._faults = self._parse_faults()
        self.server = SnapshotServer(token=token) if ft.snapshots else None
        if self.server is not None:
            if any(phase == "serve" for _, phase, _ in self._faults):
                self.server.on_stream = lambda step: self._die() if self._fault_at(step, "serve") is not None else None
            self.server.start()
        self.client = LighthouseClient(ft.lighthouse, ft.replica_id, self.incarnation, member=ctx.rank,
                                       group_size=self.group_size, token=token,
                                       run_id=os.environ.get(RUN_ID_ENV, "")).start()
        self.sync = ReplicaSync(self.client, position=ctx.rank, timeout_s=ft.timeout_s,
                                snapshot_server=self.server, token=token,
                                agree=self._agree if self.group_size > 1 else None,
                                backend=ft.replica_backend, device=ctx.device)
        self.log: TextIO = (self.out_dir / f"rank{ctx.rank}.jsonl").open("a")
        self.window = MetricWindow()
        self.finished_elsewhere = False
        self._write(event="start", pid=os.getpid(), incarnation=self.incarnation, time=time.time())
        # ``kill -USR1 <pid>`` prints every thread's stack to the rank's output (a hung collective, say).
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    # ------------------------------------------------------------------ data accounting
    def _ranks(self, groups: Iterable[int]) -> list[int]:
        return [g * self.group_size + r for g in sorted(groups) for r in range(self.group_size)]

    def _account(self, result: StepResult, planned: _Planned) -> list[np.ndarray]:
        """Requeue the rows of groups that did not commit this step; plan the next over the ready ones.

        Returns the rows the step trained (every group's, as all groups see them alike)."""
        trained = {replica_index_of(rid) for rid, w in result.weights.items() if w > 0}
        done = [rows for rank, rows in zip(planned.live_ranks, planned.rows) if rank // self.group_size in trained]
        lost = [rows for rank, rows in zip(planned.live_ranks, planned.rows) if rank // self.group_size not in trained]
        if lost:
            self.loader.requeue(np.concatenate(lost))
        self.live = {replica_index_of(rid) for rid in result.ready}
        return done

    # ------------------------------------------------------------------ updates
    def _apply(self, result: StepResult) -> None:
        """The committed step's update: AdamW on the averaged dense grads, then the union sparse update."""
        if sum(result.weights.values()) <= 0:
            return  # nobody trained this step (all catching up or not planned in): no update at all
        for p, averaged in zip(self.dense, result.tensors):
            p.grad = averaged if averaged.device == p.device else averaged.to(p.device)  # a replayed step
        self.dense_optimizer.step()
        for p in self.dense:
            p.grad = None
        self.sparse.apply(result.extra)

    def _replay(self, result: StepResult) -> None:
        planned = self.loader.skip_step(self._ranks(self.live))
        self._apply(result)
        self._account(result, _Planned(planned.live_ranks, tuple(planned.rows)))

    # ------------------------------------------------------------------ snapshots
    def _state(self) -> dict[str, Any]:
        return {"model": self.dmp.state_dict(), "optim": self.optimizer.state_dict()}

    def snapshot(self) -> dict[str, torch.Tensor]:
        tensors = dict(_named_tensors(self._state(), ""))
        meta = json.dumps({"loader": self.loader.state_dict(), "live": sorted(self.live)}).encode()
        tensors["meta.json"] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        return tensors

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        materialize_optimizer_state(self.optimizer)
        mine = dict(_named_tensors(self._state(), ""))
        missing = sorted(set(mine) - set(tensors))
        if missing:
            raise RuntimeError(f"catch-up: the snapshot lacks {missing[:3]} (a different model or sharding plan?)")
        with torch.no_grad():
            for name, t in mine.items():
                if t.shape != tensors[name].shape:
                    raise RuntimeError(f"catch-up: '{name}' is {tuple(tensors[name].shape)} in the snapshot, "
                                       f"{tuple(t.shape)} here")
                t.copy_(tensors[name])
        meta = json.loads(bytes(tensors["meta.json"].numpy()).decode())
        self.loader.load_state_dict(meta["loader"])
        self.live = set(meta["live"])

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_root(self) -> Path:
        c = self.cfg.checkpoint
        return Path(c.dir) if c.dir else Path(self.cfg.train.output_dir) / "checkpoints"

    def resume(self) -> int:
        """With ``checkpoint.resume``, when the run has no progress yet (a new job after every group
        was lost): load the latest complete checkpoint (all groups write to, and read from, the same
        directory); returns the step to start at.  A group restarted while others train skips it: it
        catches up from them.  Every rank of the group decides alike (in-group agreement)."""
        if not self.cfg.checkpoint.resume:
            return 0
        path = checkpoint.latest(self.checkpoint_root)
        fresh = int(self.client.status().get("high_step", -1)) < 0
        if self.group_size > 1:
            fresh = self._agree(fresh)
        if path is None or not fresh:
            self._write(event="no_resume", checkpoint=str(path) if path else None, fresh_run=fresh, time=time.time())
            return 0
        materialize_optimizer_state(self.optimizer)
        state = self._state()
        meta = checkpoint.load(path, state)
        saved = meta.get("ft") or {}
        if saved.get("replicas") != self.cfg.ft.replicas or meta.get("world_size") != self.group_size:
            raise checkpoint.CheckpointError(
                f"{path}: saved by {saved.get('replicas')} replica groups of {meta.get('world_size')} ranks; this "
                f"run has {self.cfg.ft.replicas} of {self.group_size} (the data plan would differ)")
        self.dmp.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.loader.load_state_dict(meta["data"])
        self.live = set(saved["live"])
        step = int(meta["step"])
        if self.group_size > 1:  # every rank of the group read the same checkpoint
            steps = torch.tensor([step, -step], dtype=torch.int64, device=self.ctx.device)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
            if int(steps[0]) != -int(steps[1]):
                raise checkpoint.CheckpointError(f"{self.checkpoint_root}: the group's ranks found different latest "
                                                 "checkpoints (one being written while this job started?)")
        self._write(event="resume", step=step, path=str(path), time=time.time())
        return step

    def _maybe_save(self, result: StepResult, done: int, steps: int) -> None:
        """After committed step ``done - 1``: every ``checkpoint.every`` steps (and at the end with
        ``save_final``) the ready group with the lowest index saves (all groups hold the same state,
        so one writes; every group computes the same choice from the step's ready set)."""
        c = self.cfg.checkpoint
        if not ((c.every and done % c.every == 0) or (c.save_final and done == steps)):
            return
        mine = min(replica_index_of(r) for r in result.ready) == self.group_index
        if self.group_size > 1:
            mine = self._agree(mine)
        if not mine:
            return
        start = time.perf_counter()
        meta = {"data": self.loader.state_dict(), "world_size": self.group_size,
                "ft": {"replicas": self.cfg.ft.replicas, "live": sorted(self.live)}}
        path = checkpoint.save(self.checkpoint_root, done, self._state(), meta, keep=c.keep)
        self._write(event="checkpoint", step=done, path=str(path), seconds=time.perf_counter() - start,
                    time=time.time())

    # ------------------------------------------------------------------ faults (tests)
    def _parse_faults(self) -> list[tuple[int, str, float]]:
        faults = []
        for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
            where, _, incarnation = spec.partition("@")
            parts = where.split(":")
            group = self.group_index if parts[0] == "*" else int(parts[0])
            rank = self.ctx.rank if parts[1] == "*" else int(parts[1])
            wanted = self.incarnation if parts[3] == "slow" and not incarnation else int(incarnation or 0)
            if (group, rank, wanted) == (self.group_index, self.ctx.rank, self.incarnation):
                faults.append((int(parts[2]), parts[3], float(parts[4]) / 1000 if len(parts) > 4 else 0.0))
        return faults

    def _fault_at(self, step: int, phase: str) -> float | None:
        for at, kind, delay in self._faults:
            if kind == phase and (step == at or (phase in ("forward", "catchup", "slow", "serve") and step >= at)):
                return delay
        return None

    def _die(self) -> None:
        (self.out_dir / f"rank{self.ctx.rank}.killed").write_text(repr(time.time()))
        self.log.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ the loop
    def warm_up(self) -> None:
        """One forward and backward, nothing updated, before the first quorum: torchrec's lazy
        set-up, the first kernels and the loader's first read are paid here, not in the first
        step the other groups wait for (a restarted group's first contributing step stalled them
        ~180 ms).  The batch is the loader's next one, and the loader is put back where it was.
        Every rank of the group runs it (the forward's all-to-alls)."""
        start = time.perf_counter()
        position = self.loader.state_dict()
        batch = self.loader.next_batch()  # from the real loader, so that its reader is warm too
        self.loader.load_state_dict(position)  # ... and back to where it was: nothing consumed
        batch.loss_scale = 0.0
        loss, _ = self.dmp(batch.to(self.ctx.device))
        loss.backward()  # the embedding updates are deferred (``sparse_sync``): only caught, then dropped
        for p in self.dense:
            p.grad = None
        self.sparse.reset()
        self._write(event="warm_up", seconds=time.perf_counter() - start, time=time.time())

    def wait_for_peers(self) -> None:
        deadline = time.monotonic() + self.cfg.ft.wait_for_replicas_s
        while time.monotonic() < deadline:
            groups = self.client.status()["groups"]
            if sum(1 for g in groups.values() if g["healthy"]) >= self.cfg.ft.replicas:
                return
            time.sleep(0.05)

    def run(self, steps: int, start_step: int = 0) -> dict[str, Any]:
        ft, device = self.cfg.ft, self.ctx.device
        step, committed_steps, contributed = start_step, 0, 0
        start = time.perf_counter()
        while step < steps:
            self.sync.start_step(step)
            self.sparse.reset()
            contributing = (not self.sync.recovering and self.group_index in self.live
                            and not (step == start_step and self.sync.behind(step)))
            planned: _Planned | None = None
            weight, loss_value, batch_wait, compute_s = 0.0, float("nan"), 0.0, 0.0
            if contributing:
                self.loader.set_live_ranks(self._ranks(self.live))
                t_batch = time.perf_counter()
                batch = self.loader.next_batch()
                batch_wait = time.perf_counter() - t_batch
                info = self.loader.last
                assert info is not None
                planned = _Planned(info.live_ranks, info.plan_rows)
                weight = float(sum(size for rank, size in zip(info.live_ranks, info.rank_sizes)
                                   if rank // self.group_size == self.group_index))
                # The in-group stage's mean over ranks = the mean over the group's samples.
                batch.loss_scale = self.group_size / max(weight, 1.0)
                t_compute = time.perf_counter()
                loss, (_, logits, labels) = self.dmp(batch.to(device))
                if self._fault_at(step, "forward") is not None:
                    self._die()
                self.reduction.begin(weight, self.sparse.header())
                if ft.overlap_backward:
                    self.sync.begin_overlapped(step, self.reduction)
                loss.backward()
                compute_s = time.perf_counter() - t_compute
                loss_value = float(loss.detach())
                self.window.add(logits.detach(), labels)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.dense]
                pause = self._fault_at(step, "slow")
                if pause:
                    time.sleep(pause)
            else:
                grads = [torch.zeros_like(p) for p in self.dense]
            delay = self._fault_at(step, "reduce")
            if delay is not None:
                threading.Timer(delay, self._die).start()
            try:
                result = self.sync.reduce_and_commit(step, grads, weight, exchange=self.sparse,
                                                     overlapped=self.reduction)
            except JobFinished as done:
                self._write(event="finished_elsewhere", step=step, finished_step=done.step,
                            recovering=self.sync.recovering, time=time.time())
                self.finished_elsewhere = True
                break
            if result.recovering and self._fault_at(result.step, "catchup") is not None:
                self._die()
            event: dict[str, Any] = {}
            if not result.recovering:
                if planned is None:  # ready but not planned in: same position and plan as the others
                    skipped = self.loader.skip_step(self._ranks(self.live))
                    planned = _Planned(skipped.live_ranks, tuple(skipped.rows))
                self._apply(result)
                trained_rows = self._account(result, planned)
                committed_steps += 1
                contributed += int(contributing)
                if ft.log_rows and self.ctx.rank == 0:
                    event["rows"] = np.concatenate(trained_rows).tolist() if trained_rows else []
            if self.sync.recovering and self._group_has_snapshot():
                self.sync.poll_catch_up(self.load, self._replay, wait=True)
                event["catch_up"] = self.sync.catch_up_log
            if not self.sync.recovering:
                if ft.digest_every and (result.step + 1) % ft.digest_every == 0:
                    event["digest"] = state_digest(self.dmp, self.optimizer)
                # Logged before staging: a peer's download may begin the moment the snapshot is staged.
                self._write(step=result.step, quorum_id=result.quorum.quorum_id,
                            participants=list(result.quorum.replica_ids), attempts=result.attempts,
                            contributing=contributing, weight=weight, loss=loss_value, seconds=result.seconds,
                            quorum_wait_s=result.quorum_wait_s, reduce_s=result.reduce_s, vote_s=result.vote_s,
                            batch_wait_s=batch_wait, compute_s=compute_s,
                            ready=sorted(result.ready), time=time.time(), **event)
            if not self.sync.recovering:
                self._maybe_save(result, result.step + 1, steps)
            if not self.sync.recovering and self.group_index in self.live:
                # The next step's batch is read while this rank stages, votes and waits (the producer
                # restarts whenever the live set changes or a catch-up moved the position).
                self.loader.set_live_ranks(self._ranks(self.live))
                self.loader.start_producing()
            if result.stage_snapshot:
                self._write(event="stage", step=result.step, stage_s=self.sync.stage(result.step, self.snapshot()),
                            time=time.time())
            step = result.step + 1
        if not self.finished_elsewhere:
            self.client.finish(steps - 1)
        return {"seconds": time.perf_counter() - start, "committed_steps": committed_steps,
                "contributed_steps": contributed, "pending_rows": self.loader.state_dict().get("carry", [])}

    def _agree(self, ok: bool) -> bool:
        """True only if every rank of this group got True (an in-group all-reduce, MIN)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _group_has_snapshot(self) -> bool:
        """Every rank of this group has its snapshot (so the group turns ready at one step)."""
        flag = torch.tensor([1 if self.sync.snapshot_arrived else 0], dtype=torch.int32, device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _write(self, **fields: Any) -> None:
        self.log.write(json.dumps(fields) + "\n")
        self.log.flush()

    def close(self) -> None:
        self.loader.close()
        self.log.close()
        self.client.close()
        if self.server is not None:
            self.server.stop()
