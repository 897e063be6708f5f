"""The group agent (``freescale.ft.group_agent``) between a group's members and a real lighthouse,
over real HTTP on 127.0.0.1: one voice per group, nothing about a member lost on the way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from freescale.ft.client import LighthouseClient, LighthouseError
from freescale.ft.group_agent import GroupAgent
from freescale.ft.lighthouse import Lighthouse, LighthouseConfig
from freescale.ft.serving import LoopThread


class _Counted(Lighthouse):
    """A lighthouse that records who sends it ballots."""

    def __init__(self, cfg: LighthouseConfig) -> None:
        super().__init__(cfg)
        self.callers: list[tuple[str, int, bool]] = []

    def cast_ballot(self, body, known=None):  # type: ignore[no-untyped-def]
        self.callers.append((str(body.get("replica_id")), int(body.get("member", -1)), body.get("agent") is True))
        return super().cast_ballot(body, known)


@pytest.fixture
def lighthouse() -> Iterator[_Counted]:
    lh = _Counted(LighthouseConfig(min_replicas=2, join_timeout_s=5, heartbeat_timeout_s=0.4))
    lh.start_in_thread()
    yield lh
    lh.stop_thread()


def agent_for(lh: Lighthouse, rid: str, size: int) -> tuple[GroupAgent, LoopThread]:
    agent, thread = GroupAgent(lh.url, rid, 0, size), LoopThread(f"agent-{rid}")
    thread.run(agent.start, agent.stop)
    return agent, thread


def members(url: str, rid: str, size: int) -> list[LighthouseClient]:
    return [LighthouseClient(url, rid, 0, member=m, group_size=size, request_timeout_s=5).start() for m in range(size)]


def wait_for(condition, what: str, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_one_voice_per_group_for_quorum_and_vote(lighthouse: _Counted) -> None:
    agent, thread = agent_for(lighthouse, "g0", 3)
    group = members(agent.url, "g0", 3)
    lone = LighthouseClient(lighthouse.url, "g1", 0, request_timeout_s=5).start()
    wait_for(lambda: {"g0", "g1"} <= set(lighthouse._healthy(time.monotonic())), "both groups healthy")
    for c, address in zip(group, ("a0", "a1", "a2")):
        c.address = address
    asked = [group[0].quorum_async(0), lone.quorum_async(0), group[1].quorum_async(0)]
    time.sleep(0.3)  # two of g0's three members asked: the group has not joined
    assert not any(f.done() for f in asked)
    asked.append(group[2].quorum_async(0))
    quorums = [f.result(timeout=5) for f in asked]
    assert len({q.quorum_id for q in quorums}) == 1 and quorums[0].replica_ids == ("g0", "g1")
    assert quorums[0].participants[0].addresses == ("a0", "a1", "a2")  # every member's snapshot server
    q = quorums[0]
    lighthouse.callers.clear()
    votes = [c.commit_async(q.quorum_id, 0, True) for c in [*group, lone]]
    assert all(v() for v in votes)
    g0_ballots = [c for c in lighthouse.callers if c[0] == "g0"]
    assert g0_ballots == [("g0", 0, True)], "g0's three ballots reached the lighthouse as one"
    # A no from one member fails the step at once, for every member. (Every member asks for step 1's
    # quorum: the vote's reply carries it only while every group's heartbeat is fresh, which a loaded
    # machine can break; then the agent's request waits for all three members.)
    asked = [c.quorum_async(1) for c in [*group, lone]]
    q1 = [f.result(timeout=5) for f in asked][0]
    no = group[1].commit_async(q1.quorum_id, 1, False)
    assert no() is False
    assert group[0].commit(q1.quorum_id, 1, True) is False and lone.commit(q1.quorum_id, 1, True) is False
    for c in [*group, lone]:
        c.close()
    thread.stop()


def test_a_silent_member_makes_its_group_unhealthy_and_a_lost_one_is_told_at_once(lighthouse: _Counted) -> None:
    agent, thread = agent_for(lighthouse, "g0", 2)
    first = LighthouseClient(agent.url, "g0", 0, member=0, group_size=2, request_timeout_s=5).start()
    second = LighthouseClient(agent.url, "g0", 0, member=1, group_size=2, request_timeout_s=5)
    assert second._request("POST", "/v1/heartbeat", {})["ok"]  # one beat, then silence (a hung member)
    wait_for(lambda: "g0" in lighthouse._healthy(time.monotonic()), "g0 healthy")
    wait_for(lambda: "g0" not in lighthouse._healthy(time.monotonic()), "g0 unhealthy once member 1 is silent")
    assert first._lighthouse_quorum is not None
    # A member whose process ends closes its presence connection: the lighthouse hears it within a beat.
    third = LighthouseClient(agent.url, "g0", 0, member=1, group_size=2, request_timeout_s=5).start()
    wait_for(lambda: "g0" in lighthouse._healthy(time.monotonic()), "g0 healthy again")
    assert not lighthouse.groups["g0"].presence_lost
    waiting = first.quorum_async(0)  # held for member 1, which is about to die
    time.sleep(0.1)
    third.close()
    wait_for(lambda: lighthouse.groups["g0"].presence_lost, "the lost member reported", timeout_s=1.0)
    # Its peer is not left waiting for it: one line, worded as a peer's failure (``rank_console``).
    with pytest.raises(LighthouseError, match="replica group: member 1 of 'g0' is gone"):
        waiting.result(timeout=2)
    first.close()
    thread.stop()


def test_members_of_another_group_are_refused_in_one_line(lighthouse: _Counted) -> None:
    agent, thread = agent_for(lighthouse, "g0", 2)
    stranger = LighthouseClient(agent.url, "g7", 0, member=0, group_size=2, request_timeout_s=2)
    with pytest.raises(Exception, match="group agent of replica 'g0'.*not of 'g7'"):
        stranger.quorum(0)
    thread.stop()


def test_the_agent_process_serves_and_exits_when_member_0_is_killed(lighthouse: _Counted) -> None:
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from freescale.ft.agent_process import start_agent\n"
        f"a = start_agent({lighthouse.url!r}, 'g0', 0, 2, '127.0.0.1', '127.0.0.1')\n"
        "print(a.wait_url(), a.proc.pid, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    url, pid = parent.stdout.readline().split()
    status = LighthouseClient(url, "g0", 0, member=1, group_size=2, request_timeout_s=5).status()
    assert "groups" in status  # passed through to the lighthouse
    wait_for(lambda: "g0" in lighthouse.groups, "the agent's heartbeats")
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(int(pid)), "the agent's exit", timeout_s=3.0)
    wait_for(lambda: lighthouse.groups["g0"].presence_lost, "its presence connection closed", timeout_s=2.0)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_bad_agent_fields_are_refused_with_the_field_named(lighthouse: _Counted) -> None:
    import requests

    who = {"replica_id": "g0", "incarnation": 0, "member": 0, "group_size": 2, "agent": True}
    for body, field in (({"member_ages_s": [0.1]}, "member_ages_s"), ({"members_lost": [5]}, "members_lost")):
        answer = requests.post(f"{lighthouse.url}/v1/heartbeat", data=json.dumps({**who, **body}), timeout=5)
        assert answer.status_code == 400 and field in answer.json()["error"]
    answer = requests.post(f"{lighthouse.url}/v1/status", timeout=5)
    assert answer.status_code == 405


def test_a_stopping_agent_serves_the_other_members_until_they_close(lighthouse: _Counted) -> None:
    """Member 0 is done first and stops its group's agent: the agent keeps serving the members
    still finishing (their ``finish`` goes through it) until they close their clients."""
    import threading

    from freescale.ft.agent_process import start_agent

    agent = start_agent(lighthouse.url, "g0", 0, 2, "127.0.0.1", "127.0.0.1")
    first, second = members(agent.wait_url(), "g0", 2)
    wait_for(lambda: "g0" in lighthouse._healthy(time.monotonic()), "g0 healthy")
    first.close()
    stopping = threading.Thread(target=agent.stop)
    stopping.start()
    time.sleep(0.3)
    assert stopping.is_alive(), "the agent stopped while member 1 was still using it"
    second.finish(7)  # served: the run is marked finished at the lighthouse
    assert lighthouse.finished_step == 7
    closed = time.monotonic()
    second.close()
    stopping.join(timeout=5)
    assert not stopping.is_alive() and time.monotonic() - closed < 2.0
    assert agent.proc.poll() is not None


def test_ballots_on_agent_links_are_answered_together_and_none_is_left_waiting(lighthouse: _Counted) -> None:
    """The lighthouse holds each agent link's ballot on its vote and answers them all in one pass once the vote
    is decided (``Lighthouse._answer_links``): every link gets its own answer by id; a link that closes while
    its counted ballot waits is skipped; one answer failing (a bug) costs that answer a 500, not the others' nor
    the link; nothing is left counted as waiting."""
    import asyncio

    import aiohttp

    class Link:  # an agent's link without its members: heartbeats, and answers matched to requests by id
        def __init__(self, link: aiohttp.ClientWebSocketResponse) -> None:
            self.link, self.made, self.calls = link, 0, {}  # type: ignore[var-annotated]
            self.tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._beat())]

        async def _read(self) -> None:
            async for message in self.link:
                header, _, answer = message.data.partition("\n")
                head = json.loads(header)
                self.calls.pop(head["id"]).set_result((head["status"], json.loads(answer)))

        async def _beat(self) -> None:
            while True:
                await self.ask("heartbeat", {"member_ages_s": [0.0, 0.0]})
                await asyncio.sleep(0.05)

        async def ask(self, op: str, body: dict, status_expected: int = 200) -> dict:  # type: ignore[type-arg]
            self.made += 1
            self.calls[self.made] = answer = asyncio.get_running_loop().create_future()
            await self.link.send_str(json.dumps({"id": self.made, "op": op, "body": body}))
            status, payload = await asyncio.wait_for(answer, 5)
            assert status == status_expected, payload
            return payload  # type: ignore[no-any-return]

        async def close(self) -> None:
            for task in self.tasks:
                task.cancel()
            await self.link.close()

    def ballot(step: int, quorum_id: int) -> dict:  # type: ignore[type-arg]
        return {"quorum_id": quorum_id, "step": step, "ok": True, "members": [0, 1]}

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            links = []
            for g in range(3):
                raw = await session.ws_connect(f"{lighthouse.url}/v1/agent")
                await raw.send_str(json.dumps({"id": 0, "op": "hello", "body": {
                    "replica_id": f"g{g}", "incarnation": 0, "member": 0, "group_size": 2, "agent": True}}))
                assert (await raw.receive_str()).startswith('{"id": 0, "status": 200}')
                links.append(Link(raw))
            asks = [{"step": 0, "members": [{"step": 0, "address": f"h{g}:{m}"} for m in range(2)]} for g in range(3)]
            quorum = await asyncio.gather(*(link.ask("quorum", a) for link, a in zip(links, asks)))
            assert len(quorum[0]["participants"]) == 3
            answers = await asyncio.gather(*(link.ask("commit", ballot(0, quorum[0]["quorum_id"])) for link in links))
            assert [a["commit"] for a in answers] == [True] * 3
            asks = [{**a, "step": 1, "members": [{**m, "step": 1} for m in a["members"]]} for a in asks]
            quorum = await asyncio.gather(*(link.ask("quorum", a) for link, a in zip(links, asks)))
            waiting = [asyncio.ensure_future(link.ask("commit", ballot(1, quorum[0]["quorum_id"]), status))
                       for link, status in zip(links[:2], (500, 200))]
            deadline = time.monotonic() + 5
            while lighthouse.answering < 2:  # both ballots held on the open vote
                assert time.monotonic() < deadline, "the ballots never reached the lighthouse"
                await asyncio.sleep(0.01)
            assert not any(w.done() for w in waiting)
            waiting[1].cancel()
            await links[1].close()  # g1's agent is gone after its ballot was counted: that ballot is not answered
            answer_of = lighthouse.vote_answer

            def failing_for_g0(vote, group):  # type: ignore[no-untyped-def]  # a bug answering one held ballot
                if group.replica_id == "g0":
                    raise RuntimeError("a bug")
                return answer_of(vote, group)

            lighthouse.vote_answer = failing_for_g0  # type: ignore[method-assign]
            try:  # g2's ballot decides; g0's answer fails (500, its link stays), g2's goes out all the same
                last = await links[2].ask("commit", ballot(1, quorum[0]["quorum_id"]))
                assert last["commit"] is True and "failed" in (await waiting[0])["error"]
            finally:
                del lighthouse.vote_answer
            assert not links[0].link.closed
            while lighthouse.answering:
                assert time.monotonic() < deadline, f"{lighthouse.answering} answers still counted as waiting"
                await asyncio.sleep(0.01)
            for link in (links[0], links[2]):
                await link.close()

    asyncio.run(asyncio.wait_for(run(), 20))
    wait_for(lambda: lighthouse.quiet() and not lighthouse._answering_links, "the vote's answering task to end")
