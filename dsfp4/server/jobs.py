"""A request's generation as both of the server's processes see it: the Job (what to run, and the channel its results
come back on), its prefill's Progress, the engine's state as /health and /metrics report it, and how results reach
whoever waits for them.

Nothing here imports torch: the HTTP process uses it too (link.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsfp4.runtime.generate.generation import Delta, TokenLogprob


class QueueFull(Exception):
    """max_queue requests wait already (or the server is shutting down)."""


@dataclass(frozen=True)
class Report:
    """The engine's side of /health and /metrics."""

    # the engine's worker thread runs
    alive: bool
    # requests in the queue
    waiting: int
    # generations running
    running: int
    # generations at once (--max-batch)
    slots: int
    # the expert store's, since the engine opened
    counters: dict[str, float]
    # of the prompt being prefilled, its tokens done and of how many (0 and 0 when none is)
    prefill_done: int = 0
    prefill_total: int = 0


@dataclass(frozen=True)
class Progress:
    """A prefill's advance on its job's channel, before the job's first Delta: prompt tokens done, of how many (those
    the prefill feeds: a reused prefix is not among them)."""

    done: int
    total: int


@dataclass(frozen=True)
class PromptLogprobs:
    """A completion's echo on its job's channel, before its first Delta: each prompt token's log-probability and
    alternatives (None for the first: nothing comes before it)."""

    entries: list[TokenLogprob | None]


class Sink(Protocol):
    def deliver(self, items: list[tuple[Job, object]]) -> None:
        """Items to their jobs' channels, in order."""


@dataclass(eq=False)
class Job:
    """A request's generation: what to run, and the channel its results come back on: Progress... while its prompt
    is prefilled (and PromptLogprobs where `echo` asks), Delta..., then the Generation, or None when it was
    cancelled, or the exception that ended it."""

    prompt_ids: list[int]
    # Engine.stream keywords
    options: dict[str, Any]
    # where post() sends its items from the engine's thread; None where the link brings them
    sink: Sink | None
    # the link's name for it, between the processes
    id: int = 0
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # its last item is on the way
    done: threading.Event = field(default_factory=threading.Event)
    queued: float = field(default_factory=time.perf_counter)
    # in the queue before the engine took it
    wait_s: float = 0.0
    # the prompt's log-probabilities with this many alternatives, before the answer (None: not asked)
    echo: int | None = None
    # where its channel is read: when its request had come whole (the start of its time to first token), what
    # times each token that reaches the channel (metrics.Metrics.token; None: nothing), and when the last one did
    received: float = field(default_factory=time.perf_counter)
    on_token: Callable[[Job, float], None] | None = None
    last_token: float | None = None

    def send(self, item: object) -> None:
        post([(self, item)])

    def put(self, item: object) -> None:
        """An item onto its channel, on the loop that reads it."""
        if self.on_token is not None and isinstance(item, Delta):
            self.on_token(self, time.perf_counter())
        self.out.put_nowait(item)


def _put_all(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job.put(item)


@dataclass(frozen=True)
class LoopSink:
    """Jobs waited for on an event loop of this process."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, items: list[tuple[Job, object]]) -> None:
        # a closed event loop (the server shut down): nobody reads it
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_put_all, items)


def post(mail: list[tuple[Job, object]]) -> None:
    """Items to their jobs' channels, in order, in one delivery per sink: waking an event loop costs a write to its
    pipe, so a batch step's deltas share one (a wake per delta took a fifth of the server's time at 16 streams)."""
    by_sink: dict[Sink, list] = {}
    for job, item in mail:
        by_sink.setdefault(job.sink, []).append((job, item))
    for sink, items in by_sink.items():
        sink.deliver(items)
