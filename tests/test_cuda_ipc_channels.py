"""The CUDA transport of the SM-free backend (``kernels/cuda_ipc_channels.py``) where it does not need a GPU: its IPC
handle's text for the store, its header protocol over CPU tensors, and the backend's CUDA bookkeeping (a transfer
moves once the caller's stream has passed its issue point, lands when the fence behind its copies has passed,
pieces for a transfer not yet active wait or are kept) run over CPU tensors with marks that pass late.

One process, no GPU: the ranks of the backend test are threads (a ``ProcessGroupGloo`` each, on one ``HashStore``).
What only a GPU shows (the IPC mapping, copy engines, events): ``benchmarks/gpu_sm_free_backend.py``.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from freescale.kernels.cuda_ipc_channels import (
    ALIGN,
    CudaChannels,
    Mark,
    control_words,
    decode_handle,
    encode_handle,
)


class _Later:
    """A mark that passes at its ``n``-th query after the first (0: at once)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def query(self) -> bool:
        self.n -= 1
        return self.n < 0


class _Slow(CudaChannels):
    """The protocol with every mark (copies, the caller's stream) passing late, by ``delays``."""

    def __init__(self, *args: object, delays: Iterator[int]) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self._delays = delays

    def _mark(self) -> Mark:
        return _Later(next(self._delays))

    def issued(self) -> Mark:
        return self._mark()


def _channels(world: int, ring_bytes: int, slots: int, delays: list[Iterator[int]]) -> list[CudaChannels]:
    """Every rank's end of one group's channels, in this process: control files and rings as plain arrays; rank
    r's marks pass ``delays[r]`` queries late."""
    controls = [np.zeros(control_words(world, slots), dtype=np.int64) for _ in range(world)]
    rings = [torch.zeros(world * ring_bytes, dtype=torch.uint8) for _ in range(world)]
    return [_Slow(r, world, controls, rings, ring_bytes, slots, None, [os.getpid()] * world, delays=delays[r])
            for r in range(world)]


def test_ipc_handle_goes_through_the_store_as_plain_json() -> None:
    fields = (3, bytes(range(64)), 96 << 20, 2 << 20, b"/torch_4242_1234567890_0", 17, bytes(64), True)
    text = encode_handle(fields)
    assert isinstance(json.loads(text), dict)
    back = decode_handle(text)
    assert tuple(back) == fields and [type(v) for v in back] == [type(v) for v in fields]
    assert decode_handle(encode_handle((*fields[:7], False))).event_sync_required is False


def test_pieces_cross_a_small_ring_only_once_their_copy_has_run() -> None:
    """Rank 0 to rank 1 through a ring of 4 x ALIGN bytes and 2 header slots: a header is published only when its
    copy's mark has passed, room comes back only when the copy-out's has, pieces are cut at the ring's end, and
    every byte lands where its header says."""
    ring, slots = 4 * ALIGN, 2
    sender, owner = _channels(2, ring, slots, [iter([2, 0, 1, 3] * 1000), iter([1, 0, 2] * 1000)])
    payload = torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert sender.send(1, 7, 0, payload[:700]) == 700 and owner.peek(0) is None
    assert [sender.settle() for _ in range(3)] == [False, False, True]  # published at its mark's third query
    out = torch.zeros_like(payload)
    sent, got, cut, passes = 700, 0, False, 0
    while got < len(payload):
        passes += 1
        assert passes < 10_000, "no progress"
        if sent < len(payload):
            n = sender.send(1, 7, sent, payload[sent:sent + 700])
            cut |= 0 < n < min(700, len(payload) - sent)
            sent += n
        in_use = sender._tail[1] - int(owner._controls[1][2 * 8])  # (rank 0's ring in rank 1: tail - freed)
        assert 0 <= in_use <= ring
        sender.settle()
        record = owner.peek(0)
        if record is not None:
            assert record.sequence == 7 and record.length <= ring
            out[record.offset:record.offset + record.length].copy_(record.payload)
            got += record.length
            owner.release(0)
        owner.settle()
    assert torch.equal(out, payload) and cut
    while not (sender.idle() and owner.idle()):
        sender.settle()
        owner.settle()
    assert owner.peek(0) is None


def test_a_damaged_header_is_said_in_one_line() -> None:
    sender, owner = _channels(2, 4 * ALIGN, 4, [iter([0] * 100)] * 2)
    sender.send(1, 0, 0, torch.ones(100, dtype=torch.uint8))
    sender.settle()
    owner._in_headers[0][0, 2] = 5 * ALIGN  # its position: not where the next piece must start
    with pytest.raises(RuntimeError, match=r"a damaged header from rank 0 \(100 bytes at 1280, expected at 0\)"):
        owner.peek(0)


WORLD = 3


def _inputs(rank: int, case: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Rank ``rank``'s input of case ``case`` and its splits (any rank can make any rank's)."""
    splits_of, dtype, width = [
        (lambda s, d: 2, torch.float32, 16),
        (lambda s, d: (s * 7 + d * 3) % 5, torch.float32, 3),  # uneven, some empty
        (lambda s, d: 0 if s == d else 700 * (1 + s), torch.int64, 4),  # many pieces through the small rings
        (lambda s, d: (s + d) % 2, torch.bfloat16, 1),
        (lambda s, d: 0, torch.float32, 8)][case]
    send = [splits_of(rank, d) for d in range(WORLD)]
    recv = [splits_of(s, rank) for s in range(WORLD)]
    g = torch.Generator().manual_seed(100 * rank + case)
    return torch.randint(-1000, 1000, (sum(send), width), generator=g).to(dtype), send, recv


def _expected(rank: int, case: int) -> torch.Tensor:
    parts = []
    for src in range(WORLD):
        data, send, _ = _inputs(src, case)
        parts.append(data[sum(send[:rank]):sum(send[:rank + 1])])
    return torch.cat(parts)


def _rank(rank: int, group: dist.ProcessGroup | None, errors: list[BaseException]) -> None:
    assert group is not None
    try:
        cases = [_inputs(rank, c) for c in range(5)]
        outs = [torch.full((sum(recv), data.shape[1]), -7).to(data.dtype) for data, _, recv in cases]
        works = [group.alltoall_base(out, data, recv, send) for out, (data, send, recv) in zip(outs, cases)]
        strided = torch.empty(cases[1][0].shape[1], sum(cases[1][2])).t()  # a non-contiguous output
        works.append(group.alltoall_base(strided, cases[1][0], cases[1][2], cases[1][1]))
        for work in works:
            work.wait()
        for c, out in enumerate(outs):
            assert torch.equal(out.view(torch.uint8), _expected(rank, c).view(torch.uint8)), f"rank {rank}, case {c}"
        assert not strided.is_contiguous() and torch.equal(strided, _expected(rank, 1))
    except BaseException as exc:  # (reported by the test's thread)
        errors.append(exc)


@pytest.mark.timeout(120)
def test_backend_cuda_bookkeeping_over_cpu_tensors_equals_the_reference() -> None:
    """Three ranks (threads) of ``SmFreeProcessGroup`` on the CUDA transport's protocol over CPU tensors, rings of
    2 KiB and 3 header slots, every mark passing 0-3 queries late: even, uneven, empty, many-piece and bf16
    exchanges in flight together and a non-contiguous output, each equal to the reference made locally."""
    from freescale.kernels.sm_free_backend import SmFreeProcessGroup

    rng = random.Random(0)
    channels = _channels(WORLD, 8 * ALIGN, 3, [iter([rng.randrange(4) for _ in range(200_000)]) for _ in range(WORLD)])
    store = dist.HashStore()
    groups: list[SmFreeProcessGroup | None] = [None] * WORLD
    errors: list[BaseException] = []

    def make(r: int) -> None:
        groups[r] = SmFreeProcessGroup(store, r, WORLD, timedelta(seconds=60), "cpu", channels=channels[r])

    _threads([threading.Thread(target=make, args=(r,)) for r in range(WORLD)])
    assert all(groups)
    _threads([threading.Thread(target=_rank, args=(r, groups[r], errors)) for r in range(WORLD)])
    assert not errors, errors[0]
    assert all(g is not None and sorted(g.completed) == list(range(6)) for g in groups)


def _threads(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
        assert not t.is_alive(), "a rank's thread hung"
