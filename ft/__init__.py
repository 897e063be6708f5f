"""Fault tolerance across replica groups (FT-HSDP), as a layer over any training loop.

The surface a user's own loop needs (docs/fault-tolerance.md "Your own loop"): ``shard`` (torchrec's planner with
fused, model-parallel tables, or data_parallel ones where asked, no DDP), ``StepSamples`` (which samples each group and rank trains),
``wrap`` (the optimizer, fault tolerant: ``steps``, ``zero_grad``, ``step``), ``FTConfig.from_env``
and ``ENVIRONMENT`` (what ``freescale launch`` sets), ``init_process_group`` (restart-safe under bare
torchrun), ``Commit``, ``JobFinished``, ``DataState`` (the protocol of a data side of one's own).

- ``wrapper``: ``wrap`` / ``FaultTolerantOptimizer``, the wrapper form over ``FaultTolerance``
  (``examples/deepfm_ft.py``).
- ``samples``: ``StepSamples``, the data side for a stream of sample ids.
- ``layer``: ``FaultTolerance``, the object a loop calls at four points
  (``begin_step``, ``can_train``, ``backward``, ``step``): freescale's own
  step engine (``freescale.trainer``, every pipeline), the wrapper, and a
  loop written that way (``examples/user_loop_ft.py``) alike.
- ``snapshot_state``: what a snapshot carries beyond the model and optimizers.
- ``lighthouse``: membership, per-step quorums (fast path, join timeout,
  split-brain guard, growing ids, incarnations), commit votes, failure
  reports, finish; an aiohttp server (``freescale lighthouse`` or
  ``Lighthouse.start_in_thread()``).
- ``lighthouse_ops``: each request's operation over the membership rules
  (``membership``) and the durable facts (``durable``), whatever carries it.
- ``group_agent``: a group's one voice to the lighthouse (a process member 0
  starts): its members speak the lighthouse's HTTP API to it, it speaks for
  them over one WebSocket, so the lighthouse's load grows with groups;
  ``agent_process``: the agent as a process (started, drained, stopped).
- ``membership`` / ``membership_records``: the lighthouse's rules, and the
  records of groups, joins and votes they read.
- ``client``: a rank's heartbeats (own thread; the replies say when the
  current quorum is lost) and quorum / commit requests (the committed vote
  brings the next steady quorum); one request path with backoff, http(s).
- ``replica_group``: one quorum's process group across groups: gloo over host
  buffers or NCCL over GPU buffers; bounded waits that give up when the
  lighthouse says the quorum is lost; abort, and release off the training thread.
- ``ftar``: the sample-weighted all-reduce of dense gradients across the
  quorum's replicas (its cross-group stage rides ``freescale.grad_buckets``
  during backward), an exchange in the same attempt, the vote; a failed
  collective is redone with the survivors (no step discarded); a recovering
  replica's record of the steps it sits out.
- ``catchup``: snapshot staging and streaming (raw bytes + JSON header), the download.
- ``embedding_sync``: how the embedding tables stay in step across groups, one
  strategy chosen once: ``union`` (``sparse_sync``: every group applies every
  group's row gradients), ``average`` (``sparse_average``: a slice of the tables
  averaged per step) or ``replicated`` (no fused tables).
- ``config``: the ``[ft]`` section.
"""

if __name__ != "freescale.ft":  # imported by its folder name, the repository root on sys.path
    raise ImportError(f"import freescale.ft, not {__name__}: ft/ is the package freescale.ft, and a "
                      "second name would load its modules twice (duplicate registries, classes that differ)")

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freescale.distributed import init_process_group
    from freescale.ft.config import ENVIRONMENT, FTConfig, incarnation
    from freescale.ft.layer import FaultTolerance
    from freescale.ft.samples import StepSamples
    from freescale.ft.wrapper import FaultTolerantOptimizer, wrap
    from freescale.parallelize import shard_fused as shard
    from freescale.step_types import Commit, DataState, JobFinished, NonFiniteError

_LAZY = {"FTConfig": "freescale.ft.config", "DataState": "freescale.step_types", "FaultTolerance": "freescale.ft.layer",
         "Commit": "freescale.step_types", "JobFinished": "freescale.step_types", "NonFiniteError": "freescale.step_types",
         "StepSamples": "freescale.ft.samples", "wrap": "freescale.ft.wrapper",
         "FaultTolerantOptimizer": "freescale.ft.wrapper", "shard": "freescale.parallelize",
         "init_process_group": "freescale.distributed", "ENVIRONMENT": "freescale.ft.config",
         "incarnation": "freescale.ft.config"}
_RENAMED = {"shard": "shard_fused"}


def __getattr__(name: str) -> Any:
    # Lazy: ``freescale.ft.lighthouse`` (``freescale lighthouse``) must start without importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), _RENAMED.get(name, name))
    raise AttributeError(f"module 'freescale.ft' has no attribute {name!r}")


__all__ = ["ENVIRONMENT", "Commit", "DataState", "FTConfig", "FaultTolerance", "FaultTolerantOptimizer", "JobFinished",
           "NonFiniteError", "StepSamples", "incarnation", "init_process_group", "shard", "wrap"]
