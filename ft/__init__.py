"""Fault tolerance across replica groups (FT-HSDP).

Built so far:

- ``lighthouse``: membership, per-step quorums (fast path, join timeout,
  split-brain guard, growing ids, incarnations), commit votes, failure
  reports, the rendezvous store; an aiohttp server (``freescale lighthouse``
  or ``Lighthouse.start_in_thread()``).
- ``client``: a rank's heartbeats (own thread) and quorum / commit requests.
- ``ftar``: sample-weighted all-reduce of dense tensors across the quorum's
  replicas; a failed collective is redone with the survivors in the next
  quorum, and a unanimous vote commits the step (no step discarded).

Not built yet: wiring into ``Trainer`` for torchrec models (embedding shards
kept identical across replicas), replica restart through the local launcher,
non-blocking catch-up of a recovering replica, and ``bench_ft.py``.  A replica
that finds the quorum ahead of its own step says so and stops.
"""
