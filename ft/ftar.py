"""Fault-tolerant all-reduce (FTAR) of dense gradients across replica groups.

Rank position ``r`` of every participating group forms one process group per
quorum (gloo, or NCCL on GPUs: ``freescale.ft.replica_group``; rendezvous
through the lighthouse's TCPStore under the prefix
``freescale/ftar/q<quorum id>/p<r>``, so a new quorum never reads an old
quorum's keys), ranked by the quorum's sorted participant order.

Averaging is by samples, not by participants: each replica sends
``[sum_i w * g_i, w]`` where ``w`` is the number of samples its gradients
average over, and everyone divides the summed gradients by the summed weights.
With unequal batches (balanced loader, a group that lost ranks, a recovering
group contributing ``w = 0``) this is the exact mean over all the samples of
the step; torchft's division by the participant count is not.  Gloo's ring
all-reduce (and NCCL's, whose reduction order depends only on the group's
ranks and sizes) hands every rank the same reduced bytes and the division is local
and identical, so replicas stay bit-identical (``freescale.ft.weighted_reduce``
holds the buffer and its reduction).

``ReplicaSync.reduce_and_commit`` is one step's exchange: reduce in the
current quorum; on any collective failure (a peer died: connection reset; or
hung: the lighthouse says the quorum is lost once its heartbeat times out, or
the collective timeout) report the quorum broken; then vote.  Only a unanimous vote
commits; otherwise ask for the next quorum (the dead group is out) and reduce
again **with the gradients this replica still holds** (inputs are never
reduced in place), so the step commits with the survivors: no step is
discarded.

The vote's round trip overlaps the update's preparation: the vote is sent,
then the exchange's update is built (``Exchange.prepare``: the union and its
lookup, which changes no row; fbgemm's call counters do move) and the
averages are checked for non-finite values, and only then is the outcome
read.  A failed vote (or an error while it is in flight) puts the prepared
update back (``Exchange.discard``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from freescale.ft.catchup import SnapshotServer
from freescale.ft.client import LighthouseClient, Quorum
from freescale.ft.replica_group import FTARGroup, RendezvousStore, ServedPositions, serving_member
from freescale.ft.snapshot_fetch import PositionsFetch
from freescale.ft.step_result import CatchUp, Exchange, StepResult, join_headers, split_headers
from freescale.ft.weighted_reduce import FlatReduction, FTARStage, Reduced, weighted_all_reduce
from freescale.grad_buckets import BucketedGrads, GroupFailure
from freescale.step_sync import all_finite
from freescale.testing import StepHooks


class _NoValidState(RuntimeError):
    """Nobody in the quorum can provide the run's state: not a peer failure, not retried."""


class ReplicaSync:
    """One rank position's side of FT-HSDP's gradient exchange, vote and catch-up.

    Per step (``freescale.ft.layer.FaultTolerance`` drives it)::

        sync.start_step(step)                         # quorum request overlaps the forward
        grads.begin(); sync.attach(step, grads, w, header); loss.backward()   # buckets reduced in backward
        r = sync.reduce_and_commit(step, grads, weight=w, exchange=...)
        if not r.recovering: sync.wait_staged(); apply r.tensors and r.extra   # the fence, then the update
        if r.stage_snapshot: sync.stage(r.step, state)  # served live, or copied on the staging thread
        catch_up = sync.take_catch_up()               # recovering: snapshot in -> load + replay

    A replica that finds the quorum ahead of its step (a restarted group) adopts
    the quorum's step, contributes zeros with weight 0, records every committed
    result, and fetches a snapshot from a source on a side thread
    (``freescale.ft.catchup``).
    """

    def __init__(self, client: LighthouseClient, position: int = 0, timeout_s: float = 5.0,
                 snapshot_server: SnapshotServer | None = None, token: str = "", max_attempts: int = 50,
                 in_group: Any = None, backend: str = "gloo", device: torch.device | None = None,
                 hooks: StepHooks | None = None, store_host: str = "127.0.0.1",
                 positions: Sequence[int] = ()) -> None:
        self.client = client
        self.hooks = hooks or StepHooks()
        self.position = position
        self.positions = tuple(positions) or (position,)
        """Rank positions this rank serves across groups: its own, and the lost ranks' in a group that runs on
        fewer than its ranks (``freescale.ft.replica_group.positions_served``)."""
        self.device = device or torch.device("cpu")
        self.group = ServedPositions([FTARGroup(client.replica_id, p, timeout_s, backend, device, client.quorum_lost)
                                      for p in self.positions])
        self.snapshots = snapshot_server
        if snapshot_server is not None:
            client.address = snapshot_server.address
        self.store = RendezvousStore(store_host) if position == 0 else None
        if self.store is not None:
            client.store = self.store.address
        self.token = token
        self.max_attempts = max_attempts
        self.in_group = in_group
        """This replica group's own process group (None for a group of one): every vote's outcome is
        agreed over it (a lighthouse restarted mid-vote can answer two members differently)."""
        self._pending: Future[Quorum] | None = None
        self._resolved: Quorum | None = None
        self._early_quorum_wait = 0.0
        self._attached: int = -1
        """The quorum whose group the current step's buckets are reduced in during backward."""
        self.quorum: Quorum | None = None
        self.recovering = False
        self._recorded: list[StepResult] = []
        self._recorded_at: list[float] = []
        self.landing: Callable[[], dict[str, torch.Tensor]] | None = None
        """This rank's own state by snapshot name, ready for a snapshot to land in place (set by the
        layer; called on the training thread as a catch-up starts)."""
        self._fetch: PositionsFetch | None = None
        self.catch_up_log: dict[str, Any] = {}
        self.stage_now: Callable[[int, bool], None] | None = None
        """Stage committed step N now, mid-step (the layer's; ``_stage_for_behind`` calls it; the flag: after backward)."""
        self.side_header: torch.Tensor | None = None
        """Non-negative int64s this replica tells every participant with the step's reduction, ahead of the
        exchange's header (its group's measured speeds: ``freescale.speed_share``).  Set before the step's
        ``attach``; the same length on every participant at every step."""

    def _header(self, exchange_header: torch.Tensor | None) -> torch.Tensor | None:
        return join_headers(self.side_header, exchange_header)

    def _split_headers(self, headers: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return split_headers(headers, self.side_header.numel() if self.side_header is not None else 0)

    def start_step(self, step: int) -> None:
        """Ask for the step's quorum now; the answer is read when the step needs it."""
        self._pending = self.client.quorum_async(step)
        self._resolved = None
        self._attached = -1

    def _quorum_of(self, step: int) -> tuple[Quorum, float]:
        """The step's quorum (asked for in ``start_step``) and the seconds spent waiting for it now."""
        if self._resolved is not None:
            return self._resolved, 0.0
        start = time.perf_counter()
        quorum = self._pending.result() if self._pending is not None else self.client.quorum(step)
        self._pending = None
        self._resolved = quorum
        return quorum, time.perf_counter() - start

    def behind(self, step: int) -> bool:
        """Wait for the step's quorum now and say whether it is ahead of ``step`` (this replica must
        catch up: no use training the step).  A process's first step asks this before its forward:
        a restarted group would otherwise train a stale step 0 while the others wait for it."""
        try:
            quorum, waited = self._quorum_of(step)
        except Exception:
            return False
        self._early_quorum_wait += waited
        if quorum.max_step > step:
            if not self._recovering_to(quorum.max_step):  # (a waiting join that gave up started it already)
                self._start_recovery(quorum, step)  # now, before this step's zero contribution joins the new group
            return True
        return False

    def await_snapshot(self, budget_s: float) -> int | None:
        """A waiting join (``[ft] join = "wait"``; ``behind`` started the catch-up on a restarted group's first step):
        join the quorum's group now, so the others' reduction does not stall in its set-up, and wait up to
        ``budget_s`` for the snapshot of the step before the quorum's (staged by the sources at that step's commit,
        or once they read this quorum: ``_stage_for_behind``).  The quorum's step when it is in (``take_catch_up``
        would not block), else None: the step is sat out and recorded as ``record`` does, the download goes on."""
        quorum = self._resolved
        if quorum is None or self._fetch is None or not self._recovering_to(quorum.max_step):
            return None
        try:
            self.group.for_quorum(quorum)
        except (RuntimeError, dist.DistError):
            return None  # its first attempt meets the same failure, reports it and redoes
        self.catch_up_log.setdefault("group_ready", time.time())  # joined its first quorum's group
        return quorum.max_step if self._fetch.wait(budget_s) else None

    def _others_behind(self, quorum: Quorum) -> bool:
        """Another participant asked for an older step than the quorum's (it must catch up; this rank, after a
        waiting join, is one such itself: it needs no snapshot)."""
        me = self.client.replica_id
        return any(p.step < quorum.max_step and p.replica_id != me for p in quorum.participants)

    def _stage_for_behind(self, step: int, behind: bool, after_backward: bool) -> None:
        """``behind``: another participant of ``step``'s quorum is behind it (``_others_behind``).  Nothing it can use
        is staged (a group that asked to
        join after the vote that would have had the sources stage at that commit: one that came up while the others
        redid a failed step, a standby, a forked rank): stage committed ``step - 1`` now, which this rank still
        holds (its update comes after this step's commit), through the layer's ``stage_now`` (``after_backward``:
        this step's backward ran, which tables updated in backward make too late).  The joiner then holds the state
        while this step runs: a waiting join trains it, a recording one replays it at its commit."""
        if not behind or self.stage_now is None or self.snapshots is None or self.recovering or step < 1:
            return
        staged = self.snapshots.staging_step  # (a copy in flight counts: staging again would wait for it)
        if staged is None or staged < step - 1:
            self.stage_now(step - 1, after_backward)

    def attach(self, step: int, grads: BucketedGrads, weight: float, header: torch.Tensor | None) -> bool:
        """Before backward, after ``grads.begin()``: reduce each bucket across groups as backward
        makes it, in the step's quorum.  False when this replica will not contribute to the quorum
        (behind it, or catching up) or cannot join its group now: ``reduce_and_commit`` then
        reduces after backward, in the same layout."""
        try:
            quorum, waited = self._quorum_of(step)
        except Exception:
            return False
        self._early_quorum_wait += waited
        if self.recovering or quorum.max_step > step or not grads.active:
            return False
        self._stage_for_behind(step, self._others_behind(quorum), after_backward=False)
        try:
            group = self.group.for_quorum(quorum)
        except (RuntimeError, dist.DistError):
            return False  # the first attempt meets the same failure, reports it and redoes
        index, size = quorum.index_of(self.client.replica_id), len(quorum.participants)
        reduction = FlatReduction(grads.layout, weight, index, size, True, self._header(header), group.device)
        grads.attach(FTARStage(reduction, group, quorum.quorum_id))
        self._attached = quorum.quorum_id
        return True

    def agree(self, ok: bool) -> bool:
        """True only if every rank of this replica group got True (an in-group all-reduce, MIN)."""
        if self.in_group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.in_group)
        return bool(flag.item())

    def _reduce(self, quorum: Quorum, step: int, tensors: Sequence[torch.Tensor], weight: float,
                header: torch.Tensor | None, grads: BucketedGrads | None) -> Reduced:
        """One attempt's dense reduction: the one started during backward (same quorum), or now."""
        group = self.group.for_quorum(quorum)
        if self.recovering and "group_ready" not in self.catch_up_log:
            self.catch_up_log["group_ready"] = time.time()  # joined its first quorum's group
        if grads is not None and grads.attached and self._attached == quorum.quorum_id:
            return grads.finish()
        if grads is not None:
            grads.settle()  # the gradients hold the group mean once the in-group stage is done
        send, send_weight = (([torch.zeros_like(t) for t in tensors], 0.0) if self.recovering
                             else (list(tensors), float(weight)))
        return weighted_all_reduce(group, send, send_weight, quorum.index_of(self.client.replica_id),
                                   len(quorum.participants), not self.recovering, header,
                                   grads.layout if grads is not None else None)

    def reduce_and_commit(self, step: int, tensors: Sequence[torch.Tensor], weight: float,
                          exchange: Exchange | None = None, grads: BucketedGrads | None = None) -> StepResult:
        """Reduce ``tensors`` across the quorum (through ``grads`` when ``attach`` started it in this
        quorum), run ``exchange``, vote; redo with the survivors until a quorum commits."""
        start = time.perf_counter()
        quorum, quorum_wait = self._quorum_of(step)
        quorum_wait += self._early_quorum_wait
        self._early_quorum_wait = 0.0
        self._resolved = None
        reduce_s = prepare_s = vote_s = 0.0
        discarded = 0
        seen_behind = False
        attempts = 0
        last_error = ""
        failed_at: float | None = None  # wall time this rank found the step's first attempt failed
        header = self._header(exchange.header() if exchange is not None else None)  # local: not a peer's error
        while True:
            attempts += 1
            if attempts > self.max_attempts:
                raise RuntimeError(
                    f"replica '{self.client.replica_id}': step {step} failed in {self.max_attempts} quorums in a row "
                    f"(last quorum {quorum.quorum_id}: {last_error or 'the vote did not pass'}); giving up")
            if quorum.max_step > step:
                if not self._recovering_to(quorum.max_step):
                    self._start_recovery(quorum, step)
                step = quorum.max_step
            # A quorum retried after a failure may no longer show who was behind: remember it.
            behind = self._others_behind(quorum)
            seen_behind = seen_behind or behind
            self._stage_for_behind(step, behind, after_backward=weight > 0)
            reduced: Reduced | None = None
            extra: Any = None
            side: list[torch.Tensor] = []
            t0 = time.perf_counter()
            try:
                reduced = self._reduce(quorum, step, tensors, weight, header, grads)
                if not any(reduced.ready):
                    raise _NoValidState(
                        f"quorum {quorum.quorum_id} at step {step}: no participant holds valid state (all are catching "
                        "up and every group that had the run's progress is gone); restart the run")
                side, headers = self._split_headers(reduced.headers)
                if exchange is not None:
                    extra = exchange(self.group.for_quorum(quorum), quorum, reduced.weights, headers, reduced.ready)
            except (RuntimeError, dist.DistError) as exc:  # a peer died or hung: redo with the survivors
                if isinstance(exc, (_NoValidState, GroupFailure)):
                    raise
                if grads is not None:
                    grads.settle()  # the redo reduces the group means with the survivors
                last_error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                failed_at = failed_at or time.time()
                reduced = None
                self.group.drop()
                self.client.report_failure(quorum.quorum_id)
            t1 = time.perf_counter()
            self.hooks.at("vote", step)
            committed, prepared, finite, t2 = self._vote(quorum, step, reduced, exchange, extra)
            discarded += prepared is not None and not committed
            timings = (reduce_s + t1 - t0, prepare_s + t2 - t1, vote_s + time.perf_counter() - t2)
            reduce_s, prepare_s, vote_s = timings
            if committed and reduced is not None:
                result = self._committed(step, quorum, reduced, extra, attempts, seen_behind, start,
                                         quorum_wait, timings, side)
                result.prepared, result.finite, result.discarded = prepared, finite, discarded
                result.failed_at = failed_at
                return result
            failed_at = failed_at or time.time()
            self.group.drop()
            quorum = self.client.quorum(step)

    def _vote(self, quorum: Quorum, step: int, reduced: Reduced | None, exchange: Exchange | None,
              extra: Any) -> tuple[bool, Any, bool | None, float]:
        """Send the vote, prepare the update while it is in flight, read the outcome (agreed in the
        group): (committed, prepared, finite, when the preparation ended).  The prepared update is
        put back unless the step committed."""
        vote = self.client.commit_async(quorum.quorum_id, step, reduced is not None, ready=not self.recovering)
        prepared: Any = None
        committed = read = False
        try:
            prepared, finite = self._prepare(reduced, exchange, extra)
            prepared_at = time.perf_counter()
            outcome, read = vote(), True
            committed = self.agree(outcome)
        finally:
            if not read:
                self.client.drop_connection()  # the vote's answer is still on its way on it
            if not committed:
                self.client.forget_next()  # this step is redone: its quorum is asked again
                if prepared is not None and exchange is not None:
                    exchange.discard(prepared)
        return committed, prepared, finite, prepared_at

    def _prepare(self, reduced: Reduced | None, exchange: Exchange | None, extra: Any) -> tuple[Any, bool | None]:
        """While the vote is in flight: the exchange's update built, the averages checked (a
        recovering replica applies nothing now: its recorded steps are prepared at replay)."""
        if reduced is None or self.recovering:
            return None, None
        if exchange is not None:
            self.wait_staged()  # the union's forward moves fbgemm's step counters: not while they are sent
        prepared = exchange.prepare(extra) if exchange is not None else None
        return prepared, all_finite(reduced.tensors)

    def _committed(self, step: int, quorum: Quorum, reduced: Reduced, extra: Any, attempts: int,
                   seen_behind: bool, start: float, quorum_wait: float,
                   timings: tuple[float, float, float], side: list[torch.Tensor]) -> StepResult:
        self.quorum = quorum
        self.client.progress = {"quorum_id": quorum.quorum_id, "step": step + 1, "ready": not self.recovering}
        ids = quorum.replica_ids
        reduce_s, prepare_s, vote_s = timings
        result = StepResult(
            step, reduced.tensors, quorum, attempts, 0.0, self.recovering, False,
            weights=dict(zip(ids, reduced.weights)), ready=frozenset(r for r, f in zip(ids, reduced.ready) if f),
            joining=self.client.joiners,
            extra=extra, quorum_wait_s=quorum_wait, reduce_s=reduce_s, prepare_s=prepare_s, vote_s=vote_s,
            side_headers=dict(zip(ids, side)),
        )
        if self.recovering:
            # Kept until the snapshot is in, maybe for many steps: on the host (NCCL: not GPU memory).
            result.tensors = [t.cpu() for t in result.tensors]
            self._recorded.append(result)
            self._recorded_at.append(time.time())
        result.stage_snapshot = not self.recovering and self._should_stage(step, quorum, seen_behind)
        result.seconds = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------ catch-up
    def _should_stage(self, step: int, quorum: Quorum, seen_behind: bool) -> bool:
        """Stage committed ``step`` for a recovering peer?  When the lighthouse said, with this
        step's vote, that a group is waiting to join (it will ask for this very step, the one before
        its first quorum's: no wait for a step boundary); when a fetcher waits for a step not staged
        yet; or when a participant of this quorum is behind and nothing it can use is staged."""
        if self.snapshots is None:
            return False
        if self.client.joiner_waiting or self.snapshots.wants(step):
            return True
        staged = self.snapshots.staged_step  # (``seen_behind`` covers this quorum: every attempt's is in it)
        return seen_behind and (staged is None or staged < quorum.max_step - 1)

    def stage(self, step: int, state: dict[str, torch.Tensor], window_s: float | None = None) -> float:
        """Source side: stage committed ``step``'s state for a recovering peer (served live, or copied off this
        thread: live only if expected to end within ``window_s``, about a step; ``wait_staged`` before the state
        changes); returns the seconds this thread spent."""
        assert self.snapshots is not None
        return self.snapshots.stage(step, state, window_s)

    @property
    def stage_choice(self) -> dict[str, Any]:
        """How the last staging chose between live and copied (``freescale.ft.catchup.expected_live_cut``)."""
        return dict(self.snapshots.choice) if self.snapshots is not None else {}

    def wait_staged(self) -> float:
        """The fence after ``stage``: the staging copy is done and no transfer reads live state (0.0 when
        nothing was in flight)."""
        return self.snapshots.wait_staged() if self.snapshots is not None else 0.0

    def _recovering_to(self, step: int) -> bool:
        """Already catching up to ``step`` and nothing recorded yet (``behind`` started it this very step)."""
        return self.recovering and not self._recorded and self.catch_up_log.get("joined_step") == step

    def _start_recovery(self, quorum: Quorum, step: int) -> None:
        """Start catching up to ``quorum.max_step``; again from scratch when already catching up
        (the quorum moved past steps this replica has not recorded: its replay would miss them)."""
        self.recovering = True
        self._recorded, self._recorded_at = [], []
        if self._fetch is not None:
            self._fetch.cancel()  # it may be writing this rank's own tensors
        if self.snapshots is not None:
            self.snapshots.can_serve = False
        sources = [self._sources(quorum, position) for position in self.positions]
        if not all(sources):
            raise RuntimeError(f"replica '{self.client.replica_id}' must catch up to step {quorum.max_step} but no "
                               "participant runs a snapshot server")
        self.catch_up_log = {"joined_step": quorum.max_step, "own_step": step, "sources": sources[0],
                             "started": time.time()}
        # Every committed step from this quorum's on is recorded: the state of the step before it is
        # enough (the sources stage it when the lighthouse tells them, with its vote, that we wait).
        # A fresh download each time: one of an abandoned catch-up may still be waiting on its source.
        own = self.landing() if self.landing is not None else None
        self.catch_up_log["landing_ready"] = time.time()
        self._fetch = PositionsFetch(sources, max(quorum.max_step - 1, 0), self.token, self.catch_up_log, own)

    def _sources(self, quorum: Quorum, position: int) -> list[str]:
        """Each other participant's snapshot server at ``position`` (its member serving it), if it is at the
        quorum's step."""
        return [p.addresses[serving_member(position, len(p.addresses))] for p in quorum.participants
                if p.replica_id != self.client.replica_id and p.step == quorum.max_step
                and p.addresses and p.addresses[serving_member(position, len(p.addresses))]]

    @property
    def snapshot_arrived(self) -> bool:
        """Recovering and the snapshot is downloaded (``take_catch_up`` would not block)."""
        return self.recovering and self._fetch is not None and self._fetch.arrived

    def take_catch_up(self) -> CatchUp:
        """Recovering: the snapshot (blocks until it is in) and the recorded steps newer than it.
        The caller loads and replays them; the replica is then ready again."""
        assert self.recovering and self._fetch is not None, "take_catch_up() while not recovering"
        fetched = self._fetch.result()
        snap_step = fetched.step
        newer = [r for r in self._recorded if r.step > snap_step]
        if [r.step for r in newer] != list(range(snap_step + 1, snap_step + 1 + len(newer))):
            raise RuntimeError(f"catch-up: recorded steps {[r.step for r in newer][:5]}.. do not follow "
                               f"snapshot step {snap_step}")
        # Steps committed before the last byte came that the snapshot does not hold: the state is the
        # run's latest only once they are replayed (none, usually: the sources stage the step before ours).
        stale = sum(1 for r, at in zip(self._recorded, self._recorded_at) if r.step > snap_step and at <= fetched.arrived)
        self.catch_up_log.update(snapshot_step=snap_step, replayed=len(newer), bytes_per_s=fetched.rate,
                                 source_wait_s=fetched.waited_s, transfer_s=fetched.transfer_s, bytes=fetched.nbytes,
                                 in_place_bytes=fetched.in_place, arrived=fetched.arrived, stale_at_arrival=stale,
                                 finished=time.time())
        self.recovering, self._recorded, self._recorded_at, self._fetch = False, [], [], None
        self.client.progress = {**self.client.progress, "ready": True}  # valid once loaded and replayed
        if self.snapshots is not None:
            self.snapshots.can_serve = True
        return CatchUp(snap_step, fetched.tensors, newer)
