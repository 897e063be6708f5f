"""The group agent (``freescale.ft.group_agent``) as a process of its own: member 0 starts it
(``start_agent``), reads its URL, and stops it when done (``AgentProcess.stop``).

The process serves until SIGTERM or SIGINT, then keeps serving the members that have not closed
their clients yet (``GroupAgent.drain``, at most ``DRAIN_S``), and exits at once when its parent,
member 0, dies (even by SIGKILL: it watches its parent).  The token and the run id come from the
environment (``FREESCALE_LIGHTHOUSE_TOKEN``, ``FREESCALE_RUN_ID``), not a command line others can
read.  ``python -m freescale.ft.agent_process --help`` lists its flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys

from freescale.ft.group_agent import GroupAgent
from freescale.ft.serving import run_loop

DRAIN_S = 10.0
"""How long a stopping agent serves members that have not closed their clients yet."""


class AgentProcess:
    """Member 0's handle on its group's agent process (``start_agent``)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.url = ""

    def wait_url(self, timeout_s: float = 30.0) -> str:
        """The agent's URL, once it serves (it prints it); a one-line error if it does not."""
        assert self.proc.stdout is not None
        if not self.url:
            readable, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            line = self.proc.stdout.readline().decode(errors="replace") if readable else ""
            try:
                self.url = str(json.loads(line)["url"])
            except (ValueError, KeyError, TypeError):
                self.stop()
                raise RuntimeError(f"the replica group's agent did not start (exit status {self.proc.poll()}); "
                                   "its error is above") from None
        return self.url

    def stop(self) -> None:
        """Ask the agent to stop once the other members closed their clients (``GroupAgent.drain``)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=DRAIN_S + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_agent(upstream: str, replica_id: str, incarnation: int, group_size: int, bind_host: str,
                advertise: str, heartbeat_interval_s: float = 0.05) -> AgentProcess:
    """Start the group's agent process (member 0 calls this; ``wait_url`` when its URL is needed, so
    the start overlaps the caller's own set-up).  The token and run id travel in the environment
    (``FREESCALE_LIGHTHOUSE_TOKEN``, ``FREESCALE_RUN_ID``), not on a command line others can read."""
    command = [sys.executable, "-m", "freescale.ft.agent_process", "--upstream", upstream, "--replica-id", replica_id,
               "--incarnation", str(incarnation), "--group-size", str(group_size), "--bind", f"{bind_host}:0",
               "--advertise", advertise, "--heartbeat-interval", str(heartbeat_interval_s)]
    return AgentProcess(subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL))


async def _serve(args: argparse.Namespace) -> None:
    import signal

    agent = GroupAgent(args.upstream, args.replica_id, args.incarnation, args.group_size,
                       token=os.environ.get("FREESCALE_LIGHTHOUSE_TOKEN", ""),
                       run_id=os.environ.get("FREESCALE_RUN_ID", ""), bind=args.bind, advertise=args.advertise,
                       heartbeat_interval_s=args.heartbeat_interval)
    url = await agent.start()
    try:
        print(json.dumps({"url": url}), flush=True)
    except BrokenPipeError:  # member 0 is gone already (a group stopped while it started): go quietly
        await agent.stop()
        return
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:  # member 0 died (even by SIGKILL): go too
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:
            pass
    if stop.is_set():  # member 0 is done: serve the others until they are too
        await agent.drain(DRAIN_S)
    await agent.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m freescale.ft.agent_process", description="A replica group's agent (freescale.ft.group_agent), as its own process.")
    parser.add_argument("--upstream", required=True, help="the lighthouse URL")
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--bind", default="127.0.0.1:0")
    parser.add_argument("--advertise", default="")
    parser.add_argument("--heartbeat-interval", type=float, default=0.05)
    args = parser.parse_args(argv)
    try:
        run_loop(_serve(args))
    except KeyboardInterrupt:  # stopped before its signal handlers were in place
        pass
    except Exception as exc:  # a bug or a port it cannot bind: one line on the group's terminal
        print(f"freescale: group agent of {args.replica_id}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
