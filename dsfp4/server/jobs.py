"""A request's generation as both of the server's processes see it: the Job (what to run, and the channel its results
come back on), the engine's state as /health and /metrics report it, and how results reach whoever waits for them.

Nothing here imports torch: the HTTP process uses it too (link.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol


class QueueFull(Exception):
    """max_queue requests wait already (or the server is shutting down)."""


@dataclass(frozen=True)
class Report:
    """The engine's side of /health and /metrics."""

    alive: bool  # the engine's worker thread runs
    waiting: int  # requests in the queue
    running: int  # generations running
    slots: int  # generations at once (--max-batch)
    counters: dict[str, float]  # the expert store's, since the engine opened


class Sink(Protocol):
    def deliver(self, items: list[tuple[Job, object]]) -> None:
        """Items to their jobs' channels, in order."""


@dataclass(eq=False)
class Job:
    """A request's generation: what to run, and the channel its results come back on: Delta..., then the
    Generation, or None when it was cancelled, or the exception that ended it."""

    prompt_ids: list[int]
    options: dict[str, Any]  # Engine.stream keywords
    sink: Sink | None  # where post() sends its items from the engine's thread; None where the link brings them
    id: int = 0  # the link's name for it, between the processes
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)  # its last item is on the way
    queued: float = field(default_factory=time.perf_counter)
    wait_s: float = 0.0  # in the queue before the engine took it

    def send(self, item: object) -> None:
        post([(self, item)])


def _put_all(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job.out.put_nowait(item)


@dataclass(frozen=True)
class LoopSink:
    """Jobs waited for on an event loop of this process."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, items: list[tuple[Job, object]]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop (the server shut down): nobody reads it
            self.loop.call_soon_threadsafe(_put_all, items)


def post(mail: list[tuple[Job, object]]) -> None:
    """Items to their jobs' channels, in order, in one delivery per sink: waking an event loop costs a write to its
    pipe, so a batch step's deltas share one (a wake per delta took a fifth of the server's time at 16 streams)."""
    by_sink: dict[Sink, list] = {}
    for job, item in mail:
        by_sink.setdefault(job.sink, []).append((job, item))
    for sink, items in by_sink.items():
        sink.deliver(items)
