"""One generation at a time on the engine, the rest in a bounded FIFO.

A worker thread owns the engine. Requests wait in a queue of at most `max_queue`; one more is refused
(the server answers 503). Each job has its own channel back to the request that made it, so no request can
see another's tokens. A job whose client went away is skipped if it has not started, and stopped at its
next token if it has.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsfp4.runtime.engine import Engine, Generation


class QueueFull(Exception):
    """The queue holds max_queue requests already."""


@dataclass
class Job:
    """A request's generation: what to run, and the channel its deltas, result or error come back on."""

    prompt_ids: list[int]
    options: dict[str, Any]  # Engine.stream keywords
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta..., then a Generation or an exception
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, item: object) -> None:
        if self.loop.is_closed():  # the server has shut down: nobody is left to read it
            return
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int, on_done: Callable[[Job, Generation | None], None]):
        self.engine, self.max_queue, self.on_done = engine, max_queue, on_done
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="dsfp4-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            if len(self.waiting) >= self.max_queue and self.running is not None:
                raise QueueFull
            self.waiting.append(job)
            self._wake.notify()

    def depth(self) -> int:
        """Requests waiting (not counting the one running)."""
        return len(self.waiting)

    def stop(self) -> None:
        """Cancel what waits and runs, then end the worker (the engine stays open: its owner closes it)."""
        with self._wake:
            self._stopping = True
            for job in [*self.waiting, *([self.running] if self.running else [])]:
                job.cancelled.set()
            self._wake.notify()
        self._thread.join()

    def _next(self) -> Job | None:
        with self._wake:
            while not self.waiting and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            self.running = self.waiting.popleft()
            return self.running

    def _work(self) -> None:
        while (job := self._next()) is not None:
            result = None
            try:
                if not job.cancelled.is_set():
                    result = self._run(job)
            except Exception as e:  # the request gets the error; the server goes on
                job.send(e)
            finally:
                with self._wake:
                    self.running = None
                self.on_done(job, result)

    def _run(self, job: Job) -> Generation | None:
        stream = self.engine.stream(job.prompt_ids, **job.options)
        for delta in stream:
            if job.cancelled.is_set():
                stream.close()  # the client went away: the engine is free at once
                return None
            job.send(delta)
        job.send(stream.generation)
        return stream.generation
