"""Fault tolerance across replica groups (FT-HSDP).

- ``lighthouse``: membership, per-step quorums (fast path, join timeout,
  split-brain guard, growing ids, incarnations), commit votes, failure
  reports, finish, the rendezvous store; an aiohttp server (``freescale
  lighthouse`` or ``Lighthouse.start_in_thread()``).
- ``client``: a rank's heartbeats (own thread; the replies say when the
  current quorum is lost) and quorum / commit requests (the committed vote
  brings the next steady quorum).
- ``replica_group``: one quorum's process group across groups: gloo over host
  buffers or NCCL over GPU buffers; bounded waits that give up when the
  lighthouse says the quorum is lost; abort, and release off the training thread.
- ``ftar``: sample-weighted all-reduce of dense tensors across the quorum's
  replicas plus an exchange hook in the same attempt; a failed collective is
  redone with the survivors in the next quorum, and a unanimous vote commits
  the step (no step discarded); drives a recovering replica's catch-up.
- ``catchup``: snapshot staging and streaming (raw bytes + JSON header).
- ``sparse_sync``: keeps torchrec embedding shards and their fused optimizer
  state identical across replicas (the union update).
- ``trainer``: one rank of a replica group training a torchrec model
  (``Trainer.fit`` with ``ft.lighthouse`` set; ``freescale launch --replicas``).
- ``mlp_replica``: a small MLP replica process (tests, ``bench_ft``).
"""

if __name__ != "freescale.ft":  # imported by its folder name, the repository root on sys.path
    raise ImportError(f"import freescale.ft, not {__name__}: ft/ is the package freescale.ft, and a "
                      "second name would load its modules twice (duplicate registries, classes that differ)")
