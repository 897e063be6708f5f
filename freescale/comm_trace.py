"""Record the collectives a training step issues: order, size, phase and time blocked.

``CommTracer`` wraps ``torch.distributed.all_to_all_single`` and
``all_reduce`` (torchrec's embedding all-to-alls and our dense reducer call
them through the module attribute, so one patch sees both) while it is active.
Each call becomes a :class:`CommEvent`: which op, which process group (by the
label it was registered under), how many bytes, which phase of the step
(forward / backward, set by the pipeline), when it was issued and how long the
training thread was blocked waiting for it.  The pipeline tests read the issue
order from these events; ``bench_pipeline`` reads the blocked time ("exposed
communication" as the training thread sees it).

Tracing costs a Python wrapper per collective; it is off unless a tracer is
entered (benchmarks and tests only).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

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
    completed_in_wait: bool = False


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _CompletedWork(dist.Work):
    """What a skipped collective returns: already done."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Any:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(None)
        return future

    def synchronize(self) -> None:
        return None


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


class CommTracer:
    """Context manager; ``events`` lists every traced collective, ``step`` tags them.

    ``skip_float=True`` is the benchmark's "communication replaced by no-ops of
    the same shapes" (DESIGN.md, exposed communication): collectives on
    floating-point tensors (embeddings out, their gradients back, dense
    gradients) return at once, leaving the caller-allocated outputs zeroed;
    integer ones (ids, lengths, split sizes: they decide the shapes) still run.
    Training numbers are meaningless in that mode; step times are what it is for.
    """

    def __init__(self, skip_float: bool = False) -> None:
        self.skip_float = skip_float
        self.events: list[CommEvent] = []
        self.step = 0
        self._labels: dict[int, str] = {}
        self._originals: dict[str, Any] = {}

    def label(self, group: Any, name: str) -> None:
        self._labels[id(group)] = name

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

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as fh:
            for event in self.events:
                fh.write(json.dumps(asdict(event)) + "\n")

    def _group_name(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return self._labels.get(id(dist.GroupMember.WORLD), "world")
        return self._labels.get(id(group), "other")

    def _wrap(self, name: str, size_of: Any, skippable: Any) -> Any:
        original = getattr(dist, name)

        def traced(*args: Any, **kwargs: Any) -> Any:
            if self.skip_float and skippable(*args, **kwargs):
                return _CompletedWork() if kwargs.get("async_op") else None
            group = kwargs.get("group")
            event = CommEvent(name, self._group_name(group), size_of(*args, **kwargs), current_phase(),
                              current_source(), self.step, time.perf_counter())
            self.events.append(event)
            if kwargs.get("async_op"):
                return _TracedWork(original(*args, **kwargs), event)
            start = time.perf_counter()
            result = original(*args, **kwargs)
            event.blocked_s = time.perf_counter() - start
            event.completed_in_wait = True
            return result

        self._originals[name] = original
        return traced

    def __enter__(self) -> CommTracer:
        def skip_a2a(output: torch.Tensor, input: torch.Tensor, *a: Any, **k: Any) -> bool:
            if _is_float(input):
                output.zero_()
                return True
            return False

        dist.all_to_all_single = self._wrap(
            "all_to_all_single", lambda output, input, *a, **k: _nbytes(input), skip_a2a
        )
        dist.all_reduce = self._wrap(
            "all_reduce", lambda tensor, *a, **k: _nbytes(tensor), lambda tensor, *a, **k: _is_float(tensor)
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def blocked_s(self, steps: range | None = None) -> float:
        return sum(e.blocked_s for e in self.events if steps is None or e.step in steps)
