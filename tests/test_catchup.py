"""The snapshot path in one process: staging off the training thread, the fence, the transfer landing in place."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from freescale.ft.catchup import SnapshotFetch, SnapshotServer, fetch_snapshot
from freescale.ft.snapshot_stream import PayloadStreamer


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


def test_staged_copy_runs_off_the_caller_and_lands_in_place_where_it_fits(server: SnapshotServer) -> None:
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


def test_a_fetcher_waits_for_a_newer_step_and_the_next_staging_reuses_the_spare_buffer(server: SnapshotServer) -> None:
    address = server.address
    server.stage(1, state())
    server.wait_staged()
    first = server._staged.payload  # noqa: SLF001 - which buffer is served
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
    second = server._staged.payload  # noqa: SLF001
    assert second.data_ptr() != first.data_ptr()  # never the buffer being served
    server.stage(3, state())
    server.wait_staged()
    assert server._staged.payload.data_ptr() == first.data_ptr()  # noqa: SLF001 - the spare, reused


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


def test_the_stream_refuses_a_wrong_ticket_and_releases_unused_ones_when_closed() -> None:
    released: list[int] = []
    streamer = PayloadStreamer("127.0.0.1", "127.0.0.1")
    ticket = streamer.offer(torch.arange(64, dtype=torch.uint8), 1, lambda: released.append(1))
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
    streamer.offer(torch.zeros(8, dtype=torch.uint8), 2, lambda: released.append(2))
    streamer.close()  # the unused ticket is released, and the port no longer answers
    assert released == [1, 2]
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).recv(1)
