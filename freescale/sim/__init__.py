"""ETTR simulator: what fault tolerance buys at a scale we cannot run (``freescale simulate``).

- ``params``: the cluster and its failures (``Cluster``), a policy's reactions (``Policy``)
- ``trace``: a seeded failure trace shared by the policies compared
- ``engine``: the discrete-event simulation (``simulate`` -> ``Outcome``)
- ``closed_form``: expected ETTR per policy, and the published accountings
- ``gates``: validation against published figures, run before any projection
- ``project``: parameters from this repository's benchmark results, code defaults and labelled
  assumptions, each with its source; the projection at 1K-98K GPUs
- ``command``: ``freescale simulate`` and the bench's shared steps (inputs and scenarios checked,
  gates, then results)
- ``plot``: ETTR against GPU count, throughput over time (matplotlib)
"""
