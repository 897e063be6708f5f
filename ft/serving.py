"""What the lighthouse, the group agent, the client and the snapshot server share: an asyncio loop on a
daemon thread, the token check, the retry delays (no torch: the lighthouse and the agent start in a blink)."""

from __future__ import annotations

import asyncio
import hmac
import os
import random
import socket
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

LINK_PING_S = 5.0
"""Both ends of a group agent's link (``/v1/agent``) ping every 5 s: a silent idle link is not
dropped by a proxy or a NAT, and a peer whose host vanished (no FIN) is given up after a missed
pong (the agent reconnects; the lighthouse takes the link's end as the group's presence ending)."""


def run_loop(main: Awaitable[Any]) -> Any:
    """``asyncio.run(main)`` on uvloop where it is installed (a dependency but Windows): the
    lighthouse's and the agents' cost per message is mostly the event loop's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]


def advertised_host(lighthouse_url: str) -> tuple[str, str]:
    """(host to bind, host to advertise) for a rank's snapshot server and rendezvous store: the
    loopback when the lighthouse is on it (one machine), else every interface and this machine's
    name (``FREESCALE_ADVERTISE_HOST`` overrides the name)."""
    host = urllib.parse.urlsplit(lighthouse_url).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", os.environ.get("FREESCALE_ADVERTISE_HOST") or socket.getfqdn()


def backoff_delays(rng: random.Random, first_s: float = 0.02, cap_s: float = 1.0) -> Iterator[float]:
    """Sleeps between retries: exponential backoff with full jitter (uniform in [0, ceiling],
    the ceiling doubling from ``first_s`` to ``cap_s``).

    A few lines here instead of a library: neither ``tenacity`` nor ``backoff`` is a dependency,
    and the retry loops (deadline, reconnects, which answers are transient) are the callers' own
    (``LighthouseClient._request``, the group agent's upstream loops); only the delay sequence
    would come from one."""
    ceiling = first_s
    while True:
        yield rng.uniform(0.0, ceiling)
        ceiling = min(cap_s, ceiling * 2)


def token_ok(request: web.Request, token: str) -> bool:
    """True when no token is configured or the request carries ``Authorization: Bearer <token>``."""
    if not token:
        return True
    return hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {token}".encode())


class LoopThread:
    """Runs ``start()`` on a fresh event loop in a daemon thread, then serves until ``stop()``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def run(self, start: Callable[[], Awaitable[Any]], cleanup: Callable[[], Awaitable[None]]) -> Any:
        """Await ``start()`` on the new loop and return its result (or raise its error here)."""
        ready = threading.Event()
        box: dict[str, Any] = {}

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                box["result"] = loop.run_until_complete(start())
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(cleanup())
            loop.close()

        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
