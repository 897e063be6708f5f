"""Atomic, resumable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout under the checkpoint directory::

    step_000000200/            a complete checkpoint (DCP shards + .metadata)
        freescale.json         step, data position, config, world size: written last
    step_000000300.partial/    a save in progress, or one killed mid-way: never loaded

A save writes every rank's shards into ``step_N.partial`` (DCP fsyncs each
file), waits for all ranks, then rank 0 writes ``freescale.json`` (fsync) and
renames the directory to ``step_N`` (fsync of the parent).  A rename is atomic,
so a kill at any moment leaves either the previous complete checkpoints or a
``.partial`` directory that ``latest`` ignores and the next save of that step
removes.  Old checkpoints are renamed to ``step_N.deleting`` before they are
deleted, so a kill during pruning cannot leave a half-deleted one on offer.
Model and optimizer state go through DCP, which stores torchrec's
sharded tables shard by shard and reshards dense weights on load; the trainer
hands it plan-independent state (``reshard.py``), so a checkpoint loads under
any sharding plan and world size.

``CheckpointWriter`` does the same save in the background: the state is copied
to host memory (``host_copy`` at the step, or the tables over the steps after it:
``staging.py``), DCP writes it on a thread of its own
over a gloo group of its own, and rank 0 commits it on that thread (the same
metadata and rename) once every rank's files are written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from freescale import checkpoint_integrity as integrity
from freescale.checkpoint_integrity import CheckpointDamaged, CheckpointError
from freescale.checkpoint_integrity import is_verified as is_verified  # re-exported: callers ask checkpoint
from freescale.config import require
from freescale.save_plans import PlanCache
from freescale.write_pacing import Pacer, light_write, lower_priority

META_NAME = "freescale.json"
PARTIAL_SUFFIX = ".partial"
TRASH_SUFFIX = ".deleting"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Where checkpoints go; empty means <train.output_dir>/checkpoints."""
    every: int = 0
    """Save every this many steps; 0 saves only at the end of training."""
    keep: int = 2
    """Complete checkpoints kept; older ones are removed after a save."""
    resume: bool = False
    """Start from the latest complete checkpoint in ``dir`` (fresh start if none).  Off, a ``dir`` that holds
    complete checkpoints already (an earlier run's) is refused in one line (``resume.Resume``)."""
    save_final: bool = True
    async_save: bool = True
    """Stage the state to host memory at the step, write it on a background thread while training goes
    on, and commit (``freescale.json``, rename) once every rank's files are written (``CheckpointWriter``)."""
    skip_while_busy: bool = True
    """With ``async_save``: a periodic save that comes due while the previous one is still being copied or
    written (on any rank) is skipped, the next multiple of ``every`` asks again, instead of that step waiting
    for the previous write (``freescale.training_saves``).  The last step's save is never skipped."""
    stage_budget: float = 0.05
    """With ``async_save`` and ``every``: the share of each step's time spent copying the embedding tables to
    host memory after a save step (copy-on-write: ``staging.py``), so the save step copies only the dense
    state.  0 copies everything at the save step."""
    write_share: float = 0.1
    """With ``async_save``: the share of one core a save's write may use while training goes on (the writer
    thread's CPU time over the wall time, ``write_pacing``): the write is spread over more steps, each slowed
    less.  Unpaced once the training waits for it (the last save, a stop).  0 writes at full speed."""
    reuse_plans: bool = True
    """With ``async_save``: DCP's save plans made at the first save and reused by the next ones (their
    structure is the same), so each save's start beside the training's steps is shorter (``save_plans``).
    ``false`` plans every save afresh (a state whose structure changes at every save gains nothing from it)."""

    def validate(self) -> None:
        require(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")
        require(0 <= self.stage_budget < 1, "stage_budget", f"must be in [0, 1), got {self.stage_budget}")
        require(0 <= self.write_share <= 1, "write_share", f"must be in [0, 1], got {self.write_share}")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / META_NAME).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _discard(path: Path) -> None:
    """Remove a checkpoint so that no kill can leave it half-deleted but still offered:
    rename it out of the ``step_N`` namespace (atomic) first, then delete."""
    trash = path.with_name(path.name + TRASH_SUFFIX)
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


Fence = Callable[[], None]
"""Raises if this job no longer holds the run directory (``run_lease.fence``): checked before a commit."""


def save(root: str | Path, step: int, app_state: dict[str, Any], meta: dict[str, Any], keep: int = 2,
         fence: Fence | None = None) -> Path:
    """Collective: every rank calls it with its own ``app_state``; returns the final path."""
    root = Path(root)
    partial = _begin(root, step, fence=fence)
    dcp.save(app_state, storage_writer=integrity.VerifyingWriter(partial))
    _barrier()  # every rank's files are written before rank 0 commits
    final = _commit(root, step, meta, keep, fence)
    _barrier()
    return final


def remove_stale(root: str | Path) -> list[str]:
    """Remove what killed saves and prunings left under ``root`` (``.partial`` and ``.deleting``
    directories); the names removed.  Only where no save of this run can be in flight: at the start of
    a job that holds the run directory (``run_lease``), before any rank writes."""
    root, removed = Path(root), []
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.is_dir() and child.name.startswith("step_") and child.name.endswith((PARTIAL_SUFFIX, TRASH_SUFFIX)):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return removed


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _begin(root: Path, step: int, group: Any = None, fence: Fence | None = None) -> Path:
    """Collective: an empty ``step_N.partial`` for every rank to write into (none once the fence fails)."""
    partial = Path(str(step_dir(root, step)) + PARTIAL_SUFFIX)
    _fenced(fence, partial)  # every rank reads the same lease file: all raise alike, none is left at the barrier
    if _is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)
    return partial


def _fenced(fence: Fence | None, partial: Path) -> None:
    """Rank 0: this job still holds the run directory, or its ``partial`` save is removed and the fence's
    error raised (the directory belongs to another job now: nothing of this one is left in it)."""
    if fence is None:
        return
    try:
        fence()
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _commit(root: Path, step: int, meta: dict[str, Any], keep: int, fence: Fence | None = None) -> Path:
    """Rank 0, once every rank's files of ``step`` are written: the fence (this job still holds the run
    directory, else nothing is committed or pruned), the metadata, then the atomic rename, then old
    checkpoints pruned."""
    final, partial = step_dir(root, step), Path(str(step_dir(root, step)) + PARTIAL_SUFFIX)
    _fenced(fence, partial)  # on every rank, as in ``_begin``
    if _is_main():
        meta_path = partial / META_NAME
        sealed = integrity.stamp({**meta, "step": step}, integrity.seal(partial))
        with meta_path.open("w") as fh:
            json.dump(sealed, fh, indent=2, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(partial)
        if final.exists():  # an older save of the same step (e.g. after a restart): replace it
            _discard(final)
        os.rename(partial, final)
        _fsync_dir(root)
        best = _best_step(root)
        for old_step, old in complete_checkpoints(root)[:-keep]:
            if old_step != best:  # the best validated one stays (``freescale.validation``)
                _discard(old)
    return final


def _best_step(root: Path) -> int | None:
    from freescale.validation import best_step

    return best_step(root)


Provided = Callable[[str, "torch.Tensor"], "torch.Tensor | None"]
"""The host tensor to use for the tensor at a state path (filled by the caller: ``staging``), or None."""


def host_copy(obj: Any, provided: Provided | None = None, path: str = "") -> Any:
    """``obj`` (a state dict) with every tensor copied to host memory: a ShardedTensor's local shards cloned
    under its metadata (placed on the CPU of the same rank), every other leaf copied, except where
    ``provided`` gives the host tensor for a path (``path#i`` for local shard ``i``): ``staging`` fills
    those itself."""
    import copy

    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    def fresh(p: str, tensor: torch.Tensor) -> torch.Tensor:
        found = provided(p, tensor) if provided is not None else None
        return found if found is not None else tensor.detach().to("cpu", copy=True)

    if isinstance(obj, ShardedTensor):
        shards = [Shard(fresh(f"{path}#{i}", s.tensor), _on_host(s.metadata)) for i, s in enumerate(obj.local_shards())]
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, _host_metadata(obj.metadata()))
    if isinstance(obj, torch.Tensor):
        return fresh(path, obj)
    if isinstance(obj, dict):
        return {k: host_copy(v, provided, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, provided, f"{path}/{i}") for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _on_host(meta: Any) -> Any:
    """A shard's metadata with its placement moved to the CPU of the same rank (a GPU shard's copy)."""
    from torch.distributed._shard.metadata import ShardMetadata

    return ShardMetadata(shard_offsets=list(meta.shard_offsets), shard_sizes=list(meta.shard_sizes),
                         placement=f"rank:{meta.placement.rank()}/cpu")


def _host_metadata(meta: Any) -> Any:
    """A ShardedTensor's global metadata for its host copy: every placement on CPU, no grad."""
    from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    props = meta.tensor_properties
    return ShardedTensorMetadata(
        shards_metadata=[_on_host(m) for m in meta.shards_metadata], size=meta.size,
        tensor_properties=TensorProperties(dtype=props.dtype, layout=props.layout, requires_grad=False,
                                           memory_format=props.memory_format, pin_memory=False))


Convert = Callable[[dict[str, Any], Any], tuple[dict[str, Any], dict[str, Any]]]
"""``(host state, process group) -> (the state DCP writes, entries for the checkpoint's metadata)``."""


class CheckpointWriter:
    """Saves that cost the training loop only the copy of its state to host memory.

    ``start`` (collective) takes the host copy (``host_copy``, or ``staging.LazySnapshot``'s) and
    returns: a thread of the writer's own converts it (``convert``: the plan-independent form,
    ``reshard.to_logical``), has DCP write it and waits for every rank's files, all over ``group`` (a
    gloo group of its own: the training's collectives go on at the same time on theirs, and none of
    DCP's planning round trips lands on a training step), then commits it there too (rank 0: metadata,
    rename, pruning, exactly as ``save``: their fsyncs and deletes never land on a step either).
    ``poll`` at each step takes note of a committed save, ``wait`` blocks for it.  One save in flight:
    ``start`` waits for the previous one first.  A kill at any moment leaves the previous checkpoint
    complete and this one ``.partial``.  With ``asynchronous=False`` it is ``save``.
    """

    def __init__(self, asynchronous: bool = True, group: Any = None, fence: Fence | None = None,
                 before_write: Callable[[int], None] | None = None, write_share: float = 0.0,
                 reuse_plans: bool = True) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.asynchronous, self.group, self.fence = asynchronous, group, fence
        self.pacer = Pacer(write_share)
        """The writer thread's CPU share while the training goes on (``write_pacing``); released by ``wait``."""
        self.plans = PlanCache(reuse_plans)
        """DCP's save plans, made at the first save and reused (``save_plans``)."""
        self.before_write = before_write
        """Called on the writer's thread with the save's step before its files are written (tests: slow storage)."""
        self._pending: tuple[Any, Path, int] | None = None
        self._abandoned = False
        """Set by ``abandon`` before it drops a save in flight: the writer's thread then commits nothing."""
        self._commit_lock = threading.Lock()
        """Held by the writer's thread from its check of ``_abandoned`` to the end of its commit, and by
        ``abandon`` to set it: a commit under way finishes before ``abandon`` removes anything."""
        self._written = threading.Event()
        """Set once the save in flight's files are written (its host copy is free again)."""
        self.committed: list[tuple[Path, float, float, float, float, float]] = []
        """Every save committed since the caller last emptied it: ``(path, seconds since start, its write's CPU
        seconds, seconds the pacing slept, its start's CPU seconds and seconds: until its files began to be
        written)``, whichever call committed it (``start`` waits for the save before it)."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freescale-checkpoint")

    def start(self, root: str | Path, step: int, app_state: dict[str, Any] | Callable[[], dict[str, Any]],
              meta: dict[str, Any], keep: int = 2, convert: Convert | None = None,
              copied: bool = False) -> Path | None:
        """Collective.  The final path when the save completed here (synchronous), else None.  Asynchronous:
        ``app_state`` is copied to host memory here unless it is a host copy already (``copied``; or a
        function giving one, called on the writer's thread), which the writer keeps until it is written."""
        self.wait()
        root = Path(root)
        if not self.asynchronous:
            if callable(app_state):
                app_state = app_state()
            if convert is not None:
                app_state, extra = convert(app_state, None)
                meta = {**meta, **extra}
            return save(root, step, app_state, meta, keep, self.fence)
        state = app_state if copied or callable(app_state) else host_copy(app_state)
        self._abandoned = False
        self._written.clear()
        self.pacer.arm()
        future = self._thread.submit(self._write, root, step, state, meta, keep, convert, time.perf_counter())
        self._pending = (future, root, step)
        return None

    def _write(self, root: Path, step: int, state: dict[str, Any] | Callable[[], dict[str, Any]],
               meta: dict[str, Any], keep: int, convert: Convert | None,
               started: float) -> tuple[Path, float, float, float, float, float]:
        """On the writer's thread: convert, write every rank's files (DCP ends with a gather to rank 0: once
        it returns there, every rank's files are in), commit; ``(path, seconds since start, the thread's CPU
        seconds, seconds the pacing slept, the start's CPU seconds and seconds)`` (``committed``).  The thread
        runs at a lower CPU priority (``write_pacing.lower_priority``) and with the GIL handed back sooner
        (``write_pacing.light_write``).  Where every core is busy it may take long: the next periodic save is skipped
        while it runs (``training_saves``), a save that cannot be skipped waits for it."""
        lower_priority()
        self.pacer.begin()
        if self.before_write is not None:
            self.before_write(step)
        planner = self.plans.planner(self.pacer)
        try:
            with light_write():
                if callable(state):
                    state = state()
                    self.pacer.pause()
                if convert is not None:
                    state, extra = convert(state, self.group)
                    meta = {**meta, **extra}
                    self.pacer.pause()
                partial = _begin(root, step, self.group, self.fence)
                dcp.save(state, storage_writer=integrity.VerifyingWriter(partial, self.pacer), planner=planner,
                         process_group=self.group)
        except BaseException:  # the ranks' kept plans may be out of step now: this one's dropped (``save_plans``)
            self.plans.forget(planner)
            raise
        self._written.set()
        with self._commit_lock:
            if self._abandoned:
                raise CheckpointError(f"{step_dir(root, step)}: abandoned (the run stopped) before its commit")
            path = _commit(root, step, meta, keep, self.fence)
        pacer = self.pacer
        pacer.end()
        return path, time.perf_counter() - started, pacer.cpu_s, pacer.slept_s, pacer.start_cpu_s, pacer.start_s

    @property
    def busy(self) -> bool:
        """A save is in flight on this rank: its files being written, or (rank 0) its commit under way."""
        return self._pending is not None and not self._pending[0].done()

    @property
    def writing(self) -> bool:
        """A save is in flight on this rank and its files are not all written yet (its host copy in use)."""
        return self._pending is not None and not self._written.is_set() and not self._pending[0].done()

    def poll(self) -> tuple[Path, float] | None:
        """The save in flight if its thread committed it: ``(path, seconds since start)``; None while it runs."""
        if self._pending is None or not self._pending[0].done():
            return None
        return self._finish()

    def wait(self) -> tuple[Path, float] | None:
        """Block until the save in flight is written and committed (its thread's error raised here); it is
        written at full speed from now on."""
        if self._pending is None:
            return None
        self.pacer.release()
        return self._finish()

    def abandon(self, wait_s: float = 15.0) -> None:
        """The run is being stopped: finish the save in flight or drop it, so a stop leaves only complete
        checkpoints behind.  Every rank waits up to ``wait_s`` for its write (another rank's writer thread
        would otherwise go on writing, even into a directory removed under it: the interpreter joins it at
        exit); written in time, its thread has committed it (rank 0, once DCP's last collective, a gather to
        rank 0, says every rank's files are in); else rank 0 removes the ``.partial`` and a write that ends
        later commits nothing.  What a late writer thread makes again,
        the launcher removes once every rank has ended, and a killed job's leftovers the next start
        (``remove_stale``)."""
        if self._pending is None:
            return
        future, root, step = self._pending
        self.pacer.release()
        try:
            future.result(timeout=wait_s)
        except BaseException:  # not written in time, or failed (a peer stopped first): dropped
            with self._commit_lock:  # a commit under way ends first (then the .partial below is gone already)
                self._abandoned = True  # a write that ends later commits nothing
            self._pending = None
            if _is_main():
                shutil.rmtree(Path(str(step_dir(root, step)) + PARTIAL_SUFFIX), ignore_errors=True)
            return
        try:
            self._finish()
        except BaseException:  # the stop's reason stays the one reported; the launcher removes what is left
            pass

    def _finish(self) -> tuple[Path, float]:
        """The save in flight, once its thread is done: committed there, or its error raised here."""
        assert self._pending is not None
        future, root, step = self._pending
        self._pending = None
        try:
            committed: tuple[Path, float, float, float, float, float] = future.result()
        except (Exception, CheckpointException) as exc:  # DCP's: the first failed rank's own error named
            first = next((str(f).strip().splitlines()[0] for f in _failures(exc) if str(f).strip()),
                         type(exc).__name__)
            raise CheckpointError(f"{step_dir(root, step)}: the background save failed: {first}") from exc
        self.committed.append(committed)
        return committed[0], committed[1]


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_path = Path(path) / META_NAME
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {META_NAME})")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointDamaged(f"{meta_path}: unreadable ({exc})") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointDamaged(f"{meta_path}: not a checkpoint's metadata (no step)")
    integrity.check_meta(Path(path), meta)
    return meta


def load(path: str | Path, app_state: dict[str, Any]) -> dict[str, Any]:
    """Collective: fill ``app_state`` in place from the checkpoint at ``path``; return its metadata.  Every
    byte read is checked against the checksums written with it (``checkpoint_integrity``): a damaged or
    missing file raises ``CheckpointDamaged`` naming it (``app_state`` may then be partly overwritten: load
    another checkpoint into it, or drop it); a checkpoint that does not fit ``app_state``,
    ``CheckpointError``.  One written before checksums loads unverified."""
    path = Path(path)
    meta = read_meta(path)
    reader = None
    if integrity.is_verified(meta):
        manifest = integrity.read_manifest(path, meta)
        integrity.check_files(path, manifest)
        reader = integrity.VerifyingReader(path, manifest)
    try:
        if reader is None:
            dcp.load(app_state, checkpoint_id=str(path))
        else:
            dcp.load(app_state, storage_reader=reader)
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
        failures = _failures(exc)
        damaged = next((f for f in failures if isinstance(f, CheckpointDamaged)), None)
        if damaged is not None:
            raise CheckpointDamaged(str(damaged)) from None
        first = next((str(f).strip().splitlines()[0] for f in failures if str(f).strip()), type(exc).__name__)
        raise CheckpointError(f"{path}: cannot load into this model/optimizer: {first}") from None
    return meta


def _failures(exc: BaseException) -> list[BaseException]:
    """The exceptions behind DCP's ``CheckpointException`` (one ``(exception, trace)`` per failed rank), or
    ``exc`` itself."""
    found = [pair[0] if isinstance(pair, tuple) else pair for pair in (getattr(exc, "failures", None) or {}).values()]
    return [f for f in found if isinstance(f, BaseException)] or [exc]
