"""Record the collectives a run issues: order, size, phase, and the time the issuing thread was blocked.

``CommTracer`` is a context manager; while it is entered every collective the
process issues through ``torch.distributed`` becomes a :class:`CommEvent`:
which op, which process group (by the label it was registered under), how many
bytes this rank sends in (the input), their dtype, which phase of the step
(``forward`` / ``backward``, set by the pipeline with :func:`phase`), which
embedding module issued it (:meth:`CommTracer.attribute`), the step, when it
was issued and **how long the issuing thread was blocked on it**
(``blocked_s``): the whole call for a synchronous collective, the time spent
in ``work.wait()`` (summed over waits) for an asynchronous one.

What is traced, and how:

- the ``torch.distributed`` collectives and point-to-point ops
  (:data:`TRACED_OPS`: ``all_reduce``, ``all_to_all_single``, ``all_to_all``,
  ``all_gather``, ``all_gather_into_tensor`` / ``all_gather_single``,
  ``reduce_scatter_tensor`` / ``reduce_scatter_single``, ``reduce_scatter``,
  ``broadcast``, ``reduce``, ``gather``, ``scatter``, ``barrier``,
  ``monitored_barrier``, the coalesced and deprecated ``_base`` variants,
  ``send`` / ``recv`` / ``isend`` / ``irecv`` / ``batch_isend_irecv``),
  patched both on ``torch.distributed`` and on
  ``torch.distributed.distributed_c10d``, so calls through either module and
  the tensor collectives that the object collectives (``all_gather_object``,
  ``broadcast_object_list``, ...) issue internally are seen.  A collective
  issued inside another traced one counts once (the outer one).  torchrec 1.8
  on this path calls ``dist.all_to_all_single`` (embedding input and output
  dists and their backward), ``dist.all_reduce``,
  ``dist.all_gather(_into_tensor)``, ``dist.reduce_scatter(_tensor)``,
  ``dist.broadcast`` and ``dist.barrier``, all through the module attribute
  (a module that did ``from torch.distributed import all_reduce`` before the
  tracer was entered keeps the untraced function);
- DDP's gradient all-reduce: DDP's reducer calls the process group from C++,
  where no Python patch reaches.  While the tracer is entered, each
  ``DistributedDataParallel`` module gets, at its first forward, a comm hook
  that does what DDP's built-in one does (divide by the group size, sum) with
  a traced ``all_reduce`` (``phase`` ``backward``).  The reducer waits for
  those futures inside ``backward`` (in its final autograd callback), so the
  blocked time is taken from the clock: from the moment that callback starts
  to the last bucket's completion.  The hook stays registered after the
  tracer exits (DDP cannot unregister one) and then reduces without
  recording.  Numerics: the built-in hook multiplies by ``1/n`` where this one
  divides by ``n``; equal bit for bit when ``n`` is a power of two (2 ranks
  here), possibly not in the last bit otherwise;
- functional collectives (``torch.distributed._functional_collectives``,
  ``torch.ops._c10d_functional.*``: torchrec uses them only under
  ``torch.compile`` or with ``set_use_sync_collectives(True)``, neither of
  which this trainer does): the ops on the ``torch.ops._c10d_functional``
  namespace are wrapped (same cost as the others), and ``wait_tensor`` on an
  op's output adds its time to that op's event.  Not seen: calls from C++
  (the backward of ``_c10d_functional_autograd`` ops, compiled graphs) and
  code traced by dynamo while the tracer is entered (it would see the
  wrapper, not the op).

Not seen at all: collectives a ``ProcessGroup`` object is asked for directly
(``pg.allreduce(...)``, torchft's managed groups), waits through a work's
``get_future()`` rather than ``wait()`` or on a ``_coalescing_manager``'s
work, and anything issued from C++.  A wait on a later step than the issue is
charged to the issuing step's event.

The pipeline tests read the issue order from these events; ``bench_pipeline``
reads the blocked time per step ("exposed communication" as the training
thread sees it: :func:`blocked_per_step`, :func:`category`).  Tracing costs a
Python wrapper per collective (a few microseconds) and is off unless a
tracer is entered (``train.trace_comm``, benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel

_state = threading.local()


def current_phase() -> str:
    return getattr(_state, "phase", "")


def current_source() -> str:
    return getattr(_state, "source", "")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the collectives issued on this thread inside the block (``forward``, ``backward``)."""
    previous = current_phase()
    _state.phase = name
    try:
        yield
    finally:
        _state.phase = previous


@dataclass
class CommEvent:
    op: str
    group: str
    bytes: int
    phase: str
    source: str
    """The embedding module whose output dist issued it (``attribute``), else empty."""
    step: int
    issued_s: float
    blocked_s: float = 0.0
    """Time the issuing thread was blocked on it: the call (synchronous), or in ``wait()`` (asynchronous)."""
    completed_in_wait: bool = False
    """It was not complete yet when the thread started waiting for it (or the call was synchronous)."""
    dtype: str = ""
    """dtype of the (first) input tensor: ``int64``/``int32`` for ids, lengths and splits."""
    issue_s: float = 0.0
    """Time spent in the issuing call of an asynchronous collective (enqueueing; not in ``blocked_s``)."""


# op name -> the parameter holding what this rank sends in (None: nothing, e.g. a barrier).
TRACED_OPS: dict[str, str | None] = {
    "all_reduce": "tensor",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",
    "reduce_scatter": "input_list",
    "broadcast": "tensor",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "monitored_barrier": None,
    "all_reduce_coalesced": "tensors",
    "all_gather_coalesced": "input_tensor_list",
    "_all_gather_base": "input_tensor",
    "_reduce_scatter_base": "input",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "batch_isend_irecv": "p2p_op_list",
}

# Functional collectives on torch.ops._c10d_functional (input first, group name last).
FUNCTIONAL_OPS = ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                  "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                  "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "broadcast_")

_ALWAYS_ASYNC = {"isend", "irecv", "batch_isend_irecv"}
_ALWAYS_SYNC = {"send", "recv", "monitored_barrier"}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[torch.Tensor] = []
        for item in value:
            out.extend(_tensors(item.tensor if isinstance(item, dist.P2POp) else item))
        return out
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype(tensors: list[torch.Tensor]) -> str:
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else ""


class _TracedWork(dist.Work):
    """Delegates to the real work handle and times ``wait()``.

    A ``dist.Work`` subclass because torchrec checks ``isinstance(req, dist.Work)``
    before waiting.
    """

    def __init__(self, work: dist.Work, event: CommEvent) -> None:
        super().__init__()
        self._work, self._event = work, event

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        start = time.perf_counter()
        already = self._work.is_completed()
        result = self._work.wait(*args, **kwargs)
        self._event.blocked_s += time.perf_counter() - start
        self._event.completed_in_wait = self._event.completed_in_wait or not already
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def get_future(self) -> Any:
        return self._work.get_future()

    def result(self) -> Any:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()

    def source_rank(self) -> int:
        return self._work.source_rank()


class _DdpRound:
    """One backward's DDP buckets: issue events, completion times, and when the reducer began waiting."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self.done_at: dict[int, float] = {}
        self.wait_from: float | None = None
        self.resolved = False

    def resolve(self) -> None:
        """Blocked time = from ``wait_from`` to the last completion, charged to buckets in completion order."""
        if self.resolved or self.wait_from is None or len(self.done_at) < len(self.events):
            return
        covered = self.wait_from
        for i in sorted(self.done_at, key=self.done_at.__getitem__):
            event, done = self.events[i], self.done_at[i]
            event.blocked_s = max(0.0, done - covered)
            event.completed_in_wait = done > self.wait_from
            covered = max(covered, done)
        self.resolved = True


class _FunctionalOp:
    """Stands in for a ``torch.ops._c10d_functional`` op packet: traced ``__call__``, everything else forwarded."""

    def __init__(self, packet: Any, call: Callable[..., Any]) -> None:
        self._packet, self._call = packet, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


class CommTracer:
    """Context manager; ``events`` lists every traced collective in issue order, ``step`` tags them."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self.step = 0
        self._labels: dict[int, str] = {}
        self._labels_by_name: dict[str, str] = {}
        self._originals: list[tuple[Any, str, Any]] = []
        self._active = False
        self._ddp_rounds: list[_DdpRound] = []
        self._ddp_seen: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
        self._functional_pending: dict[int, CommEvent] = {}
        self._real_all_reduce: Any = c10d.all_reduce

    # -- naming -------------------------------------------------------------------
    def label(self, group: Any, name: str) -> None:
        self._labels[id(group)] = name
        group_name = getattr(group, "group_name", None)
        if isinstance(group_name, str):
            self._labels_by_name[group_name] = name

    def attribute(self, module: Any, name: str) -> None:
        """Tag collectives issued by ``module.compute_and_output_dist`` (a torchrec sharded module) with ``name``."""
        original = module.compute_and_output_dist

        def tagged(*args: Any, **kwargs: Any) -> Any:
            previous = current_source()
            _state.source = name
            try:
                return original(*args, **kwargs)
            finally:
                _state.source = previous

        module.compute_and_output_dist = tagged

    def _group_name(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return self._labels.get(id(dist.GroupMember.WORLD), "world")
        return self._labels.get(id(group), "other")

    def _functional_group_name(self, name: Any) -> str:
        if not isinstance(name, str):
            return "other"
        if name in self._labels_by_name:
            return self._labels_by_name[name]
        world = dist.GroupMember.WORLD
        if world is not None and getattr(world, "group_name", None) == name:
            return self._labels.get(id(world), "world")
        return "other"

    def _event(self, op: str, group: str, inputs: list[torch.Tensor], phase_: str | None = None) -> CommEvent:
        event = CommEvent(op, group, _nbytes(inputs), current_phase() if phase_ is None else phase_,
                          current_source(), self.step, time.perf_counter(), dtype=_dtype(inputs))
        self.events.append(event)
        return event

    # -- torch.distributed --------------------------------------------------------
    def _wrap(self, name: str, original: Any, input_param: str | None) -> Any:
        params = list(inspect.signature(original).parameters)
        at = {p: params.index(p) for p in (input_param, "group", "async_op") if p is not None and p in params}

        def arg(args: tuple[Any, ...], kwargs: dict[str, Any], param: str) -> Any:
            i = at.get(param)
            if i is None:
                return None
            return args[i] if i < len(args) else kwargs.get(param)

        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(_state, "depth", 0) or not self._active:
                return original(*args, **kwargs)
            inputs = _tensors(arg(args, kwargs, input_param)) if input_param else []
            event = self._event(name, self._group_name(arg(args, kwargs, "group")), inputs)
            is_async = name in _ALWAYS_ASYNC or (name not in _ALWAYS_SYNC and bool(arg(args, kwargs, "async_op")))
            _state.depth = 1
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                _state.depth = 0
                spent = time.perf_counter() - start
            if not is_async:
                event.blocked_s, event.completed_in_wait = spent, True
                return result
            event.issue_s = spent
            if isinstance(result, list):
                return [_TracedWork(w, event) if isinstance(w, dist.Work) else w for w in result]
            return _TracedWork(result, event) if isinstance(result, dist.Work) else result

        traced.__name__ = traced.__qualname__ = name
        traced.__doc__ = original.__doc__
        return traced

    # -- functional collectives ------------------------------------------------------
    def _wrap_functional(self, name: str, packet: Any) -> _FunctionalOp:
        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(_state, "depth", 0) or not self._active:
                return packet(*args, **kwargs)
            inputs = _tensors(args[0] if args else kwargs.get("input", kwargs.get("inputs")))
            group = args[-1] if args and isinstance(args[-1], str) else kwargs.get("group_name")
            event = self._event(f"functional.{name}", self._functional_group_name(group), inputs)
            start = time.perf_counter()
            result = packet(*args, **kwargs)
            event.issue_s = time.perf_counter() - start
            for out in _tensors(result):
                self._functional_pending[id(out)] = event
            return result

        return _FunctionalOp(packet, traced)

    def _wrap_wait_tensor(self, packet: Any) -> _FunctionalOp:
        def traced(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            event = self._functional_pending.pop(id(tensor), None) if self._active else None
            if event is None:
                return packet(tensor, *args, **kwargs)
            start = time.perf_counter()
            result = packet(tensor, *args, **kwargs)
            event.blocked_s += time.perf_counter() - start
            event.completed_in_wait = True
            return result

        return _FunctionalOp(packet, traced)

    # -- DDP --------------------------------------------------------------------------
    def _ddp_hook(self, ddp: DistributedDataParallel) -> Callable[..., Any]:
        group = ddp.process_group
        size = dist.get_world_size(group)
        label = self._group_name(group)
        original_all_reduce = self._real_all_reduce
        rounds: list[_DdpRound] = [_DdpRound()]

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects a hook whose annotations are strings
            tensor = bucket.buffer()
            tensor.div_(size)
            if not self._active:
                fut = original_all_reduce(tensor, group=group, async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])
            current = rounds[0]
            event = self._event("all_reduce", label, [tensor], phase_="backward")
            index = len(current.events)
            current.events.append(event)
            start = time.perf_counter()
            fut = original_all_reduce(tensor, group=group, async_op=True).get_future()
            event.issue_s = time.perf_counter() - start

            def done(f: Any) -> torch.Tensor:
                current.done_at[index] = time.perf_counter()
                return f.value()[0]

            chained = fut.then(done)
            if bucket.is_last():
                # The reducer queues its finalize callback (which waits on every bucket) right after this
                # hook returns: ours runs just before it and queues one that runs just after it.
                self._ddp_rounds.append(current)
                rounds[0] = _DdpRound()
                engine = torch.autograd.Variable._execution_engine

                def before() -> None:
                    current.wait_from = time.perf_counter()
                    engine.queue_callback(current.resolve)

                engine.queue_callback(before)
            return chained

        return hook

    def _watch_ddp(self, original_forward: Callable[..., Any]) -> Callable[..., Any]:
        def forward(ddp: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
            if self._active and ddp not in self._ddp_seen:
                self._ddp_seen.add(ddp)
                if not getattr(ddp, "_comm_hooks", []) and ddp.process_group is not None:
                    ddp.register_comm_hook(None, self._ddp_hook(ddp))
            return original_forward(ddp, *args, **kwargs)

        return forward

    # -- enter / exit -------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def __enter__(self) -> CommTracer:
        self._real_all_reduce = c10d.all_reduce
        for name, input_param in TRACED_OPS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            traced = self._wrap(name, original, input_param)
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    self._patch(module, name, traced)
        functional = torch.ops._c10d_functional
        for name in FUNCTIONAL_OPS:
            if hasattr(functional, name):
                self._patch(functional, name, self._wrap_functional(name, getattr(functional, name)))
        if hasattr(functional, "wait_tensor"):
            self._patch(functional, "wait_tensor", self._wrap_wait_tensor(functional.wait_tensor))
        self._patch(DistributedDataParallel, "forward", self._watch_ddp(DistributedDataParallel.forward))
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()
        self._functional_pending.clear()
        self._resolve()

    # -- results -------------------------------------------------------------------------
    def _resolve(self) -> None:
        for r in self._ddp_rounds:
            r.resolve()
        self._ddp_rounds = [r for r in self._ddp_rounds if not r.resolved]

    def write_jsonl(self, path: str | Path) -> None:
        self._resolve()
        with open(path, "w") as fh:
            for event in self.events:
                fh.write(json.dumps(asdict(event)) + "\n")

    def blocked_s(self, steps: range | None = None) -> float:
        self._resolve()
        return sum(e.blocked_s for e in self.events if steps is None or e.step in steps)


# -- reading traces back ---------------------------------------------------------------------
