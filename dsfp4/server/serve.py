"""`dsfp4 run MODEL --serve`: the engine in this process, the HTTP server in a process of its own (front.py), a link
between them (link.py). The event loop's streaming and the engine's steps then run on two cores, each with its GIL.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from dsfp4.errors import ConfigError, DsfpError
from dsfp4.runtime.engine import Engine
from dsfp4.server.app import Served
from dsfp4.server.front import GRACE_S
from dsfp4.server.link import EngineLink
from dsfp4.server.scheduler import Scheduler

# how long the HTTP process may take to end: its open connections get GRACE_S
STOP_S = GRACE_S + 5
# where this dsfp4 is imported from
HOME = str(Path(__file__).resolve().parents[2])


def front_command(*args: str) -> list[str]:
    """The HTTP process's command: this dsfp4 first on its path, not the working directory's, which `python -m` or
    `-c` would put there (another checkout's would run beside this engine)."""
    code = f"import sys; sys.path[0] = {HOME!r}; import dsfp4.server.front as front; front.main()"
    return [sys.executable, "-c", code, *args]


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a port in use fails in one line before the model loads, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # as uvicorn: a restart need not wait for TIME_WAIT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
    what runs and waits; a second one kills it) or until the HTTP process ends; the worker has stopped when this
    returns, so the caller can close the engine. Ctrl-C then raises KeyboardInterrupt, as it would have at once. A
    HTTP process that fails is a DsfpError. Off the main thread, which cannot take signals, the caller stops it."""
    mine, theirs = socket.socketpair()
    fds = (theirs.fileno(), sock.fileno())
    try:
        front = subprocess.Popen(front_command(*map(str, fds)), pass_fds=fds)
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
        # the HTTP process has its copy: once it has gone, connections are refused, not left waiting
        sock.close()
    link = EngineLink(Connection(mine.detach()))
    signals: list[int] = []

    def stop(sig: int, frame: object) -> None:
        signals.append(sig)
        if front.poll() is None:
            front.send_signal(signal.SIGKILL if len(signals) > 1 else signal.SIGTERM)

    handlers, scheduler, closed = {}, None, False
    try:
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        scheduler = Scheduler(engine, served.max_queue, link.done)
        # the engine's objects live as long as the server: a full collection walked them all while every stream's step
        # waited (docs/BENCHMARKS.md: the server in two processes)
        gc.freeze()
        link.send((engine.rules.spec, served, scheduler.slots))
        # until the HTTP process closes the link: it is ending, or it broke the link
        link.serve(scheduler)
        closed = True
    finally:
        asked = _end(front, patient=closed)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if scheduler is not None:
            scheduler.stop()
        link.close()
        # frozen objects escape the collection at the interpreter's exit: Triton's nanobind objects in cycles then
        # outlived it, and nanobind reported each as leaked (~30 lines on stderr after every clean stop)
        gc.unfreeze()
    if signal.SIGINT in signals:
        raise KeyboardInterrupt
    if front.returncode != 0 and not (signals or asked):
        raise DsfpError(f"the server's HTTP process exited with status {front.returncode} (its message is above)")


def _end(front: subprocess.Popen, patient: bool) -> bool:
    """The HTTP process has ended when this returns: given STOP_S to end by itself when `patient`, then asked to
    (SIGTERM, STOP_S), then killed. -> whether it was asked."""
    if patient:
        with contextlib.suppress(subprocess.TimeoutExpired):
            front.wait(STOP_S)
    if front.poll() is not None:
        return False
    front.terminate()
    try:
        front.wait(STOP_S)
    except subprocess.TimeoutExpired:
        front.kill()
        front.wait()
    return True
