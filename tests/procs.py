"""Process helpers for fault tests: find a process tree through /proc, signal all of it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def children_map() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = children_map(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid`` and every descendant (deepest first, so none is re-parented unseen)."""
    for p in [*reversed(descendants(pid)), pid]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a spawned group's rendezvous), drawn below the
    kernel's ephemeral range: a port the kernel handed out (``bind(0)``) may be handed out again, as the local end of
    some other connection, before the group binds it (a rendezvous then failed with EADDRINUSE now and then)."""
    import random
    import socket

    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    draw = random.Random()
    for _ in range(200):
        port = draw.randrange(10_000, max(low, 10_001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (none free below the range: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
