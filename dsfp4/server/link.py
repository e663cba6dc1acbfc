"""The link between the server's two processes, over a socket pair: the engine's (Engine, Scheduler) and the HTTP one
(front.py: parsing, tokenizing, streaming). Each then has a core and a GIL of its own: in one process the event
loop's writes of 16 streams and the engine's steps took turns (docs/BENCHMARKS.md: the server in two processes).

Messages are pickled tuples. From the HTTP process:
    ("submit", id, prompt_ids, options, echo)   ("cancel", id)   ("report", rid)
From the engine's:
    ("items", [(id, token_id, text[, (token, logprob, top)]), ...])
                                                 a step's deltas for every job (tuples: a Delta pickles slower), with
                                                 the token's log-probability where the job asked for them
    ("progress", id, done, total)                a job's prefill advanced (jobs.Progress)
    ("prompt", id, entries)                      a job's prompt log-probabilities (jobs.PromptLogprobs)
    ("end", id, outcome, result, wait_s)         a job's last item (Generation, None when cancelled, or ApiError), its
                                                 Generation where it has one, and its time in the queue
    ("report", rid, Report)

Nothing here imports torch at module level: the HTTP process imports this file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from dsfp4.runtime.generate.generation import Delta, TokenLogprob
from dsfp4.server.jobs import Job, Progress, PromptLogprobs, QueueFull, Report
from dsfp4.server.requests import ApiError

if TYPE_CHECKING:
    from dsfp4.runtime.generate.generation import Generation
    from dsfp4.server.scheduler import Scheduler

STOPPING = "the server is shutting down; retry later"
LOST = "the engine's process has stopped; the server is shutting down"
# how long /health and /metrics wait for the engine's process before they call it stuck
REPORT_S = 5.0
# the other end has gone, or what came is not a message
BROKEN = (EOFError, OSError, pickle.UnpicklingError)


class EngineLink:
    """The engine's end: runs the HTTP process's jobs on the scheduler and sends their items back (a Sink).

    serve() never waits on the HTTP process, which may itself be waiting for serve() to read (two full socket buffers
    would stall both processes): what its thread sends (reports, the ends of jobs cancelled while waiting) leaves
    through a writer thread. The engine's thread sends its steps itself: through the writer, 16 streams ran slower
    (docs/BENCHMARKS.md, run 76)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        # running or waiting, by the HTTP process's id
        self.jobs: dict[int, Job] = {}
        # a job's last item, held until its end goes with it
        self._outcomes: dict[int, object] = {}
        # one message at a time on the socket
        self._lock = threading.Lock()
        # serve()'s
        self._reader: threading.Thread | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="dsfp4-link", daemon=True)
        self._writer.start()

    def send(self, message: tuple) -> None:
        if threading.current_thread() is self._reader:
            self._outbox.put(message)
        else:
            self._send(message)

    def _send(self, message: tuple) -> None:
        # the HTTP process is gone: nobody reads
        with self._lock, contextlib.suppress(OSError):
            self.conn.send(message)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            self._send(message)

    def close(self) -> None:
        """Send what serve() left queued, then close the link."""
        self._outbox.put(None)
        self._writer.join()
        self.conn.close()

    def deliver(self, items: list[tuple[Job, object]]) -> None:
        deltas = []
        for job, item in items:
            if isinstance(item, Delta):
                lp = item.logprob
                if lp is None:
                    deltas.append((job.id, item.token_id, item.text))
                else:
                    deltas.append((job.id, item.token_id, item.text, (lp.token, lp.logprob, lp.top)))
            elif isinstance(item, Progress):
                # posted alone (Job.send), before the job's first delta
                self.send(("progress", job.id, item.done, item.total))
            elif isinstance(item, PromptLogprobs):
                self.send(("prompt", job.id, item.entries))
            else:
                # the outcome: it leaves with the job's end (done), which brings its wait and result
                self._outcomes[job.id] = ApiError.of(item) if isinstance(item, BaseException) else item
        if deltas:
            self.send(("items", deltas))

    def done(self, job: Job, result: Generation | None) -> None:
        """The scheduler's on_done (its outcome was delivered just before)."""
        self.jobs.pop(job.id, None)
        self.send(("end", job.id, self._outcomes.pop(job.id, None), result, job.wait_s))

    def serve(self, scheduler: Scheduler) -> None:
        """Answer the HTTP process until it closes its end."""
        self._reader = threading.current_thread()
        while True:
            try:
                message = self.conn.recv()
            except BROKEN:
                return
            if message[0] == "submit":
                _, jid, prompt_ids, options, echo = message
                job = self.jobs[jid] = Job(prompt_ids, options, self, jid, echo=echo)
                try:
                    scheduler.submit(job)
                except QueueFull:
                    # only while stopping: the HTTP process counts the queue as the scheduler does
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
        # submitted, not ended
        self.jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._reports: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = self._lost = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the link on `loop` from now on."""
        self._loop = loop
        loop.add_reader(self.conn.fileno(), self._read)

    def sink(self, loop: asyncio.AbstractEventLoop) -> None:
        """None: the link's reader puts each job's items on its queue itself (_handle)."""
        return None

    def submit(self, job: Job) -> None:
        # the scheduler's rule: waiting + running below max_queue + slots (a job counts here until its end)
        if self._stopping or self._lost or len(self.jobs) >= self.max_queue + self.slots:
            raise QueueFull
        job.id = next(self._ids)
        self.jobs[job.id] = job
        self._send(("submit", job.id, job.prompt_ids, job.options, job.echo))

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
        """The engine's; not alive when its process has gone or does not answer within REPORT_S."""
        if self._lost or self._loop is None:
            return self._silent()
        rid = next(self._ids)
        self._reports[rid] = answer = self._loop.create_future()
        self._send(("report", rid))
        try:
            return await asyncio.wait_for(answer, REPORT_S)
        except asyncio.TimeoutError:  # noqa: UP041  (not yet the builtin on Python 3.10)
            self._reports.pop(rid, None)
            return self._silent()

    def _silent(self) -> Report:
        return Report(False, 0, 0, self.slots, {})

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:
            self._lose()

    def _read(self) -> None:
        try:
            # every message that has come, in one wake
            while self.conn.poll():
                self._handle(self.conn.recv())
        except BROKEN:
            self._lose()

    def _handle(self, message: tuple) -> None:
        if message[0] == "items":
            for item in message[1]:
                if (job := self.jobs.get(item[0])) is not None:
                    lp = TokenLogprob(*item[3]) if len(item) > 3 else None
                    job.put(Delta(item[1], item[2], lp))
        elif message[0] == "progress":
            if (job := self.jobs.get(message[1])) is not None:
                job.out.put_nowait(Progress(*message[2:]))
        elif message[0] == "prompt":
            if (job := self.jobs.get(message[1])) is not None:
                job.out.put_nowait(PromptLogprobs(message[2]))
        elif message[0] == "end":
            _, jid, outcome, result, wait_s = message
            if (job := self.jobs.pop(jid, None)) is not None:
                # before the request reads its outcome, as the scheduler sets it
                job.wait_s = wait_s
                job.done.set()
                self.on_done(job, result)
                job.out.put_nowait(outcome)
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
                answer.set_result(self._silent())
        self._reports.clear()
        self.on_lost()
