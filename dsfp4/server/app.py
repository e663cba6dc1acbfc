"""The OpenAI-compatible HTTP app of `dsfp4 run MODEL --serve`.

Routes: /v1/models, /v1/chat/completions and /v1/completions (JSON, or server-sent events with "stream":
true), /health, /metrics. Every answer that is not a success carries an OpenAI-style error body. Requests
are checked and tokenized on the event loop; the generation runs on a scheduler's worker thread, and a
watcher cancels it as soon as its client disconnects. The scheduler is the engine's own (create_app: one
process) or the link to the engine's process (front.py, as `dsfp4 run --serve` runs it).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dsfp4.errors import ConfigError, ContextLengthError
from dsfp4.runtime.generate.generation import Delta, Generation
from dsfp4.runtime.generate.prompt import PromptRules
from dsfp4.runtime.generate.reasoning import ReasoningSplitter, split_reasoning
from dsfp4.server.answers import Answer, progress_comment, sse, stats
from dsfp4.server.jobs import Job, Progress, QueueFull, Report, Sink
from dsfp4.server.metrics import Metrics
from dsfp4.server.requests import ApiError, GenRequest, parse_request

if TYPE_CHECKING:
    from dsfp4.runtime.engine import Engine

# how often a request checks whether its client is still there
POLL_S = 0.25
CANCELLED = "the generation was cancelled: the server is shutting down"


@dataclass(frozen=True)
class Served:
    """What the server needs besides the engine."""

    model_id: str
    api_key: str | None = None
    max_queue: int = 16
    # default of requests without one; None: the room left in the context
    max_tokens: int | None = None


@dataclass
class Call:
    """One accepted request on its way through the engine."""

    req: GenRequest
    job: Job
    answer: Answer
    # the prompt leaves the model inside a <think> block
    thinking: bool
    watcher: asyncio.Task | None = None


class Runs(Protocol):
    """What the app asks of a scheduler (scheduler.Scheduler, link.RemoteScheduler)."""

    def sink(self, loop: asyncio.AbstractEventLoop) -> Sink | None: ...
    def submit(self, job: Job) -> None: ...
    def cancel(self, job: Job) -> None: ...
    def stop(self) -> None: ...
    async def report(self) -> Report: ...


@dataclass(frozen=True)
class Context:
    """What the endpoints share: the rules requests are checked with, the scheduler, what is served, the counts."""

    rules: PromptRules
    scheduler: Runs
    served: Served
    metrics: Metrics


Endpoint = Callable[[Context, Request], Awaitable[Response]]


def create_app(engine: Engine, served: Served) -> FastAPI:
    """The app over an engine of this process."""
    # here: the HTTP process imports this file without torch
    from dsfp4.server.scheduler import Scheduler

    metrics = Metrics()
    return build_app(engine.rules, Scheduler(engine, served.max_queue, metrics.done), served, metrics)


def build_app(rules: PromptRules, scheduler: Runs, served: Served, metrics: Metrics) -> FastAPI:
    """The app: requests checked with `rules`, run by `scheduler`, counted in `metrics`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.stop()

    app = FastAPI(title="dsfp4", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.add_exception_handler(HTTPException, http_error)
    ctx = Context(rules, scheduler, served, metrics)
    for method, path, endpoint in (
        ("POST", "/v1/chat/completions", chat_completions),
        ("POST", "/v1/completions", completions),
        ("GET", "/v1/models", models),
        ("GET", "/v1/models/{model_id:path}", model),
        ("GET", "/health", health),
        ("GET", "/metrics", prometheus),
    ):
        app.add_api_route(path, _route(ctx, endpoint), methods=[method], name=endpoint.__name__)
    return app


def _route(ctx: Context, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint as FastAPI calls it: with the request alone."""

    async def route(request: Request) -> Response:
        return await endpoint(ctx, request)

    return route


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (an unknown route, a wrong method) in the OpenAI error shape."""
    error = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
    return JSONResponse(error.body(), e.status_code)


async def chat_completions(ctx: Context, request: Request) -> Response:
    return await complete(ctx, request, chat=True)


async def completions(ctx: Context, request: Request) -> Response:
    return await complete(ctx, request, chat=False)


async def models(ctx: Context, request: Request) -> Response:
    try:
        check_key(ctx.served, request)
    except ApiError as e:
        return JSONResponse(e.body(), e.status)
    return JSONResponse({"object": "list", "data": [_card(ctx)]})


async def model(ctx: Context, request: Request) -> Response:
    """/v1/models/{id}: the served model's card, a 404 for any other id."""
    try:
        check_key(ctx.served, request)
        asked = request.path_params["model_id"]
        if asked != ctx.served.model_id:
            served = ctx.served.model_id
            raise ApiError(404, f"model {asked!r}: this server serves {served!r}", "model", "model_not_found")
    except ApiError as e:
        return JSONResponse(e.body(), e.status)
    return JSONResponse(_card(ctx))


def _card(ctx: Context) -> dict:
    card = {"id": ctx.served.model_id, "object": "model", "created": 0, "owned_by": "dsfp4"}
    # chat_template_kwargs' thinking applies
    card["thinking_switch"] = ctx.rules.tokenizer.thinking_switch
    return card


async def health(ctx: Context, request: Request) -> Response:
    r = await ctx.scheduler.report()
    if not r.alive:
        return JSONResponse({"status": "error", "detail": "the engine has stopped or does not answer"}, 503)
    return JSONResponse({"status": "ok", "busy": r.running > 0, "running": r.running, "queue": r.waiting})


async def prometheus(ctx: Context, request: Request) -> Response:
    text = ctx.metrics.render(await ctx.scheduler.report())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def complete(ctx: Context, request: Request, chat: bool) -> Response:
    """A chat or text completion: the whole answer as JSON, or its pieces as server-sent events."""
    endpoint = "chat" if chat else "completions"
    try:
        check_key(ctx.served, request)
        call = accept(ctx, parse_request(await request.body(), chat))
    except ApiError as e:
        ctx.metrics.answered(endpoint, e.status)
        return JSONResponse(e.body(), e.status)
    call.watcher = asyncio.create_task(watch(ctx.scheduler, call, request))
    if call.req.stream:
        ctx.metrics.answered(endpoint, 200)
        return StreamingResponse(events(call), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    while isinstance(item := await call.job.out.get(), (Delta, Progress)):
        pass
    # cancelled: the client is gone, nobody reads this answer
    if item is None:
        ctx.metrics.answered(endpoint, 499)
        return Response(status_code=499)
    if not isinstance(item, Generation):
        e = ApiError.of(item)
        ctx.metrics.answered(endpoint, e.status)
        return JSONResponse(e.body(), e.status)
    ctx.metrics.answered(endpoint, 200)
    reasoning, text = split_reasoning(item.text, call.thinking) if chat else ("", item.text)
    return JSONResponse(call.answer.whole(reasoning, text, item, call.job.wait_s))


def check_key(served: Served, request: Request) -> None:
    """An ApiError unless the request carries the served API key (when there is one)."""
    if served.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), served.api_key.encode()):
        raise ApiError(401, "incorrect or missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")


def accept(ctx: Context, req: GenRequest) -> Call:
    """Tokenize, check against the context, queue: an ApiError for anything the engine would refuse."""
    rules, served = ctx.rules, ctx.served
    if req.model not in (None, served.model_id):
        raise ApiError(
            404,
            f"model {req.model!r} is not served here; this server serves {served.model_id!r}",
            param="model",
            code="model_not_found",
        )
    where = "messages" if req.chat else "prompt"
    try:
        # a completion's text is raw: it skips the prompt format
        ids = rules.encode(req.prompt, raw=isinstance(req.prompt, str), thinking=req.thinking)
        rules.check(ids)
    except ContextLengthError as e:
        raise ApiError(400, _too_long(e, rules.spec.max_seq_len), where, "context_length_exceeded") from None
    except ConfigError as e:
        # the chat template refused the conversation, or a token id is out of range
        raise ApiError(400, str(e), where) from None
    room = rules.room(len(ids))
    if req.max_tokens is not None and req.max_tokens > room:
        message = f"max_tokens {req.max_tokens}: the prompt's {len(ids)} tokens leave room for {room} in this "
        raise ApiError(
            400, message + f"server's context of {rules.max_context}", "max_tokens", "context_length_exceeded"
        )
    max_tokens = req.max_tokens or min(served.max_tokens or room, room)
    job = Job(ids, {"max_tokens": max_tokens, **req.sampling}, ctx.scheduler.sink(asyncio.get_running_loop()))
    try:
        ctx.scheduler.submit(job)
    except QueueFull:
        raise ApiError(
            503, f"the server is busy: {served.max_queue} requests wait already; retry later", code="queue_full"
        ) from None
    return Call(req, job, Answer(req.chat, served.model_id), req.chat and rules.opens_thinking(ids))


def _too_long(e: ContextLengthError, positions: int) -> str:
    """The engine's message names the CLI flag; a client gets the server's, which says whether the flag would help:
    no context holds more than the model's positions."""
    message = f"the prompt is {e.tokens} tokens; this server's context holds {e.context} "
    if e.tokens < positions:
        return message + f"(start it with a larger --max-context, up to the model's {positions})"
    return message + f"and the model's positions end at {positions}, whatever --max-context: shorten the prompt"


async def watch(scheduler: Runs, call: Call, request: Request) -> None:
    """Cancel the job as soon as its client disconnects, streaming or not, until the job is done."""
    while not call.job.done.is_set():
        if await request.is_disconnected():
            scheduler.cancel(call.job)
            return
        await asyncio.sleep(POLL_S)


async def events(call: Call) -> AsyncIterator[str]:
    """A streamed answer's server-sent events, up to [DONE] or an error's body."""
    a, splitter = call.answer, ReasoningSplitter(call.thinking)
    if call.req.chat:
        yield sse(a.chunk(role=True))
    out = call.job.out
    item = await out.get()
    while isinstance(item, (Delta, Progress)):
        if isinstance(item, Progress):
            yield progress_comment(item)
            item = await out.get()
            continue
        piece, item = item.text, None
        # deltas that queued while the last chunk went out leave as one chunk
        while not out.empty():
            if not isinstance(nxt := out.get_nowait(), Delta):
                item = nxt
                break
            piece += nxt.text
        reasoning, text = splitter.feed(piece) if call.req.chat else ("", piece)
        if reasoning or text:
            yield a.event(reasoning, text)
        if item is None:
            item = await out.get()
    if isinstance(item, Generation):
        reasoning, text = splitter.flush() if call.req.chat else ("", "")
        yield sse({**a.chunk(reasoning, text, item.finish_reason), "stats": stats(item, call.job.wait_s)})
        if call.req.include_usage:
            yield sse(a.usage_chunk(item))
        yield sse("[DONE]")
    else:
        # an error, or None: cancelled because the client left (unread) or the server is shutting down
        e = ApiError.of(item) if item is not None else ApiError(503, CANCELLED, code="cancelled")
        yield sse(e.body())
