"""A prefill's progress in the server (dsfp4/server/scheduler.py): the decoder's callback feeds /metrics' gauges and
the job's Progress items, at most one every PROGRESS_S besides the first and the last; none is left once the prefill
has ended, however it ended. A stand-in engine reports the prefill, so the test holds it where it wants."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dsfp4.runtime.generate.generation import Delta, Generation
from dsfp4.server import scheduler as scheduling
from dsfp4.server.jobs import Job, Progress
from dsfp4.server.metrics import Metrics
from dsfp4.server.scheduler import Scheduler

TOTAL, STEPS = 1024, 4
GAUGES = ("dsfp4_prefill_tokens_done", "dsfp4_prefill_tokens")


class Held:
    """An engine of one sequence at a time whose stream reports a prefill of TOTAL tokens in STEPS (after its start
    twice), waits after the `hold`th until the test lets it go, then fails or gives one token."""

    def __init__(self, hold: int, fail: bool = False):
        self.plan, self.model = SimpleNamespace(max_batch=1), None
        self.decoder = SimpleNamespace(progress=None)
        self.hold, self.fail = hold, fail
        self.held, self.go = threading.Event(), threading.Event()

    def stream(self, prompt_ids: list[int], cancel: threading.Event, **options: object) -> HeldStream:
        return HeldStream(self, prompt_ids)


class HeldStream:
    def __init__(self, engine: Held, prompt_ids: list[int]):
        self.engine, self.prompt_ids, self.generation = engine, prompt_ids, None

    def __iter__(self):
        e, report = self.engine, self.engine.decoder.progress
        # a layer-wise prefill reports 0 again while its first blocks go
        report(0, TOTAL)
        report(0, TOTAL)
        for k in range(1, STEPS + 1):
            report(k * TOTAL // STEPS, TOTAL)
            if k == e.hold:
                e.held.set()
                assert e.go.wait(30)
                if e.fail:
                    raise RuntimeError("the SSD went away")
        yield Delta(7, "a")
        self.generation = Generation(self.prompt_ids, [7], "a", "length")


class Kept:
    """A sink that keeps what it is given (the engine's thread delivers)."""

    def __init__(self) -> None:
        self.items: list[object] = []

    def deliver(self, items: list[tuple[Job, object]]) -> None:
        self.items += [item for _, item in items]


def _run(engine: Held) -> tuple[Scheduler, Job, Kept]:
    sink = Kept()
    scheduler = Scheduler(engine, 1, lambda job, result: None)
    job = Job(list(range(TOTAL)), {}, sink)
    scheduler.submit(job)
    assert engine.held.wait(30)
    return scheduler, job, sink


def _gauges(scheduler: Scheduler) -> tuple[str, str]:
    text = Metrics().render(scheduler.snapshot())
    return tuple(next(x for x in text.splitlines() if x.startswith(f"{g} ")) for g in GAUGES)


@pytest.mark.parametrize("every", [False, True])
def test_a_prefill_shows_on_metrics_while_it_runs_and_its_job_gets_its_progress(monkeypatch, every):
    monkeypatch.setattr(scheduling, "PROGRESS_S", 0.0 if every else float("inf"))
    engine = Held(hold=2)
    scheduler, job, sink = _run(engine)
    try:
        assert (scheduler.snapshot().prefill_done, scheduler.snapshot().prefill_total) == (512, TOTAL)
        assert _gauges(scheduler) == ("dsfp4_prefill_tokens_done 512", f"dsfp4_prefill_tokens {TOTAL}")
        engine.go.set()
        assert job.done.wait(30)
        assert _gauges(scheduler) == ("dsfp4_prefill_tokens_done 0", "dsfp4_prefill_tokens 0")
    finally:
        engine.go.set()
        scheduler.stop()
    steps = (0, *range(STEPS + 1)) if every else (0, STEPS)
    assert sink.items[:-2] == [Progress(k * TOTAL // STEPS, TOTAL) for k in steps]
    assert sink.items[-2] == Delta(7, "a") and isinstance(sink.items[-1], Generation)


def test_a_prefill_that_fails_leaves_no_progress_behind(monkeypatch):
    monkeypatch.setattr(scheduling, "PROGRESS_S", float("inf"))
    engine = Held(hold=2, fail=True)
    scheduler, job, sink = _run(engine)
    try:
        assert scheduler.snapshot().prefill_done == 512
        engine.go.set()
        assert job.done.wait(30)
        assert (scheduler.snapshot().prefill_done, scheduler.snapshot().prefill_total) == (0, 0)
    finally:
        engine.go.set()
        scheduler.stop()
    assert sink.items[0] == Progress(0, TOTAL) and isinstance(sink.items[-1], RuntimeError)
