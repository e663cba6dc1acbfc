"""The server's HTTP process: main(LINK_FD, SOCKET_FD from argv), started by serve.py (front_command) with its end of
the link and the listening socket. It parses, tokenizes and streams; the engine's process generates.

Its first message on the link names the prompt rules, the served model and the scheduler's slots. It stops on
SIGINT or SIGTERM (the running generations are cancelled, the open streams end at their next token) or when the
engine's process closes the link. It imports no torch: it costs the host about 60 MB, not the engine's."""

from __future__ import annotations

import asyncio
import functools
import gc
import signal
import socket
import sys
from multiprocessing.connection import Connection

import uvicorn

from dsfp4.runtime.generate.prompt import PromptRules, PromptSpec
from dsfp4.server.app import Served, build_app
from dsfp4.server.deadline import Deadline
from dsfp4.server.link import RemoteScheduler
from dsfp4.server.metrics import Metrics

# at shutdown, how long open connections may take to end once their generations are cancelled
GRACE_S = 10


class _Server(uvicorn.Server):
    """uvicorn's, where a signal cancels the generations at once and only the first counts: a Ctrl-C reaches both
    processes, and the engine's passes it on."""

    def __init__(self, config: uvicorn.Config, scheduler: RemoteScheduler, loop: asyncio.AbstractEventLoop):
        super().__init__(config)
        self.scheduler, self.loop = scheduler, loop

    def handle_exit(self, sig: int, frame: object) -> None:
        # open streams end at their next token, so shutdown need not wait for them; on the
        if not self.should_exit:
            # loop, not in the handler, which may run in the middle of a message to the engine's process
            self.loop.call_soon_threadsafe(self.scheduler.cancel_all)
        # and the signal is not raised again once the server has stopped
        self.should_exit = True


async def _serve(conn: Connection, sock: socket.socket) -> None:
    spec, served, slots = conn.recv()
    if not isinstance(spec, PromptSpec) or not isinstance(served, Served):
        raise SystemExit(f"dsfp4.server.front: the link's first message is not the server's set-up: {spec!r:.80}")
    metrics = Metrics()
    server: _Server | None = None

    def lost() -> None:
        if server is not None:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    scheduler = RemoteScheduler(conn, served.max_queue, slots, metrics.done, lost)
    scheduler.attach(loop)
    app = build_app(PromptRules(spec), scheduler, served, metrics)
    # asyncio's loop, not uvloop's: its socket writes let go of the GIL (docs/BENCHMARKS.md), which here the link's
    # reads share, no longer the engine's steps
    # a slow client's head is cut (deadline.py), as its body is (body.py)
    http = functools.partial(Deadline, seconds=served.read_timeout)
    config = uvicorn.Config(app, http=http, log_level="warning", access_log=False, timeout_graceful_shutdown=GRACE_S)
    server = _Server(config, scheduler, loop)
    # what lives as long as the server: the collector need not walk it again
    gc.freeze()
    await server.serve(sockets=[sock])


def main() -> None:
    link_fd, sock_fd = (int(a) for a in sys.argv[1:3])
    # until uvicorn takes the signals: the engine's process forwards
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with Connection(link_fd) as conn, socket.socket(fileno=sock_fd) as sock:
        asyncio.run(_serve(conn, sock))


if __name__ == "__main__":
    main()
