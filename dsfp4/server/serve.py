"""`dsfp4 run MODEL --serve`: the engine in this process, the HTTP server in a process of its own (front.py), a link
between them (link.py). The event loop's streaming and the engine's steps then run on two cores, each with its GIL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from dsfp4.errors import ConfigError, DsfpError
from dsfp4.runtime.engine import Engine
from dsfp4.server.app import Served
from dsfp4.server.link import EngineLink
from dsfp4.server.scheduler import Scheduler


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a port in use fails in one line before the model loads, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); stop what holds the port "
            f"or give another --port"
        ) from e
    return sock


def serve(engine: Engine, served: Served, sock: socket.socket) -> None:
    """Serve on `sock` (listen's) until interrupted (Ctrl-C or SIGTERM, passed on to the HTTP process, which cancels
    what runs and waits) or until the HTTP process ends; the worker has stopped when this returns, so the caller can
    close the engine. A HTTP process that fails is a DsfpError."""
    mine, theirs = socket.socketpair()
    link = EngineLink(Connection(os.dup(mine.fileno())))
    mine.close()
    scheduler = Scheduler(engine, served.max_queue, link.done)
    fds = (theirs.fileno(), sock.fileno())
    front = subprocess.Popen([sys.executable, "-m", "dsfp4.server.front", *map(str, fds)], pass_fds=fds)
    theirs.close()
    stopping = []

    def stop(sig: int, frame: object) -> None:
        stopping.append(sig)
        if front.poll() is None:
            front.send_signal(signal.SIGTERM)

    handlers = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        link.send((engine.rules.spec, served, scheduler.slots))
        link.serve(scheduler)  # until the HTTP process closes the link
        code = front.wait()
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
        for s, handler in handlers.items():
            signal.signal(s, handler)
        scheduler.stop()
        link.conn.close()
        sock.close()
    if code != 0 and not stopping:
        raise DsfpError(f"the server's HTTP process exited with status {code} (its message is above)")
