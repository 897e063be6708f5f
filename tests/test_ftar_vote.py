"""``ReplicaSync``'s vote with the update built while it is in flight, through a failed vote.

Two replicas in one process (a thread each, gloo over loopback, a real lighthouse in a thread),
each with a counting ``Exchange``.  At step 0 both reduce and exchange; replica b then stops
before voting (its heartbeats too), so a's vote fails once b's heartbeat times out: a must put
back the update it prepared during that vote, exactly once, redo the step alone, and hand the
update it prepared for the committed attempt to the caller.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from freescale.ft.client import LighthouseClient, Quorum
from freescale.ft.ftar import ReplicaSync
from freescale.ft.lighthouse import Lighthouse, LighthouseConfig
from freescale.testing import StepHooks


class _CountingExchange:
    def __init__(self) -> None:
        self.prepared: list[int] = []
        self.discarded: list[int] = []

    def header(self) -> torch.Tensor:
        return torch.tensor([3], dtype=torch.int64)

    def __call__(self, group: Any, quorum: Quorum, weights: list[float], headers: list[torch.Tensor],
                 ready: list[bool]) -> int:
        return quorum.quorum_id

    def prepare(self, exchanged: int) -> int:
        self.prepared.append(exchanged)
        return len(self.prepared)

    def discard(self, prepared: int) -> None:
        self.discarded.append(prepared)


class _StopsBeforeVoting(StepHooks):
    """Replica b: at the vote of step 0 its heartbeats stop and its thread ends (a silent death)."""

    def __init__(self, client: LighthouseClient) -> None:
        self.client = client

    def at(self, point: str, step: int) -> None:
        if point == "vote":
            self.client.close()
            raise SystemExit  # ends the thread before the vote is sent


def test_failed_vote_puts_the_prepared_update_back_once_and_the_redo_commits_alone() -> None:
    lighthouse = Lighthouse(LighthouseConfig(min_replicas=1, heartbeat_timeout_s=1.0, join_timeout_s=0.2))
    url = lighthouse.start_in_thread()
    clients = {rid: LighthouseClient(url, rid, 0, heartbeat_interval_s=0.02).start() for rid in ("a", "b")}
    exchanges = {rid: _CountingExchange() for rid in clients}
    syncs = {rid: ReplicaSync(client, timeout_s=5.0, hooks=_StopsBeforeVoting(client) if rid == "b" else None)
             for rid, client in clients.items()}
    results: dict[str, Any] = {}

    def run(rid: str) -> None:
        sync = syncs[rid]
        sync.start_step(0)
        grads = [torch.full((4,), 1.0 if rid == "a" else 3.0)]
        results[rid] = sync.reduce_and_commit(0, grads, weight=1.0, exchange=exchanges[rid])

    try:
        threads = [threading.Thread(target=run, args=(rid,), daemon=True) for rid in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert "b" not in results and "a" in results, "replica a did not commit step 0"
        result, a = results["a"], exchanges["a"]
        assert result.attempts == 2 and result.quorum.replica_ids == ("a",)
        assert len(a.prepared) == 2 and a.prepared[1] == result.quorum.quorum_id  # one per attempt
        assert a.discarded == [1], "the update built during the failed vote was not put back exactly once"
        assert result.prepared == 2 and result.discarded == 1, "the caller must get the committed attempt's update"
        assert torch.equal(result.tensors[0], torch.full((4,), 1.0)), "the redo averages a's gradients alone"
        assert exchanges["b"].prepared == []
    finally:
        for client in clients.values():
            client.close()
        lighthouse.stop_thread()
