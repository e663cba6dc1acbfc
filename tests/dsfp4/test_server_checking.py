"""A request is parsed, rendered and tokenized on a thread (app.check), not on the event loop: /health answers while a
long prompt is tokenized. The app over the tiny model's prompt rules, its tokenizing held by the test where it wants,
and a stand-in scheduler that only reports."""

from __future__ import annotations

import asyncio
import threading

import httpx

from dsfp4.runtime.engine import prompt_rules
from dsfp4.runtime.options import RunOptions
from dsfp4.server.app import Served, build_app
from dsfp4.server.jobs import Job, Report
from dsfp4.server.metrics import Metrics
from tests.fixtures.server import CONTEXT, messages

# a hang guard, never a measure: how long the held tokenizing waits for the test at the most
HANG_S = 30


class Idle:
    """A scheduler with nothing to run."""

    def sink(self, loop: asyncio.AbstractEventLoop) -> None:
        return None

    def submit(self, job: Job) -> None:
        raise AssertionError("nothing gets this far: the prompt is refused")

    def cancel(self, job: Job) -> None:
        pass

    def stop(self) -> None:
        pass

    async def report(self) -> Report:
        return Report(True, 0, 0, 1, {})


def test_health_answers_while_a_prompt_is_tokenized(converted):
    rules = prompt_rules(converted, RunOptions(device="cpu", max_context=CONTEXT))
    began, go, ended = threading.Event(), threading.Event(), threading.Event()

    def held_encode(*args: object, **kwargs: object) -> list[int]:
        began.set()
        go.wait(HANG_S)
        ended.set()
        # longer than the context: refused once tokenized
        return [1] * (CONTEXT + 1)

    rules.encode = held_encode
    app = build_app(rules, Idle(), Served("fp8"), Metrics())

    async def scenario() -> tuple[int, bool, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            long = asyncio.create_task(client.post("/v1/chat/completions", json={"messages": messages("long")}))
            assert await asyncio.to_thread(began.wait, HANG_S)
            health = await client.get("/health")
            # still tokenizing when /health answered: on the loop, tokenizing would have held /health back
            still = not ended.is_set()
            go.set()
            return health.status_code, still, await long

    status, still, refused = asyncio.run(scenario())
    assert status == 200 and still
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
