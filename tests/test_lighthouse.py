"""Lighthouse and client over real HTTP on 127.0.0.1: quorums, votes, health, limits."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from freescale.ft.client import LighthouseClient, LighthouseError, Quorum
from freescale.ft.lighthouse import Lighthouse, LighthouseConfig
from tests.procs import wait_for


@pytest.fixture
def lighthouse() -> Iterator[Lighthouse]:
    lh = Lighthouse(LighthouseConfig(min_replicas=2, join_timeout_s=0.3, heartbeat_timeout_s=0.3))
    lh.start_in_thread()
    yield lh
    lh.stop_thread()


def client(lh: Lighthouse, rid: str, incarnation: int = 0, member: int = 0, group_size: int = 1,
           **kwargs: object) -> LighthouseClient:
    """A started client, returned once the lighthouse has its first heartbeat (so quorum tests
    do not race a replica's start: with min_replicas=1 the first to ask would go alone)."""
    c = LighthouseClient(lh.url, rid, incarnation, member, group_size, request_timeout_s=5, **kwargs).start()
    wait_known(lh, rid, incarnation)
    return c


def wait_known(lh: Lighthouse, rid: str, incarnation: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        group = lh.groups.get(rid)
        if group is not None and group.incarnation == incarnation:
            return
        time.sleep(0.01)
    raise AssertionError(f"lighthouse never heard from {rid}/{incarnation}")


def quorums(clients: list[LighthouseClient], step: int) -> list[Quorum]:
    futures = [c.quorum_async(step) for c in clients]
    return [f.result(timeout=10) for f in futures]


def test_quorum_of_all_then_steady_steps_keep_the_id(lighthouse: Lighthouse) -> None:
    a, b = client(lighthouse, "a"), client(lighthouse, "b")
    b.store, a.store = "b-host:2", "a-host:1"  # each group's member 0 hosts a rendezvous store
    first = quorums([a, b], 0)
    assert first[0] == first[1]
    assert first[0].replica_ids == ("a", "b") and first[0].quorum_id == 1
    second = quorums([a, b], 1)
    assert second[0].quorum_id == 1 and second[0].max_step == 1
    # Steady state: each participant gets the next step's quorum at once, without waiting for the other.
    start = time.monotonic()
    third = a.quorum(2)
    assert third.quorum_id == 1 and third.max_step == 2 and time.monotonic() - start < 0.2
    # Every participant meets on the first participant's store.
    assert (second[0].store_host, second[0].store_port) == ("a-host", 1)
    for c in (a, b):
        c.close()


def test_group_joins_when_all_members_ask(lighthouse: Lighthouse) -> None:
    members = [client(lighthouse, "g0", member=m, group_size=2) for m in range(2)]
    other = client(lighthouse, "g1")
    first = members[0].quorum_async(0)
    lone = other.quorum_async(0)
    time.sleep(0.5)  # one member of g0 alone: g0 has not joined, g1 alone is below min_replicas
    assert not first.done() and not lone.done()
    second = members[1].quorum_async(0)
    q = [f.result(timeout=5) for f in (first, second, lone)]
    assert q[0] == q[1] == q[2] and q[0].replica_ids == ("g0", "g1")
    for c in [*members, other]:
        c.close()


def test_dead_replica_is_dropped_after_report_without_waiting_for_timeout() -> None:
    lh = Lighthouse(LighthouseConfig(min_replicas=1, join_timeout_s=5.0, heartbeat_timeout_s=5.0))
    lh.start_in_thread()
    a, b, c = client(lh, "a"), client(lh, "b"), client(lh, "c")
    q = quorums([a, b, c], 0)[0]
    c.close()  # c "dies": no more heartbeats (its last one counts as fresh for 5 s)
    a.report_failure(q.quorum_id)
    start = time.monotonic()
    q2 = quorums([a, b], 1)[0]
    assert q2.replica_ids == ("a", "b") and q2.quorum_id == q.quorum_id + 1
    assert time.monotonic() - start < 1.0  # the report's grace, not the 5 s heartbeat timeout
    for x in (a, b):
        x.close()
    lh.stop_thread()


def test_lone_replica_cannot_go_on_while_its_peers_may_be_alive() -> None:
    """Two of three groups stop answering quorum requests but keep heartbeating (slow, not dead):
    the third may not form a quorum alone, even after a failure report and the join timeout;
    once their heartbeats time out it may."""
    lh = Lighthouse(LighthouseConfig(min_replicas=1, join_timeout_s=0.1, heartbeat_timeout_s=1.0))
    lh.start_in_thread()
    a, b, c = client(lh, "a"), client(lh, "b"), client(lh, "c")
    q = quorums([a, b, c], 0)[0]
    a.report_failure(q.quorum_id)
    pending = a.quorum_async(1)
    time.sleep(0.6)
    assert not pending.done()
    b.close()
    c.close()
    assert pending.result(timeout=5).replica_ids == ("a",)
    a.close()
    lh.stop_thread()


def test_hung_replica_is_evicted_by_heartbeat_timeout(lighthouse: Lighthouse) -> None:
    a, b, c = client(lighthouse, "a"), client(lighthouse, "b"), client(lighthouse, "c")
    quorums([a, b, c], 0)
    c.close()  # stops heartbeating, like a SIGSTOPped process
    time.sleep(0.4)  # past the heartbeat timeout: the next step's quorum is formed without c
    q = quorums([a, b], 1)[0]
    assert q.replica_ids == ("a", "b")
    for x in (a, b):
        x.close()


def test_split_brain_guard_needs_a_majority_of_healthy_replicas() -> None:
    lh = Lighthouse(LighthouseConfig(min_replicas=1, join_timeout_s=0.2, heartbeat_timeout_s=5.0))
    lh.start_in_thread()
    clients = [client(lh, r) for r in "abcd"]
    q = quorums(clients, 0)[0]
    clients[0].report_failure(q.quorum_id)  # e.g. a partition broke the all-reduce: membership is re-decided
    time.sleep(0.2)  # heartbeats show everyone alive again
    # Two of four healthy replicas ask: not a majority, so no quorum even after the join timeout.
    pending = [c.quorum_async(1) for c in clients[:2]]
    time.sleep(0.6)
    assert not any(f.done() for f in pending)
    third = clients[2].quorum_async(1)  # three of four: a majority, forms after the join timeout
    q = [f.result(timeout=5) for f in (*pending, third)]
    assert q[0].replica_ids == ("a", "b", "c")
    for c in clients:
        c.close()
    lh.stop_thread()


def test_commit_vote_is_unanimous_and_aborts_on_a_no(lighthouse: Lighthouse) -> None:
    a, b = client(lighthouse, "a"), client(lighthouse, "b")
    q = quorums([a, b], 0)[0]
    results: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda c=c: results.__setitem__(c.replica_id, c.commit(q.quorum_id, 0, True)))
               for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == {"a": True, "b": True}
    q = quorums([a, b], 1)[0]
    threads = [threading.Thread(target=lambda c=c, ok=ok: results.__setitem__(c.replica_id, c.commit(q.quorum_id, 1, ok)))
               for c, ok in ((a, True), (b, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert results == {"a": False, "b": False}
    for c in (a, b):
        c.close()


def commit_all(clients: list[LighthouseClient], quorum_id: int, step: int) -> list[bool]:
    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(lambda c: c.commit(quorum_id, step, True), clients))


def test_committed_vote_carries_the_next_quorum_unless_a_group_waits_to_join() -> None:
    lh = Lighthouse(LighthouseConfig(min_replicas=2, join_timeout_s=0.3, heartbeat_timeout_s=2.0))
    lh.start_in_thread()
    a, b = client(lh, "a"), client(lh, "b")
    q = quorums([a, b], 0)[0]
    assert commit_all([a, b], q.quorum_id, 0) == [True, True]
    assert not a.joiner_waiting and not b.joiner_waiting
    # A third group asks to join during step 1: step 1's vote must not hand out a steady step 2, and it
    # tells the participants to stage step 1 (what the joiner will fetch: no wait for a step boundary).
    c = client(lh, "c")
    c.join_mode = "wait"  # it says so with its quorum request: the vote names it (and its ranks) as joining
    joining = c.quorum_async(0)
    time.sleep(0.1)
    q1 = quorums([a, b], 1)[0]
    assert q1.quorum_id == q.quorum_id and q1.max_step == 1
    assert commit_all([a, b], q1.quorum_id, 1) == [True, True]
    assert a.joiner_waiting and b.joiner_waiting and a.joiners == b.joiners == (("c", 1),)
    q2 = quorums([a, b], 2)
    assert q2[0] == q2[1] == joining.result(timeout=5) and q2[0].replica_ids == ("a", "b", "c")
    assert q2[0].quorum_id > q.quorum_id and q2[0].max_step == 2
    assert commit_all([a, b, c], q2[0].quorum_id, 2) == [True, True, True]
    assert not a.joiner_waiting and a.joiners == ()  # the joiner is in: nobody waits
    # Steady again: step 3's quorum came with the vote; no request is sent (the lighthouse is gone).
    lh.stop_thread()
    q3 = [cl.quorum(3) for cl in (a, b, c)]
    assert q3[0] == q3[1] == q3[2] and q3[0].quorum_id == q2[0].quorum_id and q3[0].max_step == 3
    for cl in (a, b, c):
        cl.close()


def test_vote_aborts_when_a_participant_dies_before_voting(lighthouse: Lighthouse) -> None:
    a, b = client(lighthouse, "a"), client(lighthouse, "b")
    q = quorums([a, b], 0)[0]
    b.close()
    start = time.monotonic()
    assert a.commit(q.quorum_id, 0, True) is False
    assert time.monotonic() - start < 2.0


def test_heartbeats_say_when_a_quorum_is_lost(lighthouse: Lighthouse) -> None:
    """A rank blocked in a collective learns from its heartbeat replies that a peer of the quorum
    stopped (heartbeat timeout), so it can stop waiting (``freescale.ft.replica_group``)."""
    a, b = client(lighthouse, "a"), client(lighthouse, "b")
    q = quorums([a, b], 0)[0]
    time.sleep(0.2)
    assert not a.quorum_lost(q.quorum_id) and not b.quorum_lost(q.quorum_id)
    b.close()  # a hang: no more heartbeats
    deadline = time.monotonic() + 3
    while not a.quorum_lost(q.quorum_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert a.quorum_lost(q.quorum_id), "the heartbeat timeout (0.3 s) passed and the quorum is still not lost"
    assert not a.quorum_lost(q.quorum_id + 1)
    a.close()


def test_new_incarnation_replaces_the_old_and_stale_one_is_refused(lighthouse: Lighthouse) -> None:
    a, b = client(lighthouse, "a"), client(lighthouse, "b")
    q = quorums([a, b], 0)[0]
    b2 = client(lighthouse, "b", incarnation=1)
    q2 = quorums([a, b2], 1)[0]
    assert q2.participants[1].incarnation == 1 and q2.quorum_id > q.quorum_id
    with pytest.raises(LighthouseError, match="incarnation 0 is stale"):
        b.quorum(2)
    for c in (a, b, b2):
        c.close()


def test_token_size_limit_and_bad_fields_are_refused() -> None:
    lh = Lighthouse(LighthouseConfig(token="s3cret", max_request_bytes=1024))
    lh.start_in_thread()
    url = f"{lh.url}/v1/heartbeat"
    body = {"replica_id": "a", "incarnation": 0, "member": 0, "group_size": 1}
    assert requests.post(url, json=body, timeout=5).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    assert requests.post(url, json=body, headers=auth, timeout=5).status_code == 200
    assert requests.post(url, json={**body, "pad": "x" * 4096}, headers=auth, timeout=5).status_code == 413
    bad = requests.post(url, json={**body, "member": "zero"}, headers=auth, timeout=5)
    assert bad.status_code == 400 and "member" in bad.json()["error"]
    # Steps, quorum ids, incarnations and group sizes out of range: 400 naming the field (a 500 once, or a list of
    # 10**35 members), and the server stays up.
    quorum = f"{lh.url}/v1/quorum"
    for path, field, value in ((quorum, "last_quorum_id", "abc"), (quorum, "last_quorum_id", 1e300),
                               (quorum, "step", -5), (url, "incarnation", 10**35), (url, "group_size", 10**35)):
        raw = json.dumps({**body, "step": 0, field: value}).replace("1e+300", "1e400")  # JSON's infinity
        bad = requests.post(path, data=raw, headers={**auth, "Content-Type": "application/json"}, timeout=5)
        assert bad.status_code == 400 and f"'{field}'" in bad.json()["error"], (field, value, bad.text)
    # A heartbeat's progress out of range is not taken (every later quorum id would have been past 2**53: refused).
    assert requests.post(url, json={**body, "ready": True, "quorum_id": 10**20, "step": 3}, headers=auth,
                         timeout=5).status_code == 200
    assert lh.quorum_id < 2**53 and lh.high_step < 2**53
    # A group's fail-slow report is shown by the status; a malformed one is dropped (the last good one stays).
    slow = [{"group": 2, "rank": 0, "step": 25, "share": 0.51, "host": "node7"}]
    assert requests.post(url, json={**body, "fail_slow": slow}, headers=auth, timeout=5).status_code == 200
    for malformed in ([{"group": "two"}], "slow", [{**slow[0], "share": True}]):
        assert requests.post(url, json={**body, "fail_slow": malformed}, headers=auth, timeout=5).status_code == 200
    status = requests.get(f"{lh.url}/v1/status", headers=auth, timeout=5).json()
    assert status["groups"]["a"]["fail_slow"] == slow
    lh.stop_thread()


def test_flags_out_of_range_and_an_unwritable_state_file_stop_it_before_it_serves(tmp_path: Path) -> None:
    """A port past 65535 (it wrapped to another port once), a body timeout or size limit of 0 (every request
    refused), a state file it cannot write (it served, then stopped at the first change of state): one line each."""
    for fields, said in (({"bind": "127.0.0.1:99999"}, "a port up to 65535"),
                         ({"body_timeout_s": 0.0}, "body_timeout_s"), ({"max_request_bytes": -1}, "max_request_bytes")):
        with pytest.raises(ValueError, match=said):
            LighthouseConfig(**fields).validate()  # type: ignore[arg-type]
    with pytest.raises(OSError, match="cannot write its state file /proc/freescale/state.json"):
        Lighthouse(LighthouseConfig(state_path="/proc/freescale/state.json"))  # (/proc takes no new directory)
    Lighthouse(LighthouseConfig(state_path=str(tmp_path / "new" / "state.json")))  # its directory made, nothing left
    assert [p.name for p in tmp_path.rglob("*")] == ["new"]


def test_restarted_lighthouse_keeps_quorum_ids_growing() -> None:
    cfg = LighthouseConfig(bind="127.0.0.1:0", min_replicas=2, join_timeout_s=0.2, heartbeat_timeout_s=1.0)
    lh = Lighthouse(cfg)
    lh.start_in_thread()
    port = int(lh.url.rsplit(":", 1)[1])
    a, b = client(lh, "a"), client(lh, "b")
    for step in range(3):
        quorums([a, b], step)
    a2 = client(lh, "a", incarnation=1)
    q = quorums([a2, b], 3)[0]
    seen = q.quorum_id
    lh.stop_thread()
    time.sleep(0.2)
    restarted = Lighthouse(LighthouseConfig(bind=f"127.0.0.1:{port}", min_replicas=2, join_timeout_s=0.2,
                                            heartbeat_timeout_s=1.0))
    restarted.start_in_thread()
    a.close()  # the dead incarnation 0 of a stops beating; a2 and b re-register by their heartbeats
    wait_known(restarted, "a", 1)
    wait_known(restarted, "b", 0)
    q2 = quorums([a2, b], 4)[0]
    assert q2.quorum_id > seen and q2.replica_ids == ("a", "b")
    for c in (a2, b):
        c.close()
    restarted.stop_thread()


def test_cli_lighthouse_serves_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "freescale.cli", "lighthouse", "--bind", "127.0.0.1:0",
                             "--min-replicas", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "lighthouse: serving http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.stderr else "")
        url = line.split("serving ")[1].split(" ")[0]
        assert requests.get(f"{url}/v1/status", timeout=5).json()["quorum_id"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_group_with_one_silent_member_is_unhealthy() -> None:
    """A group fails as a whole: a member that stops heartbeating (dead or hung rank) makes its
    group unhealthy even though the other member's heartbeat thread keeps beating."""
    lh = Lighthouse(LighthouseConfig(min_replicas=1, heartbeat_timeout_s=1.0))
    lh.start_in_thread()
    g0 = [client(lh, "g0", member=m, group_size=2) for m in range(2)]
    deadline = time.monotonic() + 5
    while not lh.groups["g0"].healthy(time.monotonic(), 1.0) and time.monotonic() < deadline:
        time.sleep(0.01)  # until both members' first heartbeats are in
    assert lh.groups["g0"].healthy(time.monotonic(), 1.0)
    g0[1].close()
    time.sleep(1.3)
    group = lh.groups["g0"]
    assert time.monotonic() - group.beats[0] < 1.0, "member 0 keeps beating"
    assert g0[0].status()["groups"]["g0"]["healthy"] is False
    g0[0].close()
    lh.stop_thread()


def test_finished_run_turns_late_joiners_away(lighthouse: Lighthouse) -> None:
    """Once a group reports the run finished, a restarted group asking for a quorum is told so
    instead of forming a quorum of its own at step 0 (it would train alone from scratch)."""
    from freescale.ft.client import JobFinished

    a, b = client(lighthouse, "a"), client(lighthouse, "b")
    quorums([a, b], 0)
    a.finish(0)
    late = client(lighthouse, "c")
    with pytest.raises(JobFinished):
        late.quorum(0)
    for c in (a, b, late):
        c.close()


def test_group_behind_the_runs_progress_waits_for_its_holders_then_is_refused() -> None:
    """A group at an earlier step cannot form a quorum by itself once a step was reached: while the
    group holding that progress may still be alive (silent: hung, stopped, cut off) it waits, told
    why; once that group is gone for good (a newer incarnation replaced it) it is refused."""
    lh = Lighthouse(LighthouseConfig(min_replicas=1, join_timeout_s=0.1, heartbeat_timeout_s=0.3))
    lh.start_in_thread()
    a = client(lh, "a")
    for step in range(3):
        assert a.commit(a.quorum(step).quorum_id, step, True)  # a commits: it holds the run's progress
    a.close()
    time.sleep(0.4)  # a's heartbeat times out: silent, but it may be alive
    b = client(lh, "b")
    pending = b.quorum_async(0)
    deadline = time.monotonic() + 5
    while not b.waiting_reason and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "waiting for replica group(s) a" in b.waiting_reason and not pending.done()
    assert "commit steps twice" in b.status()["blocked"]
    a_again = client(lh, "a", incarnation=1)  # a restarted: the incarnation that held the progress is gone
    with pytest.raises(LighthouseError, match="every replica group that held the run's progress"):
        pending.result(timeout=5)
    for c in (a_again, b):
        c.close()
    lh.stop_thread()


def test_lighthouse_serves_one_run_at_a_time_then_the_next() -> None:
    """A second run is refused while the first is going, and served once the first finished
    (its state forgotten: no 'finished' answer, no stale incarnations; quorum ids keep growing)."""
    lh = Lighthouse(LighthouseConfig(min_replicas=1, heartbeat_timeout_s=1.0))
    lh.start_in_thread()
    first = LighthouseClient(lh.url, "replica0", 3, run_id="run-1", request_timeout_s=5).start()
    wait_known(lh, "replica0", 3)
    q1 = first.quorum(0)
    intruder = LighthouseClient(lh.url, "replica0", 0, run_id="run-2", request_timeout_s=5)
    with pytest.raises(LighthouseError, match="serves run 'run-1', which is still going"):
        intruder.quorum(0)
    first.finish(0)
    second = LighthouseClient(lh.url, "replica0", 0, run_id="run-2", request_timeout_s=5).start()
    q2 = second.quorum(0)
    assert q2.quorum_id > q1.quorum_id and q2.replica_ids == ("replica0",)
    for c in (first, second):
        c.close()
    lh.stop_thread()


def test_restarted_lighthouse_restores_its_facts_from_the_state_file(tmp_path: Path) -> None:
    """With a state file, a restarted lighthouse keeps the run, the quorum id, the step reached and
    the holders: a group restarted meanwhile (new incarnation, at step 0) joins the holder at its
    step (and will catch up), in a quorum with a larger id; the file is what ``freescale.ft.durable``
    writes, and a file that is not is refused in one line naming it."""
    from freescale.ft import durable

    state = tmp_path / "lh.json"
    cfg = dict(min_replicas=1, join_timeout_s=0.2, heartbeat_timeout_s=1.0, state_path=str(state))
    lh = Lighthouse(LighthouseConfig(**cfg))
    lh.start_in_thread()
    port = int(lh.url.rsplit(":", 1)[1])
    a, b = client(lh, "a"), client(lh, "b")
    for step in range(3):
        seen = quorums([a, b], step)[0]
        with ThreadPoolExecutor(2) as pool:  # both commit: both hold the run's progress
            assert all(pool.map(lambda c: c.commit(seen.quorum_id, step, True), (a, b)))
    lh.stop_thread()
    saved = durable.load(state)
    # The last committed vote's reply carried step 3's steady quorum: the run reached step 3.
    assert saved is not None and saved.holders == {"a": 0, "b": 0} and saved.high_step == 3
    restarted = Lighthouse(LighthouseConfig(**{**cfg, "bind": f"127.0.0.1:{port}"}))
    restarted.start_in_thread()
    status = b.status()
    assert status["restored"] and status["settled"] and status["high_step"] == 3
    a.close()
    a2 = client(restarted, "a", incarnation=1)  # restarted: it holds no progress
    b.forget_next()  # the dead lighthouse's answer for step 3 (a vote in it would be told "superseded")
    pending = [a2.quorum_async(0), b.quorum_async(3)]
    q = pending[0].result(timeout=10)
    assert q == pending[1].result(timeout=10)
    assert q.quorum_id > seen.quorum_id and q.replica_ids == ("a", "b")
    assert q.max_step == 3 and {p.replica_id: p.step for p in q.participants} == {"a": 0, "b": 3}
    for c in (a2, b):
        c.close()
    restarted.stop_thread()
    state.write_text('{"format": "something else"}')
    with pytest.raises(durable.StateFileError, match=f"{state}: not a lighthouse state file"):
        Lighthouse(LighthouseConfig(**cfg))


def test_a_body_that_never_arrives_is_answered_408_and_the_server_stays_up(caplog: pytest.LogCaptureFixture) -> None:
    """A body that never arrives: 408 after the body timeout.  A header aiohttp cannot parse: 400, and one line on
    the server's console (aiohttp's traceback before)."""
    import socket

    lh = Lighthouse(LighthouseConfig(body_timeout_s=0.3))
    lh.start_in_thread()
    host, port = lh.url[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"rep")
        start = time.monotonic()
        answer = sock.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and time.monotonic() - start < 3, answer
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        assert sock.recv(4096).decode().startswith("HTTP/1.0 400")
    assert wait_for(lambda: any(r.name == "aiohttp.server" for r in caplog.records), 5), "aiohttp logged nothing"
    said = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert said and all(r.exc_info is None and "answered 400 (Invalid character" in r.getMessage() for r in said), said
    assert requests.get(f"{lh.url}/v1/status", timeout=5).status_code == 200
    lh.stop_thread()


def test_a_forgetful_lighthouse_forms_no_quorum_before_it_settles() -> None:
    """Without a state file a (re)started lighthouse waits ``settle_s`` before its first quorum, even
    when a heartbeat has already told it of a holder: the other live groups re-register first, and
    their reports (quorum, next step, ready) rebuild the holders and the step the run reached."""
    lh = Lighthouse(LighthouseConfig(min_replicas=1, heartbeat_timeout_s=1.0, settle_s=0.6))
    lh.start_in_thread()
    a = LighthouseClient(lh.url, "a", 0, request_timeout_s=5)
    a.progress = {"quorum_id": 7, "step": 40, "ready": True}  # what a rank of a running job reports
    a.start()
    q = a.quorum(40)
    assert time.monotonic() - lh.started >= 0.6, "a quorum formed before the lighthouse settled"
    assert q.quorum_id > 7 and lh.holders == {"a": 0} and lh.high_step == 40
    a.close()
    lh.stop_thread()


def test_the_lighthouse_process_collects_garbage_only_while_no_answer_waits(lighthouse: Lighthouse) -> None:
    """``freescale lighthouse`` takes Python's collector over (``ft/quiet_gc.py``): no full collection on its own,
    one at a quiet moment (no vote undecided, no request being answered), what is left frozen; a cycle that
    was frozen alive and dropped since is gone after the next quiet collection; one the lighthouse is never quiet
    for is collected anyway after ``FORCE_AFTER`` periods."""
    import gc

    from freescale.ft import quiet_gc

    if quiet_gc.INCREMENTAL:
        pytest.skip("Python's collector is incremental here: the lighthouse leaves it alone")
    freed: list[int] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            freed.append(1)

    threshold = gc.get_threshold()
    collector = quiet_gc.QuietCollector(every_s=0.05)
    try:
        cycle = Cycle()
        collector.take_over()  # collects, then freezes the live cycle with the rest
        assert gc.get_threshold()[2] > 1 << 20 and gc.get_freeze_count() > 0 and collector.collections == 1
        gc.disable()  # (no young collection may take the cycle below before the collector's own)
        del cycle
        time.sleep(0.06)
        collector.tick(quiet=False)
        assert freed == [] and collector.collections == 1  # an answer waits: no pause
        collector.tick(quiet=True)
        assert freed == [1] and collector.collections == 2  # the frozen cycle too
        Cycle()
        time.sleep(0.05 * quiet_gc.FORCE_AFTER + 0.01)
        collector.tick(quiet=False)
        assert freed == [1, 1] and collector.collections == 3  # never quiet: collected anyway
        assert lighthouse.quiet() and lighthouse.answering == 0  # nothing open on a lighthouse nobody talks to
    finally:
        gc.enable()
        gc.unfreeze()
        gc.set_threshold(*threshold)
