"""The snapshot path in one process: live serving and staging off the training thread, the fence, the
transfer landing in place."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from freescale.ft.catchup import SnapshotServer, expected_live_cut, layout, plan_payload
from freescale.ft.snapshot_fetch import SnapshotFetch, fetch_snapshot
from freescale.ft.snapshot_stream import ALIGN, Payload, PayloadStreamer, _recv_into


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"/model/w#0": torch.randn(300, 7, generator=g), "/model/b#0": torch.randn(3, generator=g),
            "/optim/state/0/step#0": torch.tensor(5.0), "/flags#0": torch.tensor([True, False, True]),
            "/half#0": torch.randn(5, generator=g).to(torch.bfloat16), "/empty#0": torch.zeros(0, 4),
            "meta.json": torch.frombuffer(bytearray(b'{"data": null}'), dtype=torch.uint8)}


@pytest.fixture
def server() -> Iterator[SnapshotServer]:
    serving = SnapshotServer()
    serving.start()
    yield serving
    serving.stop()


@pytest.fixture
def copying() -> Iterator[SnapshotServer]:
    """A server that copies every tensor (as it does a GPU's, or once a live transfer was cut)."""
    serving = SnapshotServer(live=False)
    serving.start()
    yield serving
    serving.stop()


def test_staged_copy_runs_off_the_caller_and_lands_in_place_where_it_fits(copying: SnapshotServer) -> None:
    server = copying
    source = state()
    address = server.address
    assert server.stage(3, source) < 0.5  # returns at once: the copy runs on the staging thread
    assert server.wait_staged() > 0.0  # the fence: the copy is done
    expected = {k: v.clone() for k, v in source.items()}
    for t in source.values():  # the caller's next update: the staged bytes must not move
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    own = {"/model/w#0": torch.empty(300, 7), "/model/b#0": torch.empty(4),  # b: wrong shape
           "/half#0": torch.empty(5, dtype=torch.float32)}  # wrong dtype
    fetched = fetch_snapshot(address, 2, own=own)
    assert fetched.step == 3
    for name, t in expected.items():
        assert torch.equal(fetched.tensors[name], t), name
    assert fetched.tensors["/model/w#0"].data_ptr() == own["/model/w#0"].data_ptr()  # landed in place
    assert fetched.tensors["/model/b#0"].data_ptr() != own["/model/b#0"].data_ptr()
    assert fetched.tensors["/half#0"].dtype == torch.bfloat16
    assert fetched.in_place == 300 * 7 * 4
    assert fetched.waited_s < 5 and fetched.arrived <= time.time()


def test_a_fetcher_waits_for_a_newer_step_and_the_next_staging_reuses_the_spare_buffer(copying: SnapshotServer) -> None:
    server = copying
    address = server.address
    server.stage(1, state())
    server.wait_staged()
    first = server._staged.buffer  # noqa: SLF001 - which buffer is served
    result: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: result.update(f=fetch_snapshot(address, 2)))
    waiter.start()
    deadline = time.monotonic() + 5
    while not server.wants(2) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.wants(2) and not server.wants(1)
    server.stage(2, state())
    server.wait_staged()
    waiter.join(timeout=10)
    assert result["f"].step == 2  # type: ignore[attr-defined]
    second = server._staged.buffer  # noqa: SLF001
    assert second.data_ptr() != first.data_ptr()  # never the buffer being served
    server.stage(3, state())
    server.wait_staged()
    assert server._staged.buffer.data_ptr() == first.data_ptr()  # noqa: SLF001 - the spare, reused


def test_live_state_is_served_in_place_and_the_fence_waits_for_the_transfer() -> None:
    """Large host tensors are sent from where they are; small ones and the padding around them go from
    runs of a small buffer.  The fence before the next update holds until the transfer in flight is
    done; then the snapshot is withdrawn."""
    server = SnapshotServer(fence_wait_s=30)  # a loaded machine must not turn this into a cut
    server.start()
    try:
        g = torch.Generator().manual_seed(1)
        source = {"/a#0": torch.randn(5, generator=g), "/big1#0": torch.randn(1 << 20, generator=g),
                  **state(), "/big2#0": torch.randn(3, 1 << 19, generator=g).to(torch.float64),
                  "/strided#0": torch.arange(12.0).reshape(3, 4).t()}  # not contiguous: copied
        expected = {k: v.clone() for k, v in source.items()}
        gate, entered = threading.Event(), threading.Event()
        server.on_stream = lambda step: (entered.set(), gate.wait(10))  # in flight, held before its first byte
        assert server.stage(3, source) < 0.5
        got: dict[str, object] = {}
        fetcher = threading.Thread(target=lambda: got.update(f=fetch_snapshot(server.address, 3)))
        fetcher.start()
        assert entered.wait(10)  # the fetcher connected: its sender holds the ticket
        fenced = threading.Thread(target=server.wait_staged)
        fenced.start()
        fenced.join(timeout=0.3)
        assert fenced.is_alive() and server.staged_step is None  # withdrawn for newcomers, held for the one in flight
        gate.set()
        fenced.join(timeout=20)
        assert not fenced.is_alive()
        for t in source.values():  # the update after the fence: what was sent must not have moved
            t.zero_() if t.dtype != torch.bool else t.fill_(False)
        fetcher.join(timeout=20)
        for name, t in expected.items():
            assert torch.equal(got["f"].tensors[name], t), name  # type: ignore[attr-defined]
        assert sum(b.numel() for b in server._buffers) < 64 << 10  # noqa: SLF001 - the 16 MB went out live
        assert server.live and server.cut_transfers == 0
    finally:
        server.stop()


def _header(address: str) -> dict[str, str]:
    """What a fetcher gets from the HTTP request: the stream's address and a ticket."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/v1/snapshot?min_step=0")
    header = json.loads(conn.getresponse().read())
    conn.close()
    return header  # type: ignore[no-any-return]


def _connect(header: dict[str, str]) -> socket.socket:
    host, _, port = header["stream"].rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(header["ticket"].encode())
    return sock


def test_a_transfer_that_outlasts_the_fence_is_cut_and_the_source_copies_from_then_on() -> None:
    """A fetcher that connected and stopped reading (a SIGSTOPped peer): the fence waits its bound,
    cuts the stream, and this source copies from then on."""
    server = SnapshotServer(fence_wait_s=0.2)
    server.start()
    try:
        big = {"/model/w#0": torch.ones(16 << 20)}  # 64 MB: far more than the sockets buffer
        server.stage(1, big)
        stalled = _connect(_header(server.address))
        deadline = time.monotonic() + 10
        while not server._streamer._sending and time.monotonic() < deadline:  # type: ignore[union-attr]  # noqa: SLF001
            time.sleep(0.01)
        started = time.monotonic()
        assert server.wait_staged() >= 0.2  # waited its bound, then cut the transfer
        assert time.monotonic() - started < 5
        assert not server.live and server.cut_transfers == 1 and server.staged_step is None
        with pytest.raises((ConnectionError, OSError)):  # the fetcher sees its stream end early
            _recv_into(stalled, memoryview(bytearray(64 << 20)), "source", None)
        stalled.close()
        big["/model/w#0"].fill_(2.0)  # the update the fence let through
        server.stage(2, big)  # copied now: the next transfer never holds this source's update
        server.wait_staged()
        big["/model/w#0"].fill_(3.0)
        fetched = fetch_snapshot(server.address, 2, timeout_s=10)
        assert fetched.step == 2 and torch.equal(fetched.tensors["/model/w#0"], torch.full((16 << 20,), 2.0))
    finally:
        server.stop()


def test_the_fence_revokes_a_ticket_nobody_used_and_stays_live() -> None:
    """A fetcher that got its header and never connected (cancelled, dead): the fence gives it its bound,
    revokes the ticket (refused afterwards), and the source stays live: nothing was cut."""
    server = SnapshotServer(fence_wait_s=0.3)
    server.start()
    try:
        server.stage(1, {"/model/w#0": torch.ones(1 << 20)})
        header = _header(server.address)
        started = time.monotonic()
        assert server.wait_staged() >= 0.3
        assert time.monotonic() - started < 5 and server.live and server.cut_transfers == 0
        with _connect(header) as late:
            assert late.recv(1) == b""  # revoked: closed without a byte
    finally:
        server.stop()


def test_a_fetcher_that_asks_for_a_copy_gets_the_next_step_copied() -> None:
    """A retry after a broken transfer asks for a copy: the live snapshot is not handed to it, the source
    copies from its next commit on, and the fetcher gets that one."""
    server = SnapshotServer()
    server.start()
    try:
        big = {"/model/w#0": torch.full((1 << 20,), 1.0)}
        server.stage(1, big)
        got: dict[str, object] = {}
        fetcher = threading.Thread(target=lambda: got.update(f=fetch_snapshot(server.address, 1, timeout_s=20,
                                                                               copied=True)))
        fetcher.start()
        deadline = time.monotonic() + 10
        while server.live and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.live and server.wants(2) and not server.wants(1)
        assert server.wait_staged() == 0.0  # nothing of the live snapshot was handed out
        big["/model/w#0"].fill_(2.0)
        server.stage(2, big)
        server.wait_staged()  # the copy is done; a copied snapshot stays served after the fence
        assert max(b.numel() for b in server._buffers) >= 4 << 20  # noqa: SLF001 - copied, not live
        big["/model/w#0"].fill_(3.0)  # the next update
        fetcher.join(timeout=20)
        fetched = got["f"]
        assert fetched.step == 2 and torch.equal(fetched.tensors["/model/w#0"], torch.full((1 << 20,), 2.0))  # type: ignore[attr-defined]
        assert server.cut_transfers == 0
    finally:
        server.stop()


def test_the_transfer_window_is_the_median_of_the_last_step_times_once_there_are_three() -> None:
    from collections import deque

    from freescale.ft.layer_snapshot import step_window

    times: deque[float] = deque(maxlen=5)
    for t in (0.1, 3.0):
        times.append(t)
        assert step_window(times) is None
    times.extend([0.2, 0.3, 9.0, 0.25])  # the first drops out; a slow step does not move the median much
    assert list(times) == [3.0, 0.2, 0.3, 9.0, 0.25] and step_window(times) == 0.3


def test_a_live_transfer_that_would_be_cut_is_copied_up_front() -> None:
    """Served live unless the transfer is expected to outlast the fence (the step plus ``fence_wait_s``): at
    the assumed rate before this source measured one, at the measured rate after a transfer."""
    assert not expected_live_cut(10**9, 1e9, None, 1.0)  # no step time yet: live
    assert expected_live_cut(2 * 10**9, 1e9, 0.5, 1.0) and not expected_live_cut(14 * 10**8, 1e9, 0.5, 1.0)
    server = SnapshotServer(fence_wait_s=0.01)
    server.start()
    try:
        big = {"/model/w#0": torch.full((8 << 20,), 1.0)}  # 32 MiB: 0.034 s at the assumed 1 GB/s
        server.stage(1, big, window_s=1e-4)
        assert server.choice["live"] is False and server.choice["rate_measured"] is False
        server.wait_staged()
        assert max(b.numel() for b in server._buffers) >= 32 << 20  # noqa: SLF001 - copied, not live
        assert server.live, "a copy chosen for one staging does not turn the source to copying"
        server.stage(2, big, window_s=10.0)
        assert server.choice["live"] is True
        fetched = fetch_snapshot(server.address, 2, timeout_s=20)
        assert torch.equal(fetched.tensors["/model/w#0"], big["/model/w#0"])
        server.wait_staged()
        assert server.cut_transfers == 0 and server._streamer is not None  # noqa: SLF001
        assert server._streamer.rate_bps is not None  # noqa: SLF001 - measured by that transfer
        server._streamer.rate_bps = 1e6  # noqa: SLF001 - a slow path measured: 33 s for the payload
        server.stage(3, big, window_s=1.0)  # live at the assumed 1 GB/s; copied at the measured rate
        assert server.choice["rate_measured"] is True and server.choice["live"] is False
        server.wait_staged()
    finally:
        server.stop()


@pytest.mark.parametrize("live", [True, False])
def test_a_fetcher_asking_for_the_shards_alone_gets_them_and_no_other_byte(live: bool) -> None:
    """``only=shards``: what a rank standing in for a lost position takes from that position's peer.  The shards
    (names ``...@row,col``), live or copied, laid end to end; a bad ``only`` is a 400."""
    server = SnapshotServer(live=live, fence_wait_s=30)
    server.start()
    try:
        g = torch.Generator().manual_seed(2)
        source = {**state(), "/model/t.weight@0,0": torch.randn(1 << 18, 4, generator=g),
                  "/model/t.weight@0,4": torch.randn(7, 4, generator=g),
                  "/optim/state/t/momentum1@0": torch.randn(1 << 18, generator=g)}
        server.stage(4, source)
        server.wait_staged() if not live else None
        fetched = fetch_snapshot(server.address, 4, shards_only=True)
        shards = {k: v for k, v in source.items() if "@" in k}
        assert sorted(fetched.tensors) == sorted(shards)
        for name, t in shards.items():
            assert torch.equal(fetched.tensors[name], t), name
        assert fetched.nbytes == sum(-(-t.numel() * 4 // ALIGN) * ALIGN for t in shards.values())
        host, _, port = server.address.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/v1/snapshot?min_step=4&only=everything")
        answer = conn.getresponse()
        assert answer.status == 400 and "only" in json.loads(answer.read())["error"]
        conn.close()
        server.wait_staged()  # the fence: nothing of the part is left in flight
    finally:
        server.stop()


def test_a_snapshot_that_does_not_come_in_time_is_a_one_line_error(server: SnapshotServer) -> None:
    address = server.address
    with pytest.raises(ConnectionError, match=r"answered 503: .*no snapshot at step >= 4"):
        fetch_snapshot(address, 4, timeout_s=0.2)


def test_cancelling_a_download_from_a_silent_source_returns_at_once() -> None:
    """A source that accepted the request and went silent (its host vanished, no FIN): a newer catch-up
    must not wait out the read timeout before it may write the same tensors."""
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    log: dict[str, object] = {}
    fetch = SnapshotFetch([f"127.0.0.1:{silent.getsockname()[1]}"], 0, "", log)
    deadline = time.monotonic() + 5
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    fetch.cancel()
    assert time.monotonic() - started < 5
    assert fetch.arrived
    with pytest.raises(ConnectionError, match="127.0.0.1"):
        fetch.result()
    silent.close()


def test_a_connection_opened_while_the_cancel_ran_gives_up_at_once() -> None:
    """The cancel's shutdown can run between the connect and the socket's registration (seen under load
    on 2 cores: the download then blocked on the silent source for its whole read timeout); a socket
    registered after the cancel must give up by itself, before its first read."""
    silent = socket.create_server(("127.0.0.1", 0))
    cancelled, sockets = threading.Event(), []
    cancelled.set()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="abandoned"):
        fetch_snapshot(f"127.0.0.1:{silent.getsockname()[1]}", 0, timeout_s=30, cancelled=cancelled,
                       sockets=sockets)
    assert time.monotonic() - started < 5 and len(sockets) == 1
    silent.close()


def test_the_stream_refuses_a_wrong_ticket_and_releases_unused_ones_when_closed() -> None:
    released: list[int] = []
    streamer = PayloadStreamer("127.0.0.1", "127.0.0.1")
    ticket = streamer.offer(Payload.of(torch.arange(64, dtype=torch.uint8)), 1, lambda: released.append(1))
    host, _, port = streamer.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"0" * 32)  # not the ticket: closed without a byte
        assert sock.recv(1) == b""
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(ticket.encode())
        got = b""
        while len(got) < 64:
            chunk = sock.recv(64)
            assert chunk
            got += chunk
    deadline = time.monotonic() + 5  # released by the sender once its sendall returns: maybe after our last read
    while not released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == bytes(range(64)) and released == [1]
    streamer.offer(Payload.of(torch.zeros(8, dtype=torch.uint8)), 2, lambda: released.append(2))
    streamer.close()  # the unused ticket is released, and the port no longer answers
    assert released == [1, 2]
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).recv(1)


def test_the_payload_plan_covers_every_byte_once_and_keeps_the_alignment() -> None:
    """Live tensors and buffer runs tile the payload exactly; every copied tensor lands inside a run at
    the payload's alignment (a dtype view needs it); a state with a tensor off the host goes all copied."""
    g = torch.Generator().manual_seed(2)
    tensors = {"/s1#0": torch.randn(3, generator=g), "/big#0": torch.randn((1 << 18) + 1, generator=g),
               "/s2#0": torch.randn(7, generator=g).to(torch.float64), "/big2#0": torch.randn(1 << 18, generator=g),
               "/big3#0": torch.randn(1 << 18, generator=g), "/s3#0": torch.tensor(5.0)}
    entries, total = layout(tensors)
    plan = plan_payload(entries, list(tensors.values()), True, total)
    spans = sorted([(o, t.numel()) for o, t in plan.live] + [(o, n) for o, n, _ in plan.runs])
    assert [o for o, _ in spans] == [0] + [o + n for o, n in spans[:-1]] and sum(n for _, n in spans) == total
    assert len(plan.live) == 3 and len(plan.copies) == 3 and plan.buffer_bytes < 4096
    for offset, length, at in plan.runs:
        assert at % ALIGN == offset % ALIGN and at + length <= plan.buffer_bytes
    offsets = {id(t): e["offset"] for e, t in zip(entries, tensors.values())}
    for t, at in plan.copies:  # where the receiver reads it: the run's payload offset + its place in the run
        run = next(r for r in plan.runs if r[2] <= at < r[2] + r[1])
        assert at - run[2] == offsets[id(t)] - run[0] and at + t.numel() * t.element_size() <= run[2] + run[1]
    ends = sorted((at, at + n) for _, n, at in plan.runs)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # runs do not overlap in the buffer
    off_host = [*tensors.values()][:-1] + [torch.empty(1, device="meta")]
    assert not plan_payload(entries, off_host, True, total).live  # one tensor on a device: all copied
    assert not plan_payload(entries, list(tensors.values()), False, total).live
