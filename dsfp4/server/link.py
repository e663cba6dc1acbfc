"""The link between the server's two processes, over a socket pair: the engine's (Engine, Scheduler) and the HTTP one
(front.py: parsing, tokenizing, streaming). Each then has a core and a GIL of its own: in one process the event
loop's writes of 16 streams and the engine's steps took turns (16 streams: 0.9 ms a step against 0.4 in process).

Messages are pickled tuples. From the HTTP process:
    ("submit", id, prompt_ids, options)   ("cancel", id)   ("report", rid)
From the engine's:
    ("items", [(id, item), ...])   a step's items for every job: Delta..., then its outcome (Generation, None, ApiError)
    ("done", id, result, wait_s)   the job has ended: its Generation (None without one) and its time in the queue
    ("report", rid, Report)

Nothing here imports torch at module level: the HTTP process imports this file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from dsfp4.server.jobs import Job, QueueFull, Report
from dsfp4.server.requests import ApiError

if TYPE_CHECKING:
    from dsfp4.runtime.generate.generation import Generation
    from dsfp4.server.scheduler import Scheduler

STOPPING = "the server is shutting down; retry later"
LOST = "the engine's process has stopped; the server is shutting down"


class EngineLink:
    """The engine's end: runs the HTTP process's jobs on the scheduler and sends their items back (a Sink)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.jobs: dict[int, Job] = {}  # running or waiting, by the HTTP process's id
        self._lock = threading.Lock()  # the engine's thread and serve()'s both send

    def send(self, message: tuple) -> None:
        with self._lock, contextlib.suppress(OSError):  # the HTTP process is gone: nobody reads
            self.conn.send(message)

    def deliver(self, items: list[tuple[Job, object]]) -> None:
        wire = [(job.id, ApiError.of(item) if isinstance(item, BaseException) else item) for job, item in items]
        self.send(("items", wire))

    def done(self, job: Job, result: Generation | None) -> None:
        """The scheduler's on_done."""
        self.jobs.pop(job.id, None)
        self.send(("done", job.id, result, job.wait_s))

    def serve(self, scheduler: Scheduler) -> None:
        """Answer the HTTP process until it closes its end."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            if message[0] == "submit":
                _, jid, prompt_ids, options = message
                job = self.jobs[jid] = Job(prompt_ids, options, self, jid)
                try:
                    scheduler.submit(job)
                except QueueFull:  # only while stopping: the HTTP process counts the queue as the scheduler does
                    self.deliver([(job, ApiError(503, STOPPING, code="queue_full"))])
                    self.done(job, None)
            elif message[0] == "cancel":
                if (job := self.jobs.get(message[1])) is not None:
                    scheduler.cancel(job)
            elif message[0] == "report":
                self.send(("report", message[1], scheduler.snapshot()))


class RemoteScheduler:
    """The HTTP process's end: the app's scheduler (Scheduler's interface) for jobs that run in the engine's process.
    It lives on the event loop: the link's messages are read there as they come."""

    def __init__(
        self,
        conn: Connection,
        max_queue: int,
        slots: int,
        on_done: Callable[[Job, Generation | None], None],
        on_lost: Callable[[], None],
    ):
        self.conn, self.max_queue, self.slots, self.on_done, self.on_lost = conn, max_queue, slots, on_done, on_lost
        self.jobs: dict[int, Job] = {}  # submitted, not done
        self._ids = itertools.count(1)
        self._reports: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = self._lost = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the link on `loop` from now on."""
        self._loop = loop
        loop.add_reader(self.conn.fileno(), self._read)

    def submit(self, job: Job) -> None:
        # the scheduler's rule: waiting + running below max_queue + slots (a job counts here until its "done")
        if self._stopping or self._lost or len(self.jobs) >= self.max_queue + self.slots:
            raise QueueFull
        job.id = next(self._ids)
        self.jobs[job.id] = job
        self._send(("submit", job.id, job.prompt_ids, job.options))

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        if job.id in self.jobs:
            self._send(("cancel", job.id))

    def cancel_all(self) -> None:
        for job in list(self.jobs.values()):
            self.cancel(job)

    def stop(self) -> None:
        self._stopping = True
        self.cancel_all()

    async def report(self) -> Report:
        if self._lost or self._loop is None:
            return Report(False, 0, 0, self.slots, {})
        rid = next(self._ids)
        self._reports[rid] = answer = self._loop.create_future()
        self._send(("report", rid))
        return await answer

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:
            self._lose()

    def _read(self) -> None:
        try:
            while self.conn.poll():  # every message that has come, in one wake
                self._handle(self.conn.recv())
        except (EOFError, OSError):
            self._lose()

    def _handle(self, message: tuple) -> None:
        if message[0] == "items":
            for jid, item in message[1]:
                if (job := self.jobs.get(jid)) is not None:
                    job.out.put_nowait(item)
        elif message[0] == "done":
            _, jid, result, wait_s = message
            if (job := self.jobs.pop(jid, None)) is not None:
                job.wait_s = wait_s
                job.done.set()
                self.on_done(job, result)
        elif message[0] == "report" and (answer := self._reports.pop(message[1], None)) and not answer.done():
            answer.set_result(message[2])

    def _lose(self) -> None:
        """The engine's process has gone: every job ends with an error, and the HTTP process stops."""
        if self._lost:
            return
        self._lost = True
        if self._loop is not None:
            self._loop.remove_reader(self.conn.fileno())
        for job in self.jobs.values():
            job.out.put_nowait(ApiError(503, LOST, code="engine_stopped"))
            job.done.set()
            self.on_done(job, None)
        self.jobs.clear()
        for answer in self._reports.values():
            if not answer.done():
                answer.set_result(Report(False, 0, 0, self.slots, {}))
        self._reports.clear()
        self.on_lost()
