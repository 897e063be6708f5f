"""The snapshot side of ``FaultTolerance``: what a snapshot holds, how it is staged for a recovering
peer and how a recovering rank loads it and replays the steps it sat out (``freescale.ft.catchup``
moves the bytes).

Staging overlaps the source's next forward and backward (``SnapshotServer.stage`` serves host tensors
live, from where they are, and copies the rest on its own thread), fenced before the next update
changes the state (``_fence_staging``, called by the update: the copy done, no transfer still reading;
with averaged tables, ``freescale.ft.sparse_average``, also just before their fused backward, which writes them).
A source stages at a commit (the lighthouse said a group waits to join) or, for a participant of the step's
quorum that is behind it and found nothing staged, mid-step (``_stage_mid_step``: the live transfer has the rest
of the step).  A recovering rank's download lands in its own tensors (``_landing``: the state is invalid until it
is loaded, so nothing reads it meanwhile); ``load`` then copies only what did not fit, and adopts the rest.  With
``[ft] join = "wait"`` a restarted group loads it before its first step and joins that step (``_join_waiting``): it
trains it, or, behind batches planned ahead (torchrec's pipelines), sits it out and trains the first step planned with it.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from freescale.dense_update import DenseUpdate
from freescale.ft.config import FTConfig
from freescale.ft.embedding_sync import EmbeddingSync
from freescale.ft.ftar import ReplicaSync
from freescale.ft.snapshot_state import (
    from_json,
    load_torch_optimizer,
    named_tensors,
    rng_state,
    set_rng_state,
    to_json,
)
from freescale.ft.step_result import StepResult
from freescale.step_types import Accounted, Commit, DataSide
from freescale.testing import StepHooks

UserState = tuple[Callable[[], Any], Callable[[Any], None], Callable[[Commit], Any] | None]


def step_window(step_times: deque[float]) -> float | None:
    """How long a staged snapshot's transfer has before the source's next fence: about one step, the median
    of the last commit intervals; None (no estimate: served live) before there are 3.  With averaged tables
    the fence comes at the tables' backward, the last part of the backward: the window is shorter by the
    exchange and the vote."""
    return sorted(step_times)[len(step_times) // 2] if len(step_times) >= 3 else None


class SnapshotSide(ABC):
    """Mixed into ``FaultTolerance`` (``freescale/ft/layer.py``), which sets these attributes."""

    _model: nn.Module
    _optimizer: torch.optim.Optimizer
    _update: DenseUpdate
    _data: DataSide | None
    _accounted: Accounted | None
    _user_states: dict[str, UserState]
    _sync: ReplicaSync
    _events: list[dict[str, Any]]
    _cfg: FTConfig
    _hooks: StepHooks
    _step_times: deque[float]
    _committed_at: float | None
    _tables: EmbeddingSync

    @abstractmethod
    def agree(self, ok: bool) -> bool:
        """FaultTolerance's agreement within the group (True only if every rank says True)."""

    @abstractmethod
    def _apply(self, result: StepResult) -> tuple[Commit, bool]:
        """FaultTolerance's committed update (a replayed step goes through it too)."""

    def register_state(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                       on_commit: Callable[[Commit], Any] | None = None) -> None:
        """Carry more state in the snapshot a recovering group loads (counters, an EMA, a sampler):
        ``state_dict()`` is called when a snapshot is staged, ``load_state_dict(state)`` when one is loaded.
        A snapshot is a committed step's state, and the recovering group then replays the steps committed
        since without the loop seeing them: state that advances with every step must advance in
        ``on_commit(commit)``, called after each applied commit (replayed ones included, after ``data``'s),
        not in the loop body.  Values: tensors and JSON-able values (dict keys become strings).  Every
        group must register the same names."""
        if name in self._user_states:
            raise ValueError(f"FaultTolerance.register_state: '{name}' is registered already")
        self._user_states[name] = (state_dict, load_state_dict, on_commit)

    def _state(self) -> dict[str, Any]:
        return {"model": self._model.state_dict(), "optim": self._optimizer.state_dict()}

    def check_snapshot(self) -> None:
        """Encode what the snapshot carries beside the model and optimizers now (data side, scheduler, registered
        states): a value that cannot travel (a set, a path, a function) is refused here in one line, naming
        it, instead of when a recovering peer asks for a snapshot."""
        scheduler = self._update.scheduler
        data = self._data
        parts = {"data": data.state_dict if data is not None else None,
                 "scheduler": scheduler.state_dict if scheduler is not None else None,
                 **{f"registered state '{name}'": get for name, (get, _, _) in self._user_states.items()}}
        for what, get in parts.items():
            if get is None:
                continue
            try:
                json.dumps(to_json(get(), "/check", {}))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"fault tolerance: the {what} cannot travel in a snapshot ({exc}); give it tensors "
                                 "and JSON values (numbers, strings, lists, dicts)") from None

    def snapshot(self) -> dict[str, torch.Tensor]:
        """This rank's whole state as named tensors (what a recovering peer at this position loads):
        the model, the optimizers, and in ``meta.json`` (tensors beside it) the data side, the LR
        scheduler, the registered states and the RNGs."""
        tensors = dict(named_tensors(self._state(), ""))
        # Served live or copied off this thread (``SnapshotServer.stage``), fenced before the next update:
        # parameters and optimizer state change only there.  Anything else a forward may change (a norm's running
        # statistics, a user's buffer) is copied now.
        updated = {p.untyped_storage().data_ptr() for p in self._model.parameters()}
        for name, t in tensors.items():
            if name.startswith("/model/") and t.untyped_storage().data_ptr() not in updated:
                tensors[name] = t.detach().clone()
        scheduler = self._update.scheduler
        accounted = self._accounted
        meta = {"data": to_json(self._data.state_dict(), "/data", tensors) if self._data is not None else None,
                "accounted_rows": accounted.rows.tolist() if accounted is not None else None,
                "scheduler": to_json(scheduler.state_dict(), "/scheduler", tensors) if scheduler is not None else None,
                "user": {name: to_json(get(), f"/user/{name}", tensors) for name, (get, _, _) in self._user_states.items()},
                "rng": rng_state(tensors)}
        encoded = json.dumps(meta).encode()
        tensors["meta.json"] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        return tensors

    def _stage(self, step: int, window_s: float | None) -> None:
        """Stage committed ``step`` for a recovering peer (``window_s``: how long a live transfer has before this
        rank's next update, its fence)."""
        stage_s = self._sync.stage(step, self.snapshot(), window_s)
        self._events.append({"event": "stage", "step": step, "stage_s": stage_s, **self._sync.stage_choice})

    def _stage_mid_step(self, step: int, after_backward: bool) -> None:
        """``ReplicaSync.stage_now``: committed ``step`` staged mid-step, the live transfer having the rest of the
        step (estimated from the last commits; with tables updated in backward, none: their backward fences it).
        Not after a backward that updated tables: they hold this step's update already."""
        if self._tables.updates_in_backward:
            if not after_backward:
                self._stage(step, 0.0)
            return
        window = step_window(self._step_times)
        if window is not None and self._committed_at is not None:
            window = max(window - (time.perf_counter() - self._committed_at), 0.0)
        self._stage(step, window)

    def _fence_staging(self) -> None:
        """Before the state changes: the snapshot copy started at the last staging is done and no transfer
        still reads the live state (the time this thread waited goes to the record as ``stage_wait_s``,
        with ``copy_s`` the copy's or the transfer's wait: none when both ran in the shadow of the step's
        forward and backward)."""
        start = time.perf_counter()
        copy_s = self._sync.wait_staged()
        if copy_s:
            self._events.append({"event": "staged", "copy_s": copy_s, "stage_wait_s": time.perf_counter() - start})

    def _landing(self) -> dict[str, torch.Tensor]:
        """This rank's state by snapshot name, for a snapshot to land in place (a catch-up starts: the
        state is invalid until it is loaded).  A lazily built dense optimizer state is built now, not
        after the snapshot landed (building it takes a step, which would change what landed)."""
        self._fence_staging()
        if hasattr(self._optimizer, "optimizers"):  # torchrec's (the import is torchrec's: only then)
            from freescale.parallelize import materialize_optimizer_state

            materialize_optimizer_state(self._optimizer)
        return dict(named_tensors(self._state(), ""))

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a fetched snapshot (its tensors landed in place where ``_landing`` allowed: not copied again)."""
        self._fence_staging()
        loaded: set[str] = set()
        if not hasattr(self._optimizer, "optimizers"):
            loaded = load_torch_optimizer(self._optimizer, tensors)  # its state may not exist yet: rebuilt
        mine = dict(named_tensors(self._state(), ""))
        missing = sorted(set(mine) - set(tensors))
        if missing:
            raise RuntimeError(f"catch-up: the snapshot lacks {missing[:3]} (a different model or sharding plan?)")
        with torch.no_grad():
            for name, t in mine.items():
                if t.shape != tensors[name].shape:
                    raise RuntimeError(f"catch-up: '{name}' is {tuple(tensors[name].shape)} in the snapshot, "
                                       f"{tuple(t.shape)} here")
                if name not in loaded and t.data_ptr() != tensors[name].data_ptr():  # (not landed in place)
                    t.copy_(tensors[name])
        meta = json.loads(bytes(tensors["meta.json"].numpy()).decode())
        if self._data is not None and meta.get("data") is not None:
            self._data.load_state_dict(from_json(meta["data"], tensors))
        # The snapshot's own step, as the source accounted it; this group sat it out: no samples of its own.
        rows = meta.get("accounted_rows")
        self._accounted = Accounted(np.asarray(rows, dtype=np.int64), 0) if rows is not None else None
        self._load_extras(meta, tensors)

    def _load_extras(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """The scheduler (and the rates it set), the registered states and the RNGs of a snapshot."""
        scheduler = self._update.scheduler
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(from_json(meta["scheduler"], tensors))
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr  # the rate the source's next update uses
        user = meta.get("user") or {}
        for name, (_, load, _) in self._user_states.items():
            if name not in user:
                raise RuntimeError(f"catch-up: the snapshot has no state '{name}' (registered here, not on the "
                                   "group it came from)")
            load(from_json(user[name], tensors))
        if meta.get("rng") is not None:
            set_rng_state(meta["rng"], tensors)

    def _join_waiting(self, step: int) -> int:
        """A restarted group's first step with ``join = "wait"``: when the quorum is ahead of ``step``, download the
        snapshot of the step before the quorum's (the other groups stage it at that step's commit, or once they read
        this quorum, and serve it while their forward and backward run, then wait for this group's gradients in the
        reduction), load it and return the quorum's step for the loop to train.  Not in within ``timeout_s / 2`` on
        every rank of the group (the others' reduction waits at most ``timeout_s``): ``step``, sat out and recorded
        as ``record`` does."""
        if not self.agree(self._sync.behind(step)):
            return step
        budget = self._cfg.timeout_s / 2
        arrived = self._sync.await_snapshot(budget)
        if not self.agree(arrived is not None):
            self._sync.catch_up_log["join"] = f"record (not in within {budget:.1f} s on every rank)"
            return step
        assert arrived is not None
        self._sync.catch_up_log["join"] = "wait"
        self._hooks.at("catchup", arrived)
        self._catch_up()  # the snapshot of step arrived - 1: nothing recorded, nothing to replay
        return arrived

    def _catch_up(self) -> bool:
        """Load the snapshot and replay every recorded step after it (the group agreed it is in).  Returns
        whether the last replayed step was skipped as non-finite (False if nothing was replayed)."""
        caught = self._sync.take_catch_up()
        start = time.perf_counter()
        self.load(caught.state)
        loaded = time.perf_counter()
        skipped = False
        for result in caught.replay:
            _, skipped = self._apply(result)
        log = self._sync.catch_up_log
        ready = time.time()
        # Caught up: holding the run's latest committed state.  At the last byte when nothing committed
        # meanwhile needed a replay (the tensors landed in place); else once replayed.
        log.update(load_s=loaded - start, replay_s=time.perf_counter() - loaded, ready=ready,
                   caught_up=log["arrived"] if not log.get("stale_at_arrival") else ready)
        self._events.append({"event": "catch_up", "step": caught.replay[-1].step if caught.replay
                            else caught.snapshot_step, "catch_up": dict(log)})
        return skipped
