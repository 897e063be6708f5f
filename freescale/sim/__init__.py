"""ETTR simulator: what fault tolerance buys at a scale we cannot run (``freescale simulate``).

- ``params``: the cluster and its failures (``Cluster``), a policy's reactions (``Policy``)
- ``trace``: a seeded failure trace shared by the policies compared
- ``engine``: the discrete-event simulation (``simulate`` -> ``Outcome``)
- ``closed_form``: expected ETTR per policy, and the published accountings
- ``gates``: validation against published figures, run before any projection
- ``project``: parameters from this repository's benchmark results, each with its source;
  the projection at 1K-100K GPUs and its plot
"""
