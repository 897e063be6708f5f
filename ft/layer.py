"""``FaultTolerance``: fault tolerance as a layer over any training loop, freescale's or a user's own.

One object per rank of a replica group.  A loop calls it at four points (the
step engine, ``freescale.step_engine``, does the same through its pipelines, calling ``exchange``
where this loop calls ``step``)::

    ft = FaultTolerance(dmp, optimizer, FTConfig.from_env(), data=accounting)
    ft.start()                                    # wait for the peers; joins late as a recovering group
    step = 0
    while step < steps:
        step = ft.begin_step(step)                # quorum request (overlaps the forward); the step to train
        if ft.can_train(step):                    # not catching up (and, with ``data``, planned in)
            loss = dmp(batch)                     # forward: the fused embedding updates are deferred
            ft.backward(loss, weight=len(batch))  # dense buckets reduced in the group, then across
                                                  # groups (weighted FTAR), while backward runs
        commit = ft.step()                        # rest of the exchange, the embedding rows' union,
                                                  # the vote; redo with the survivors on a failure;
                                                  # once committed: AdamW on the averages and the
                                                  # union update of the tables (same on every group)
        step = commit.step + 1                    # a recovering group adopts the quorum's step
    ft.finish(steps - 1); ft.close()

``step`` returns the step's ``Commit``; freescale's engine calls ``exchange`` instead, the same
work returning the whole ``SyncResult`` (``freescale.step_types``: the commit, the data side's
account, the step's log fields and events).

A restarted group finds the quorum ahead, sits the steps out with weight 0,
records every committed step while each rank downloads a peer's snapshot
(parameters, both optimizers' state, embedding shards, and ``data``'s state),
then loads it and replays the recorded steps: bit-identical to the others,
without stopping them (``freescale.ft.catchup``; the snapshot side of this
class: ``freescale.ft.layer_snapshot``).  ``data`` (optional; a
``DataState``: the engine passes its ``StepFeed``) is told every committed step
(``commit``) so a dead group's rows are requeued, and travels in the snapshot.

Requirements on the model: torchrec ``DistributedModelParallel`` sharded
*without* DDP around the dense part (``data_parallel_wrapper=NoDataParallel()``:
this layer reduces the dense gradients) with each table either on a fused
kernel (kept identical by the union update, or averaged across groups a slice
per step with ``[ft] embedding_sync = "average"``) or ``data_parallel`` (whole
on every rank: its dense gradient is reduced with the other dense ones, and the
dense optimizer steps it); or any ``nn.Module`` with only dense parameters.
Which of these applies is one strategy object, chosen at construction
(``freescale.ft.embedding_sync``).
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from freescale import rank_console
from freescale.dense_update import DenseUpdate, LRSchedule
from freescale.distributed import collective_device
from freescale.ft import embedding_sync
from freescale.ft.agent_process import start_agent
from freescale.ft.catchup import SnapshotServer
from freescale.ft.client import LighthouseClient
from freescale.ft.config import RUN_ID_ENV, TOKEN_ENV, FTConfig, incarnation, replica_index_of, skip_step_refusal
from freescale.ft.ftar import ReplicaSync
from freescale.ft.layer_snapshot import SnapshotSide, UserState, step_window
from freescale.ft.reduced_parts import reduced_parts
from freescale.ft.replica_group import positions_served
from freescale.ft.serving import advertised_host
from freescale.ft.standby import STANDBY_ENV, hand_back, take_over
from freescale.ft.step_result import StepResult
from freescale.grad_buckets import BucketedGrads
from freescale.rank_console import say
from freescale.step_sync import all_finite, nonfinite_message
from freescale.step_types import (
    Accounted,
    Commit,
    DataSide,
    DataState,
    JobFinished,
    NonFiniteError,
    SideChannel,
    SyncResult,
)
from freescale.testing import StepHooks

__all__ = ["DataState", "FaultTolerance", "JobFinished"]


class FaultTolerance(SnapshotSide):
    """One rank's fault tolerance across replica groups (module docstring): the engine's ``StepSync`` and
    ``ReplicaRun`` (``freescale.step_types``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: FTConfig, *,
                 data: DataState | None = None, hooks: StepHooks | None = None,
                 chunk_bytes: int | None = None, max_inflight: int | None = None,
                 nonfinite: str = "stop", device: torch.device | None = None,
                 update: DenseUpdate | None = None, scheduler: Any | None = None) -> None:
        cfg.validate()
        side = data if isinstance(data, DataSide) or data is None else DataSide(data, "FaultTolerance")
        self._cfg, self._model, self._optimizer, self._data = cfg, model, optimizer, side
        self._hooks = hooks or StepHooks()
        self._nonfinite = nonfinite
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._group_size = dist.get_world_size() if dist.is_initialized() else 1
        self._group_ranks = cfg.group_ranks or self._group_size
        """The whole group's ranks: more than ``_group_size`` when it lost some (``[ft] on_rank_loss = "shrink"``)."""
        if self._group_size > self._group_ranks:
            raise ValueError(f"fault tolerance: group_ranks ({self._group_ranks}) is smaller than the group's "
                             f"{self._group_size} ranks")
        self._group_index = cfg.replica_index
        self._device = device or next(iter(p.device for p in model.parameters() if p.device.type != "meta"),
                                     torch.device("cpu"))
        self._incarnation = incarnation()
        standby = cfg.standby_lock or os.environ.get(STANDBY_ENV, "")
        self._standby_fd: int | None = None
        if standby:  # a warm standby waits here, its model built, until the active process dies
            if self._group_size > 1:
                raise ValueError("fault tolerance: a warm standby (standby_lock) needs a one-rank replica group")
            self._standby_fd, self._incarnation = take_over(standby.format(replica=cfg.replica_id), self._incarnation)
            rank_console.took_over(self._incarnation)
        self._reduced, clipped, dense_optimizers = reduced_parts(model, optimizer)
        self._update = update if update is not None else DenseUpdate(dense_optimizers, clipped, LRSchedule(),
                                                                    scheduler=scheduler)
        """The committed step's dense update (clip, step, schedule: ``freescale/dense_update.py``), the same
        code and inputs in every group."""
        self._user_states: dict[str, UserState] = {}
        if side is not None:
            side.bind(self._group_index, cfg.replicas, self._rank, self._group_ranks)
        self.in_group = dist.new_group() if self._group_size > 1 else None
        self._grads = BucketedGrads(self._reduced, self.in_group, cfg.first_bucket_kb * 1024, cfg.bucket_kb * 1024,
                                   chunk_bytes=chunk_bytes, max_inflight=max_inflight)
        self._tables = embedding_sync.choose(model, cfg.embedding_sync, cfg.average_every, self._fence_staging)
        """How the embedding tables stay in step across groups (``freescale.ft.embedding_sync``)."""
        refusal = skip_step_refusal(True, self._tables.name) if nonfinite == "skip_step" else None
        if refusal:
            raise ValueError(f"fault tolerance: nonfinite: {refusal}")
        if self._group_size < self._group_ranks and self._tables.name == "average":  # (table_blocks: union only)
            from freescale.group_sizes import refuse_shrink

            refuse_shrink("its tables are averaged across groups (embedding_sync = average), by slices of each rank's "
                          "buffers, which a group on fewer ranks lays out differently", self._group_size,
                          self._group_ranks)
        for name, (get, load) in self._tables.snapshot_states().items():
            self.register_state(name, get, load)
        token = os.environ.get(TOKEN_ENV, "")
        bind, advertise = advertised_host(cfg.lighthouse)
        self._agent = (start_agent(cfg.lighthouse, cfg.replica_id, self._incarnation, self._group_size, bind, advertise)
                      if self._group_size > 1 and self._rank == 0 else None)  # its start overlaps the set-up below
        self._server = SnapshotServer(bind, token=token, advertise=advertise) if cfg.snapshots else None
        if self._server is not None:
            if self._hooks.wants("serve"):
                self._server.on_stream = lambda step: self._hooks.at("serve", step)
            self._server.start()
        try:
            voice = self._group_voice()
        except BaseException:
            if self._agent is not None:
                self._agent.stop()
            raise
        self._client = LighthouseClient(voice, cfg.replica_id, self._incarnation, member=self._rank,
                                       group_size=self._group_size, token=token,
                                       run_id=os.environ.get(RUN_ID_ENV, "")).start()
        self._client.join_mode = cfg.join  # said with the first step's quorum requests (then "record": ``begin_step``)
        if self._rank == 0:  # held back so that no step is committed twice: one line, once per reason
            self._client.on_waiting = lambda why: print(f"freescale: replica group {self._group_index}: {why}",
                                                       file=sys.stderr, flush=True)
        self._sync = ReplicaSync(self._client, position=self._rank, timeout_s=cfg.timeout_s, snapshot_server=self._server,
                                token=token, in_group=self.in_group, backend=cfg.replica_backend, device=self._device,
                                hooks=self._hooks, store_host=advertise,
                                positions=positions_served(self._rank, self._group_size, self._group_ranks))
        self._sync.landing, self._sync.stage_now = self._landing, self._stage_mid_step
        self._last = SyncResult(Commit(-1, frozenset(), frozenset()), None)
        """The last step's result (``step`` returns its commit; ``record`` reads its log fields)."""
        self._accounted: Accounted | None = None
        """The data side's account of the last applied step (a snapshot carries it: a group that catches up
        to the very step of the snapshot replays nothing, and logs that step's rows from here)."""
        self._ready_replicas = self._cfg.replicas  # how many held valid state after the last step
        self._events: list[dict[str, Any]] = []
        """This step's events so far (catch-up, staging, skipped steps): ``exchange`` hands them on."""
        self.events: deque[dict[str, Any]] = deque(maxlen=1024)
        """A loop calling ``step``: the events since it last took them (``exchange`` hands them on instead)."""
        self._finished_elsewhere = False
        self._run_finished = False
        self._members: set[str] | None = None
        """The groups of the last committed quorum (for the console line when they change)."""
        self._step, self._first_step = -1, True
        self._committed_at: float | None = None
        self._step_times: deque[float] = deque(maxlen=5)
        """Seconds between this rank's last applied commits (a source's guess at how long a transfer has)."""
        self._weight: float | None = None
        self._loss: torch.Tensor | None = None
        self._side: SideChannel | None = None

    def carry(self, side: SideChannel) -> None:
        """Tell every group ``side``'s header with each step; ``side.on_commit`` reads every group's at each
        applied commit (replays too); its state travels in the snapshot (``freescale.step_types.SideChannel``)."""
        self._side = side
        self.register_state(side.name, side.state_dict, side.load_state_dict)

    def _group_voice(self) -> str:
        """Where this rank's lighthouse requests go: the lighthouse itself for a group of one rank,
        else the group's agent on member 0 (``freescale.ft.group_agent``), whose URL member 0
        hands to its peers over the group's process group."""
        if self._agent is None and self._group_size == 1:
            return self._cfg.lighthouse
        buffer = torch.zeros(512, dtype=torch.uint8, device=collective_device(self.in_group))
        failure = ""
        if self._agent is not None:
            try:
                encoded = self._agent.wait_url().encode()
                buffer[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
            except RuntimeError as exc:
                failure = str(exc)
        dist.broadcast(buffer, group_src=0, group=self.in_group)
        url = bytes(buffer.cpu().tolist()).rstrip(b"\0").decode()
        if not url:
            raise RuntimeError(failure or f"replica group {self._group_index}: its agent on member 0 did not start "
                                          "(member 0's log says why)")
        return url

    # ------------------------------------------------------------------ start and end
    def start(self, wait_for: int | None = None) -> None:
        """Wait (``wait_for_replicas_s`` at most) until ``wait_for`` (default ``replicas``) groups are
        up: a late group would have to catch up from the first step."""
        self._tables.start()
        deadline = time.monotonic() + self._cfg.wait_for_replicas_s
        wanted = self._cfg.replicas if wait_for is None else wait_for
        while time.monotonic() < deadline:
            groups = self._client.status()["groups"]
            if sum(1 for g in groups.values() if g["healthy"]) >= wanted:
                return
            time.sleep(0.05)

    def fresh_run(self) -> bool:
        """No group has committed a step of this run yet (a new job may resume from a checkpoint;
        a group restarted while others train must catch up from them instead).  Asked once the
        lighthouse has settled (a restarted one without a state file first hears the live groups
        re-register: ``freescale.ft.membership``).  Agreed in-group."""
        deadline = time.monotonic() + self._cfg.wait_for_replicas_s
        status = self._client.status()
        while not status.get("settled", True) and time.monotonic() < deadline:
            time.sleep(0.05)
            status = self._client.status()
        return self.agree(int(status.get("high_step", -1)) < 0)

    def owns_checkpoint(self, commit: Commit) -> bool:
        """This group writes the checkpoint of ``commit``: the ready group with the lowest index
        (all hold the same state; every group computes the same choice).  Agreed in-group."""
        return self.agree(bool(commit.ready) and min(commit.ready) == self._group_index)

    def finish(self, last_step: int) -> None:
        self._run_finished = True
        if not self._finished_elsewhere:
            self._client.finish(last_step)

    def close(self) -> None:
        self._client.close()
        if self._agent is not None:
            self._agent.stop()
        if self._server is not None:
            self._server.stop()
        if self._standby_fd is not None:  # a standby waiting on it takes over, or ends where the run finished
            hand_back(self._standby_fd, finished=self._run_finished or self._finished_elsewhere)
            self._standby_fd = None

    # ------------------------------------------------------------------ one step
    @property
    def recovering(self) -> bool:
        return self._sync.recovering

    def begin_step(self, step: int) -> int:
        """Send the step's quorum request (its answer is read when needed).  Returns the step to train: ``step``, or
        with ``[ft] join = "wait"`` on a restarted group's first step, the quorum's (``_join_waiting``)."""
        self._sync.start_step(step)
        if self._first_step and self._cfg.join == "wait":
            step = self._join_waiting(step)
            self._client.join_mode = "record"  # joined or sat out: a redo's requests, or a later rejoin, record
        self._step, self._weight, self._loss = step, None, None
        self._update.before_tables(step)  # fbgemm takes the rate at the union's lookup, built during the vote
        self._sync.side_header = self._side.header() if self._side is not None else None
        self._tables.reset()
        return step

    def can_train(self, step: int) -> bool:
        """Not catching up; on a process's first step, not behind the quorum (a restarted group
        would train a stale step while the others wait for it to join their group: every rank of
        the group decides alike); and, with ``data`` that reports ``weight``, planned in (a group
        that just caught up has no share until the next plan).  Call it once per step, after
        ``begin_step``."""
        first, self._first_step = self._first_step, False
        if first and not self.agree(not self._sync.behind(step)):
            return False
        if self._sync.recovering:
            return False
        weight = self._data.weight(step) if self._data is not None else None
        return weight is None or weight > 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._reduced:
            p.grad = None

    def backward(self, loss: torch.Tensor, weight: float | None = None) -> None:
        """``loss.backward()`` with the dense buckets reduced in the group and across groups while
        it runs.  ``weight``: the samples this group's gradients average over, with ``loss`` already
        scaled so that the in-group average of the ranks' gradients is the group's (the engine's form).
        Without it, ``data`` reports both (``weight``, ``rank_samples``) and ``loss`` is the mean over
        this rank's samples: the layer scales it."""
        scale = self._arm(weight)
        self._loss = loss.detach()
        (loss * scale if scale != 1.0 else loss).backward()
        self._after_backward()

    def _data_weight(self, step: int) -> tuple[float, float]:
        """(This group's samples at ``step``, the factor turning a per-rank mean loss into the engine's form.)"""
        weight = self._data.weight(self._step) if self._data is not None else None
        if weight is None:
            raise ValueError("FaultTolerance.backward: pass weight= (the samples of this group's step), or "
                             "data= that reports weight(step) and rank_samples(step) (freescale.ft.StepSamples)")
        mine = self._data.rank_samples(self._step) if self._data is not None else None
        if mine is None or weight <= 0:
            return weight, 1.0
        return weight, mine * self._group_size / weight

    def _arm(self, weight: float | None) -> float:
        """Before this step's backward: the buckets and the cross-group stage are set to run during it.
        Returns the loss scale (1 with ``weight``; else ``data``'s, as in ``backward``)."""
        scale = 1.0
        if weight is None:
            weight, scale = self._data_weight(self._step)
        self._weight = float(weight)
        self._grads.begin()
        self._hooks.at("forward", self._step)
        if self._cfg.overlap_backward:
            self._sync.attach(self._step, self._grads, self._weight, self._tables.header())
        return scale

    def _after_backward(self) -> None:
        self._hooks.at("slow", self._step)
        if self._ready_replicas < self._cfg.replicas:
            self._hooks.at("away", self._step)

    def step(self) -> Commit:
        """The rest of the step's exchange, the vote and, once committed, the update (module
        docstring).  Without a ``backward`` this step, the replica contributes zeros with weight 0."""
        result = self.exchange()
        self.events.extend(result.events)
        return result.commit

    @property
    def record(self) -> dict[str, Any]:
        """The last step's fields for a log: participants, attempts, timings, the rate."""
        return self._last.record

    def exchange(self) -> SyncResult:
        """``step``, returning the whole result: the commit, the data side's account of the step (None while
        catching up), the step's log fields and its events."""
        step, trained = self._step, self._weight is not None
        tensors = self._grads.views() if trained else [torch.zeros_like(p) for p in self._reduced]
        self._hooks.at("reduce", step)
        try:
            # ``grads`` even when this replica did not train: its layout is the buckets every participant
            # reduces in (a zero contribution must issue the same collectives as the others).
            result = self._sync.reduce_and_commit(step, tensors, self._weight or 0.0, exchange=self._tables.exchange,
                                                 grads=self._grads)
        except JobFinished:
            self._finished_elsewhere = True
            raise
        record = self._record_of(result, trained)
        self._ready_replicas = len(result.ready)
        self._say_membership(result)
        if result.recovering:
            self._hooks.at("catchup", result.step)
            caught_up = self.agree(self._sync.snapshot_arrived)  # the whole group turns ready at one step
            if caught_up and self._catch_up():  # the snapshot and every recorded step up to this one: valid now
                record["nonfinite_skipped"] = True  # this step, replayed, was skipped
            commit = Commit(result.step, self._trained_groups(result), self._ready_groups(result),
                            applied=caught_up, restored=caught_up, joining=self._joining_groups(result))
            return self._finish_step(commit, self._accounted if caught_up else None, record)
        commit, skipped = self._apply(result)
        if skipped:
            record["nonfinite_skipped"] = True
        record.update(self._update.record)
        now = time.perf_counter()
        if self._committed_at is not None:
            self._step_times.append(now - self._committed_at)
        self._committed_at = now
        if result.stage_snapshot:
            self._stage(result.step, step_window(self._step_times))
        return self._finish_step(commit, self._accounted, record)

    def _finish_step(self, commit: Commit, accounted: Accounted | None, record: dict[str, Any]) -> SyncResult:
        events, self._events = tuple(self._events), []
        self._last = SyncResult(commit, accounted, record, events)
        return self._last

    def _apply(self, result: StepResult) -> tuple[Commit, bool]:
        """The committed step's update (dense optimizer on the averages, then the embedding tables' part:
        ``freescale.ft.embedding_sync``), then the data side's accounting.  (The commit; whether the step was
        skipped as non-finite.)"""
        self._fence_staging()
        commit = Commit(result.step, self._trained_groups(result), self._ready_groups(result),
                        {**{self._group_of(p.replica_id): len(p.addresses) for p in result.quorum.participants
                            if p.addresses}, **{self._group_of(rid): ranks for rid, ranks in result.joining}},
                        joining=self._joining_groups(result))
        updates = sum(result.weights.values()) > 0  # nobody trained this step: no update at all
        loss = self._loss if self._weight else None
        if not self._tables.tables_finite(result, self.agree):
            raise NonFiniteError(nonfinite_message(result.step, loss, self.in_group,
                                                   f" (replica group {self._group_index}; its averaged tables)"))
        finite = result.finite if result.finite is not None else all_finite(result.tensors)
        skipped = updates and not finite
        if skipped:
            if self._nonfinite == "stop":
                raise NonFiniteError(nonfinite_message(result.step, loss, self.in_group,
                                                       f" (replica group {self._group_index})"))
            self._events.append({"event": "nonfinite_skipped", "step": result.step})
            updates = False
        if updates:
            for p, grad in zip(self._reduced, result.tensors):
                p.grad = grad if grad.device == p.device else grad.to(p.device)  # replayed
            self._update.apply(result.step)
            for p in self._reduced:
                p.grad = None
            if self._tables.updates_at_commit:
                self._update.before_tables(result.step)  # a replayed step's lookup is built in apply
        else:
            self._update.record = {}
        self._tables.after_commit(result, updates)
        if self._data is not None:
            self._accounted = self._data.commit(commit)
        if self._side is not None:
            self._side.on_commit(commit, {self._group_of(rid): h for rid, h in result.side_headers.items()})
            self._client.notes = self._side.notes()
        for _, _, on_commit in self._user_states.values():
            if on_commit is not None:
                on_commit(commit)
        return commit, skipped

    def _say_membership(self, result: StepResult) -> None:
        """One console line for the job when the groups committing change (who left, who joined): said by rank
        0 of the first group that was in both quorums only (every member sees the same change), in one write
        (the groups share a terminal: two lines never interleave)."""
        members = set(result.quorum.replica_ids)
        before, self._members = self._members, members
        if self._rank != 0 or before is None or members == before or self._cfg.replica_id != min(members & before, default=""):
            return  # (the speaker: the first of the groups that were there before, so a rejoining one is named)
        change = "; ".join(part for part in (
            f"left: {', '.join(sorted(before - members))}" if before - members else "",
            f"joined: {', '.join(sorted(members - before))}" if members - before else "") if part)
        say(f"freescale: step {result.step} committed by {', '.join(sorted(members))} ({change})")

    def _record_of(self, result: StepResult, trained: bool) -> dict[str, Any]:
        return {"quorum_id": result.quorum.quorum_id, "participants": list(result.quorum.replica_ids),
                "attempts": result.attempts, "exchange_s": result.seconds, "contributing": trained, "weight": self._weight or 0.0,
                "quorum_wait_s": result.quorum_wait_s, "reduce_s": result.reduce_s,
                "prepare_s": result.prepare_s, "vote_s": result.vote_s, "discarded": result.discarded,
                "ready": sorted(result.ready), "recovering": result.recovering, "failed_at": result.failed_at,
                "exchange_bytes": result.extra.nbytes() if result.extra is not None else 0}

    def _group_of(self, replica_id: str) -> int:
        if replica_id == self._cfg.replica_id:
            return self._group_index
        try:
            return replica_index_of(replica_id)
        except ValueError:
            if self._data is not None:
                raise
            return -1  # custom replica ids and no data accounting: group indices are not used

    def _trained_groups(self, result: StepResult) -> frozenset[int]:
        return frozenset(self._group_of(rid) for rid, w in result.weights.items() if w > 0)

    def _ready_groups(self, result: StepResult) -> frozenset[int]:
        return frozenset(self._group_of(rid) for rid in result.ready)

    def _joining_groups(self, result: StepResult) -> frozenset[int]:
        """The groups the vote said join by waiting: they train the next step (on every group alike, whatever its
        own ``join``: the lighthouse names only groups that asked to join so)."""
        return frozenset(self._group_of(rid) for rid, _ in result.joining)

    def state_digests(self) -> dict[str, str]:
        """The audit's fingerprints of the committed state (``freescale.digest``; a collective on the group):
        ``digest``, the whole state, and what the embedding sync adds (``freescale.ft.embedding_sync``)."""
        return self._tables.digests(self._model, self._optimizer, self._last.commit.step)

    def agree(self, ok: bool) -> bool:
        """True only if every rank of this group got True (an in-group all-reduce, MIN)."""
        return self._sync.agree(ok)

    def warm_up(self, loss: torch.Tensor) -> None:
        """Backward of a forward whose result is thrown away (before the first quorum: torchrec's
        lazy set-up and the first kernels are paid here, not in a step the other groups wait for)."""
        (loss * 0.0).backward()
        for p in self._reduced:
            p.grad = None
        self._tables.reset()
