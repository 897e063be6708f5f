"""Where a run starts: the newest checkpoint that verifies, converted to this plan (``reshard``), or nothing.

``Resume.start_step`` (collective over the group) decides and loads: with ``checkpoint.resume``, the newest
complete checkpoint whose bytes verify (a damaged one is named in one line and the one before it tried);
under fault tolerance only in a fresh run (a group restarted while others train catches up from them
instead), and never where the groups' records say the job committed beyond it (``ft.commit_record``: held
back until the holders are back, or ``ft.accept_rollback``).  The trainer (``trainer.py``) asks it once,
before the first step.  Without ``checkpoint.resume``, a fresh run whose checkpoint directory holds an earlier
run's checkpoints is refused in one line: its saves would be pruned against them, and a later resume pick theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale import checkpoint, reshard
from freescale.components import Components, TrainerConfig
from freescale.config import differences, to_dict
from freescale.distributed import DistContext
from freescale.ft.commit_record import hold_back_rollback
from freescale.ft.config import incarnation
from freescale.parallelize import materialize_optimizer_state
from freescale.run_log import RunLog
from freescale.validation import validation_steps


class Resume:
    """The start of one run: ``cfg``, its checkpoint directory ``root``, and (fault tolerance under a run id)
    the directory of the groups' commit records."""

    def __init__(self, cfg: TrainerConfig, root: Path, records: Path | None, run_id: str) -> None:
        self.cfg, self.root, self.records, self.run_id = cfg, root, records, run_id

    def start_step(self, parts: Components, log: RunLog) -> int:
        """With ``checkpoint.resume``: load the latest complete checkpoint; the step to start at.  With
        fault tolerance only in a fresh run (every group was lost): a group restarted while others train
        catches up from them instead.  Every rank of the group decides alike."""
        earlier = newest_earlier(self.cfg, self.root)  # listed before the lighthouse is asked: a later one is this run's
        if not self.cfg.checkpoint.resume and not self.cfg.ft.enabled:
            self._refuse_an_earlier_run(parts, earlier)
            return 0
        found = self._agreed_checkpoints(parts) if self.cfg.checkpoint.resume else []
        path = found[0] if found else None
        fresh = parts.replicas.fresh_run() if parts.replicas is not None else True
        if fresh:  # the lighthouse may have forgotten (restarted without --state): the groups' records say
            fresh = self._no_rollback(parts, log, int(path.name.rsplit("_", 1)[1]) if path is not None else 0)
        if not self.cfg.checkpoint.resume:
            if fresh:  # (a group started while the run is under way catches up from the others)
                self._refuse_an_earlier_run(parts, earlier)
            return 0
        if path is None or not fresh:
            log.write("no_resume", checkpoint=str(path) if path else None, fresh_run=fresh)
            _say(parts.ctx, "the run is under way in other replica groups: catching up from them" if not fresh
                      else f"no checkpoint under {self.root}; starting from step 0")
            return 0
        materialize_optimizer_state(parts.optimizer)
        path, meta, state, notes = self._load_newest_sound(found, parts, log)
        parts.dmp.load_state_dict(state["model"])
        parts.optimizer.load_state_dict(state["optim"])
        step = int(meta["step"])
        if path != found[0] and not self._no_rollback(parts, log, step):  # an older one than was checked
            log.write("no_resume", checkpoint=str(path), fresh_run=False)
            _say(parts.ctx, "the run is under way in other replica groups: catching up from them")
            return 0
        parts.feed.load_state_dict(self._data_state(path, meta, parts))
        if parts.validation is not None and meta.get("validation"):  # the best so far, the validations since it
            parts.validation.tracker.load_state_dict(meta["validation"])
        log.write("resume", step=step, path=str(path), conversions=notes)
        _say(parts.ctx, f"resumed from {path} at step {step}")
        for note in notes:
            _say(parts.ctx, f"  {note}")
        return step

    def load_into(self, parts: Components, path: Path) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``parts``' model and optimizer, whatever plan wrote it (no data
        position, no checks against the run's records); its metadata."""
        materialize_optimizer_state(parts.optimizer)
        state, meta = raw_state(parts), checkpoint.read_meta(path)
        self._load_state(path, meta, state, parts)
        parts.dmp.load_state_dict(state["model"])
        parts.optimizer.load_state_dict(state["optim"])
        return meta

    def _refuse_an_earlier_run(self, parts: Components, newest: int) -> None:
        """``refuse_an_earlier_run`` on every rank of the group alike, from the newest over the group's ranks of
        what each listed (``newest_earlier``: before the lighthouse was asked); collective."""
        if parts.ctx.world_size > 1:
            newest_t = torch.tensor([newest], dtype=torch.int64, device=parts.ctx.device)
            dist.all_reduce(newest_t, op=dist.ReduceOp.MAX)
            newest = int(newest_t)
        refuse_an_earlier_run(self.root, newest)

    def _no_rollback(self, parts: Components, log: RunLog, start: int) -> bool:
        """Whether the run may start at ``start`` (``ft.commit_record.hold_back_rollback``: held back while the
        groups' records say the job committed beyond it); False once the holders are back (catch up)."""
        replicas = parts.replicas
        if self.records is None or replicas is None:  # (records are kept under fault tolerance only)
            return True

        def say(line: str) -> None:
            log.write("held_back", message=line)
            _say(parts.ctx, f"freescale: replica group {parts.group}: {line}")

        return hold_back_rollback(self.records, self.run_id, start, replicas.fresh_run, say,
                                  self.cfg.ft.accept_rollback, agree=replicas.agree)

    @staticmethod
    def _data_state(path: Path, meta: dict[str, Any], parts: Components) -> dict[str, Any]:
        """The checkpoint's data position for this run.  Saved by another shape (replica groups, ranks per
        group): every group of this run starts ready, and the loader trains the rest of the epoch
        (``dataloader/reshape.py``); nothing is in flight at a checkpoint."""
        data = meta["data"]
        if "loader" not in data:  # written before the step feed kept its own state
            return {"loader": data, "next": int(meta["step"]), "ready": [0], "plans": []}
        # A new run starts with every group whole: sizes saved while a group ran on fewer ranks do not carry over.
        data = {**data, "sizes": []}
        groups, world = (meta.get("ft") or {}).get("replicas", 1), meta.get("world_size")
        if (groups, world) == (parts.groups, parts.feed.group_size):
            return data
        if data.get("plans"):
            raise checkpoint.CheckpointError(f"{path}: saved with steps in flight; it resumes only as "
                                             f"{groups} replica group(s) of {world} rank(s)")
        return {**data, "ready": list(range(parts.groups)), "plans": []}

    def _load_state(self, path: Path, meta: dict[str, Any], state: dict[str, Any], parts: Components) -> list[str]:
        """Fill ``state`` (this plan's model and optimizer state dicts) from the checkpoint, whatever plan
        wrote it (``reshard``); the notes name each table whose optimizer state was approximated."""
        saved_kind = ((meta.get("config") or {}).get("model") or {}).get("kind")
        kind = self.cfg.model.kind
        if saved_kind and saved_kind != kind:
            raise checkpoint.CheckpointError(f"{path}: written by a {saved_kind} model; this run trains {kind}")
        saved_plan, plan = meta.get("plan") or {}, reshard.plan_summary(parts.dmp)
        saved_tables, tables = set(saved_plan), set(plan)
        try:
            if saved_tables and saved_tables != tables:
                missing = sorted(tables - saved_tables) or sorted(saved_tables - tables)
                where = "the checkpoint has no" if tables - saved_tables else "this model has no"
                raise checkpoint.CheckpointError(f"{path}: {where} table '{missing[0]}' (checkpoint: "
                                                 f"{', '.join(sorted(saved_tables))}; model: {', '.join(sorted(tables))})")
            if "layouts" not in meta:  # written before logical checkpoints: loads into the same plan only
                checkpoint.load(path, state)
                return []
            replicas = reshard.Replicas(frozenset(t for t, p in saved_plan.items() if p.get("type") == "data_parallel"))
            return reshard.load_logical(lambda app: checkpoint.load(path, app), state["model"], state["optim"],
                                        meta["layouts"], replicas=replicas)
        except checkpoint.CheckpointDamaged:
            raise
        except (reshard.LayoutError, checkpoint.CheckpointError) as exc:
            changed = differences((meta.get("config") or {}).get("model") or {}, to_dict(self.cfg.model), "model.")
            hint = f" (the model's config differs from the checkpoint's: {'; '.join(changed)})" if changed else ""
            message = str(exc) if isinstance(exc, checkpoint.CheckpointError) else f"{path}: {exc}"
            raise checkpoint.CheckpointError(message + hint) from None

    def _load_newest_sound(self, found: list[Path], parts: Components,
                           log: RunLog) -> tuple[Path, dict[str, Any], dict[str, Any], list[str]]:
        """Load the newest of ``found`` (newest first) whose bytes verify into this plan's state dicts (fresh
        ones for each try: a failed load leaves them part-converted): a damaged one is reported in one line
        and the one before it tried; none left, ``CheckpointError``.  A checkpoint that verifies but does
        not fit this model stops the resume (an older one would not fit either)."""
        for path in found:
            state = raw_state(parts)
            try:
                meta = checkpoint.read_meta(path)
                notes = self._load_state(path, meta, state, parts)
            except checkpoint.CheckpointDamaged as exc:
                log.write("checkpoint_damaged", path=str(path), reason=str(exc))
                older = "trying the one before it" if path != found[-1] else "no older checkpoint left"
                _say(parts.ctx, f"checkpoint {path.name} is damaged, not loaded: {exc}; {older}")
                continue
            if not checkpoint.is_verified(meta):
                notes = [f"{path.name} was written before checkpoints carried checksums: loaded unverified", *notes]
            return path, meta, state, notes
        raise checkpoint.CheckpointError(
            f"{self.root}: every complete checkpoint is damaged ({len(found)}: "
            f"{', '.join(p.name for p in found)}); restore one, or start over without --resume")

    def _agreed_checkpoints(self, parts: Components) -> list[Path]:
        """The complete checkpoints, newest first, the same on every rank of the group (an in-group
        all-reduce of the newest step: a checkpoint being written while the job starts could otherwise split
        the ranks)."""
        found = checkpoint.complete_checkpoints(self.root)
        step = found[-1][0] if found else -1
        if parts.ctx.world_size > 1:
            steps = torch.tensor([step, -step], dtype=torch.int64, device=parts.ctx.device)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
            if int(steps[0]) != -int(steps[1]):
                raise checkpoint.CheckpointError(f"{self.root}: the group's ranks found different latest "
                                                 "checkpoints (one being written while this job started?)")
        return [path for _, path in reversed(found)]


def writes_checkpoints(cfg: TrainerConfig) -> bool:
    """Whether the run may write a checkpoint: periodic saves, the last step's, or a kept best validation."""
    c = cfg.checkpoint
    return c.every > 0 or c.save_final or (cfg.eval.keep_best and validation_steps(cfg.eval.every, 1) > 0)


def newest_earlier(cfg: TrainerConfig, root: Path) -> int:
    """The newest complete checkpoint's step under ``root``, where a fresh run would be refused for it
    (``refuse_an_earlier_run``), else -1: resuming, a restarted incarnation of this very run (the CLI resumes it; a
    ``Trainer`` used directly decides for itself), or a run that writes no checkpoint at all."""
    if cfg.checkpoint.resume or incarnation() > 0 or not writes_checkpoints(cfg):
        return -1
    found = checkpoint.complete_checkpoints(root)
    return found[-1][0] if found else -1


def refuse_an_earlier_run(root: Path, newest: int) -> None:
    """A run started afresh (no ``checkpoint.resume``, its first incarnation) where complete checkpoints lay already
    (``newest`` >= 0: ``newest_earlier``'s): an earlier run's.  Its own saves would be pruned against them (the
    newest steps are kept: a new run's step 600 went as it was written, beside an earlier run's step 6,552), and a
    later ``--resume`` or a kept best would pick theirs: ``CheckpointError`` in one line, before a step (the launcher
    asks before any rank starts; the ranks again, with their group)."""
    if newest >= 0:
        raise checkpoint.CheckpointError(
            f"{root} holds the checkpoints of an earlier run (newest: {checkpoint.step_dir(root, newest).name}); this "
            "run would lose its own saves to them: resume that run (--resume), give this one a train.output_dir of "
            "its own (or checkpoint.dir), or remove them")


def raw_state(parts: Components) -> dict[str, Any]:
    """The model's and optimizer's state dicts: views of the live tensors (torchrec's tables included)."""
    return {"model": parts.dmp.state_dict(), "optim": parts.optimizer.state_dict()}


def _say(ctx: DistContext, message: str) -> None:
    if ctx.is_main:
        print(message, flush=True)


__all__ = ["Resume", "newest_earlier", "raw_state", "refuse_an_earlier_run", "writes_checkpoints"]
