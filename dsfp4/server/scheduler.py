"""The engine's generations, fed from a bounded FIFO: one at a time, or with --max-batch above 1 up to max_batch
decoding together (continuous batching: a waiting request joins the batch at the next token boundary, its prompt
prefilled then, while the others wait that long; runtime/generate/batch.py).

A worker thread owns the engine. While the engine is full, at most `max_queue` requests wait; one more is
refused (the server answers 503). Each job has its own channel back to the request that made it, so no
request can see another's tokens. A job whose client went away is dropped from the queue if it waits, and
stopped at its next prefill chunk or token if it runs.

A prompt prefilled alone (every prompt with --max-batch 1, a prompt joining the batch alone) reports its progress
through the decoder's callback: what /metrics shows, and Progress items on the job's channel, at most one every
PROGRESS_S besides the first and the last.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.batch import BatchRun, BatchSequence
from dsfp4.runtime.generate.decoder import Cancelled
from dsfp4.runtime.generate.generation import Generation
from dsfp4.runtime.generate.logprobs import prompt_logprobs
from dsfp4.server.jobs import Job, LoopSink, Progress, PromptLogprobs, QueueFull, Report, post

# a prefill's Progress items on its job's channel: one every this many seconds at most, besides the first and the last
PROGRESS_S = 0.25


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int, on_done: Callable[[Job, Generation | None], None]):
        self.engine, self.max_queue, self.on_done = engine, max_queue, on_done
        # generations at once
        self.slots = engine.plan.max_batch
        self.waiting: deque[Job] = deque()
        self.running: set[Job] = set()
        # re-entrant: a signal handler may cancel_all
        self._wake = threading.Condition(threading.RLock())
        self._stopping = False
        # the job whose prompt the decoder feeds, (its tokens done, of how many), when its last Progress went out
        self._prefilling: Job | None = None
        self._prefill, self._sent = (0, 0), 0.0
        engine.decoder.progress = self._progress
        work = self._work_batched if self.slots > 1 else self._work
        self._thread = threading.Thread(target=work, name="dsfp4-engine", daemon=True)
        self._thread.start()

    def sink(self, loop: asyncio.AbstractEventLoop) -> LoopSink:
        """Where a job made on `loop` gets its items: that loop, woken from the engine's thread."""
        return LoopSink(loop)

    def submit(self, job: Job) -> None:
        with self._wake:
            if self._stopping or len(self.waiting) >= self.max_queue + self.slots - len(self.running):
                raise QueueFull
            self.waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it at its next chunk or token if it runs."""
        job.cancelled.set()
        with self._wake:
            waiting = job in self.waiting
            if waiting:
                self.waiting.remove(job)
        if waiting:
            self._finish(job, None, None)

    def cancel_all(self) -> None:
        with self._wake:
            jobs = [*self.waiting, *self.running]
        for job in jobs:
            self.cancel(job)

    def depth(self) -> int:
        """Requests waiting (not counting those running)."""
        return len(self.waiting)

    def busy(self) -> int:
        """Generations running."""
        return len(self.running)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> Report:
        model = self.engine.model
        counters = model.experts.counters.snapshot() if model is not None else {}
        return Report(self.alive(), self.depth(), self.busy(), self.slots, counters, *self._prefill)

    async def report(self) -> Report:
        """snapshot(), as the app awaits it (from another process, RemoteScheduler.report)."""
        return self.snapshot()

    def stop(self) -> None:
        """Cancel what waits and runs, then end the worker (the engine stays open: its owner closes it)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self.cancel_all()
        self._thread.join()

    def _finish(self, job: Job, outcome: object, result: Generation | None) -> None:
        with self._wake:
            self.running.discard(job)
        job.send(outcome)
        job.done.set()
        self.on_done(job, result)

    def _progress(self, done: int, total: int) -> None:
        """The decoder's progress callback, on the engine's thread: (tokens done, of how many), from (0, n) on (a
        layer-wise prefill may report a count again, 0 among them, as its first blocks go)."""
        first = self._prefill == (0, 0)
        self._prefill = (done, total) if done < total else (0, 0)
        job, now = self._prefilling, time.monotonic()
        if job is None or total == 0:
            return
        if first or done >= total or now - self._sent >= PROGRESS_S:
            self._sent = now
            job.send(Progress(done, total))

    @contextmanager
    def _feeding(self, job: Job | None) -> Iterator[None]:
        """While the block runs, the decoder's progress is `job`'s (None: no one job's, /metrics' alone); none is after
        it (a prefill that failed or was cancelled included)."""
        self._prefilling = job
        try:
            yield
        finally:
            self._prefilling, self._prefill = None, (0, 0)

    def _take(self, most: int, idle: bool) -> list[Job] | None:
        """Up to `most` waiting jobs, now running; when `idle`, waits for one. None: stopping."""
        with self._wake:
            while idle and not self.waiting and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            jobs = [self.waiting.popleft() for _ in range(min(most, len(self.waiting)))]
            self.running.update(jobs)
        for job in jobs:
            job.wait_s = time.perf_counter() - job.queued
        return jobs

    def _work(self) -> None:
        while (jobs := self._take(1, idle=True)) is not None:
            (job,) = jobs
            result, outcome = None, None
            try:
                # the prefill runs as the first delta is asked for; a decode step reports no progress
                with self._feeding(job):
                    self._echo(job)
                    stream = self.engine.stream(job.prompt_ids, cancel=job.cancelled, **job.options)
                    for delta in stream:
                        job.send(delta)
                result = stream.generation
                outcome = None if result.finish_reason == "cancelled" else result
            except Exception as e:
                # the request gets the error; the server goes on
                outcome = e
            self._finish(job, outcome, result)

    def _work_batched(self) -> None:
        """Continuous batching: between steps, waiting jobs take the free slots (each prefilled then); a step decodes
        a token of every running job; each job's deltas go out after the step that made them."""
        # BatchSequence -> Job
        batch, live = None, {}
        try:
            batch = self.engine.batch()
            # the tokens of steps run inside a joining prompt's prefill go out at once; a joint prefill's progress
            # is /metrics'
            batch.on_step, batch.progress = lambda: self._send(live), self._progress
            while (jobs := self._take(batch.free, idle=not live)) is not None:
                self._admit(batch, jobs, live)
                try:
                    batch.step()
                except Exception as e:
                    # every running request gets the error; the server goes on
                    for job in live.values():
                        self._finish(job, e, None)
                    live.clear()
                    batch.cancel_all()
                self._send(live)
        finally:
            if batch is not None:
                batch.cancel_all()
            self._send(live)

    def _admit(self, batch: BatchRun, jobs: list[Job], live: dict[BatchSequence, Job]) -> None:
        """Jobs into the batch: prefilled together where the batch does that (BatchRun.add_many), else one by one."""
        asks = []
        for job in list(jobs):
            try:
                self._echo(job)
                asks.append((job.prompt_ids, self.engine.options_for(**job.options), job.cancelled))
            except Exception as e:
                # the request gets the error; the others go on
                jobs.remove(job)
                self._finish(job, e, None)
        if len(jobs) > 1 and batch.joint:
            try:
                with self._feeding(None):
                    live.update(zip(batch.add_many(asks), jobs, strict=True))
            except Exception as e:
                # every request of the pass gets the error (none joined); the server goes on
                for job in jobs:
                    self._finish(job, e, None)
            return
        for job, ask in zip(jobs, asks, strict=True):
            try:
                with self._feeding(job):
                    live[batch.add(*ask)] = job
            except Cancelled:
                self._finish(job, None, None)
            except Exception as e:
                # the request gets the error; the server goes on
                self._finish(job, e, None)

    def _echo(self, job: Job) -> None:
        """The prompt's log-probabilities where the job asks (a completion's echo): the prompt prefilled from its
        start, its KV then kept for the generation after it."""
        if job.echo is not None:
            ids = job.prompt_ids
            job.send(PromptLogprobs(prompt_logprobs(self.engine.logits(ids), ids, job.echo)))

    def _send(self, live: dict[BatchSequence, Job]) -> None:
        """Each sequence's new deltas to its request (all in one post), then the outcomes of those that ended, which
        leave `live`."""
        post([(job, delta) for seq, job in live.items() for delta in seq.deltas])
        for seq in list(live):
            seq.deltas.clear()
            if (g := seq.generation) is not None:
                self._finish(live.pop(seq), None if g.finish_reason == "cancelled" else g, g)
