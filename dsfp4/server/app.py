"""The OpenAI-compatible HTTP app of `dsfp4 run MODEL --serve`.

Routes: /v1/models, /v1/chat/completions and /v1/completions (JSON, or server-sent events with "stream":
true), /health, /metrics. Every answer that is not a success carries an OpenAI-style error body. A request's body is
read within its limits (body.py), then checked and tokenized on a thread, so that the event loop goes on streaming
and answering /health meanwhile; the generation runs on a scheduler's worker thread, and a watcher cancels it as
soon as its client disconnects. The scheduler is the engine's own (create_app: one
process) or the link to the engine's process (front.py, as `dsfp4 run --serve` runs it).
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dsfp4.errors import ConfigError, ContextLengthError
from dsfp4.runtime.generate.answer.answer_format import AnswerFormat
from dsfp4.runtime.generate.answer.grammar_compiler import GrammarCompiler
from dsfp4.runtime.generate.answer.tool_scan import ToolCallError
from dsfp4.runtime.generate.generation import Delta, Generation
from dsfp4.runtime.generate.prompt import PromptRules
from dsfp4.server.answers import Answer, progress_comment, sse, stats
from dsfp4.server.body import read_body
from dsfp4.server.choices import Asked, Choice
from dsfp4.server.client_limits import READ_TIMEOUT_S, default_max_body
from dsfp4.server.jobs import Job, Progress, PromptLogprobs, QueueFull, Report, Sink
from dsfp4.server.metrics import Metrics
from dsfp4.server.requests import ApiError, GenRequest, parse_request

if TYPE_CHECKING:
    from dsfp4.runtime.engine import Engine

# how often a request checks whether its client is still there
POLL_S = 0.25
CANCELLED = "the generation was cancelled: the server is shutting down"
T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    """What the server needs besides the engine."""

    model_id: str
    api_key: str | None = None
    max_queue: int = 16
    # default of requests without one; None: the room left in the context
    max_tokens: int | None = None
    # a request's body at most (None: sized from the context, client_limits.py), and how long its head and then its
    # body may take to come (body.py, deadline.py)
    max_body: int | None = None
    read_timeout: float = READ_TIMEOUT_S


@dataclass
class Call:
    """One accepted request on its way through the engine: a job per choice."""

    req: GenRequest
    jobs: list[Job]
    answer: Answer
    choices: list[Choice]
    watcher: asyncio.Task | None = None

    @property
    def done(self) -> bool:
        return all(job.done.is_set() for job in self.jobs)


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
    # a request's grammar compiled here before it is queued: one that does not compile is a 400 before anything
    # streams (this process's own compiler, built at the first grammar)
    grammars: GrammarCompiler
    # bytes of a request's body at most
    max_body: int
    # requests are checked on threads; the compiler keeps what it compiled for all of them
    compiling: threading.Lock = field(default_factory=threading.Lock)


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
    spec = rules.spec
    grammars = GrammarCompiler(Path(spec.model_dir) / "tokenizer.json", spec.vocab_size, rules.tokenizer.eos_ids)
    max_body = served.max_body if served.max_body is not None else default_max_body(rules.max_context)
    ctx = Context(rules, scheduler, served, metrics, grammars, max_body)
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
        body = await read_body(request, ctx.max_body, ctx.served.read_timeout)
        received = time.perf_counter()
        # a long prompt takes seconds to parse, render and tokenize: on a thread, so the loop goes on meanwhile
        req, checked = await asyncio.to_thread(_parsed_and_checked, ctx, body, chat)
        call = accept(ctx, req, checked, received)
    except ApiError as e:
        ctx.metrics.answered(endpoint, e.status)
        return JSONResponse(e.body(), e.status)
    call.watcher = asyncio.create_task(watch(ctx.scheduler, call, request))
    if call.req.stream:
        ctx.metrics.answered(endpoint, 200)
        media = "text/event-stream"
        return StreamingResponse(events(ctx, call), media_type=media, headers={"Cache-Control": "no-cache"})
    status, body = await whole(ctx, call)
    ctx.metrics.answered(endpoint, status)
    return JSONResponse(body, status) if body is not None else Response(status_code=status)


async def whole(ctx: Context, call: Call) -> tuple[int, dict | None]:
    """A non-streamed answer -> (status, body): every choice's, or the first error (the other choices cancelled)."""
    results, made = [], []
    for choice, job in zip(call.choices, call.jobs, strict=True):
        while isinstance(item := await job.out.get(), (Delta, Progress, PromptLogprobs)):
            if isinstance(item, PromptLogprobs):
                choice.prompt = item.entries
        # cancelled: the client is gone, nobody reads this answer
        if item is None:
            return 499, None
        try:
            if not isinstance(item, Generation):
                raise ApiError.of(item)
            made.append(call.answer.whole_choice(choice.index, *choice.whole(item)))
        except (ApiError, ToolCallError) as e:
            _cancel(ctx, call)
            error = e if isinstance(e, ApiError) else _malformed(e)
            return error.status, error.body()
        results.append(item)
    return 200, call.answer.whole(made, results, call.jobs[0].wait_s)


def _malformed(e: ToolCallError) -> ApiError:
    return ApiError(500, f"the model's tool call is malformed: {e}", code="invalid_tool_call")


def _cancel(ctx: Context, call: Call) -> None:
    for job in call.jobs:
        if not job.done.is_set():
            ctx.scheduler.cancel(job)


def check_key(served: Served, request: Request) -> None:
    """An ApiError unless the request carries the served API key (when there is one)."""
    if served.api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), served.api_key.encode()):
        raise ApiError(401, "incorrect or missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")


@dataclass(frozen=True)
class Checked:
    """A request as check() leaves it: its prompt's ids, its jobs' options, its answer and what its choices read."""

    ids: list[int]
    options: dict
    answer: Answer
    asked: Asked


def _parsed_and_checked(ctx: Context, body: bytes, chat: bool) -> tuple[GenRequest, Checked]:
    req = parse_request(body, chat)
    return req, check(ctx, req)


def check(ctx: Context, req: GenRequest) -> Checked:
    """Tokenize, check against the context, compile the answer's grammar: an ApiError for anything the engine would
    refuse. Thread-safe: requests are checked off the event loop."""
    rules, served = ctx.rules, ctx.served
    if req.model not in (None, served.model_id):
        raise ApiError(
            404,
            f"model {req.model!r} is not served here; this server serves {served.model_id!r}",
            param="model",
            code="model_not_found",
        )
    fmt = _field_error(lambda: _answer_format(rules, req))
    where = "messages" if req.chat else "prompt"
    try:
        # a completion's text is raw: it skips the prompt format
        ids = rules.encode(req.prompt, raw=isinstance(req.prompt, str), thinking=req.thinking, tools=fmt.prompt_tools)
        rules.check(ids)
    except ContextLengthError as e:
        raise ApiError(400, _too_long(e, rules.spec.max_seq_len), where, "context_length_exceeded") from None
    except ConfigError as e:
        # the chat template refused the conversation, a message's field it cannot carry, a token id out of range
        raise ApiError(400, str(e), where) from None
    room = rules.room(len(ids))
    if req.max_tokens is not None and req.max_tokens > room:
        message = f"max_tokens {req.max_tokens}: the prompt's {len(ids)} tokens leave room for {room} in this "
        raise ApiError(
            400, message + f"server's context of {rules.max_context}", "max_tokens", "context_length_exceeded"
        )
    thinking = req.chat and rules.opens_thinking(ids)
    options = {"max_tokens": req.max_tokens or min(served.max_tokens or room, room), **req.sampling}
    if req.logprobs is not None:
        options["logprobs"] = req.logprobs
    if (grammar := _field_error(lambda: fmt.grammar(rules.tokenizer, thinking))) is not None:
        with ctx.compiling:
            _field_error(lambda: ctx.grammars.compile(grammar))
        options["grammar"] = grammar
    answer = Answer(req.chat, served.model_id)
    echo = (req.prompt if isinstance(req.prompt, str) else rules.tokenizer.decode(ids)) if req.echo else ""
    asked = Asked(req.chat, fmt, rules.tokenizer, ids, thinking, req.logprobs is not None, echo, answer.id[-24:])
    return Checked(ids, options, answer, asked)


def accept(ctx: Context, req: GenRequest, checked: Checked, received: float) -> Call:
    """A job per choice of a checked request, queued (on the event loop: the jobs' channels are its), or a 503.
    `received`: perf_counter when the request had come whole."""
    echo = req.logprobs if req.echo else None
    jobs = [_job(ctx, checked.ids, checked.options, i, echo, received) for i in range(req.n)]
    return Call(req, _submit(ctx, jobs), checked.answer, [Choice(i, checked.asked) for i in range(req.n)])


def _answer_format(rules: PromptRules, req: GenRequest) -> AnswerFormat:
    if not req.chat:
        return AnswerFormat()
    return AnswerFormat.of(rules.tokenizer, req.tools, req.tool_choice, req.parallel_tool_calls, req.response_format)


def _field_error(check: Callable[[], T]) -> T:
    """check()'s value; its ConfigError, which starts with the field it names ("tools[0].function.name: ..."), a
    400 with that field as its param."""
    try:
        return check()
    except ConfigError as e:
        message = str(e)
        raise ApiError(400, message, param=message.split(":", 1)[0].split(" ", 1)[0]) from None


def _job(ctx: Context, ids: list[int], options: dict, i: int, echo: int | None, received: float) -> Job:
    """Choice i's job: seeds count up from the request's, so choices differ and each is reproducible."""
    if i and options.get("seed") is not None:
        options = {**options, "seed": options["seed"] + i}
    sink = ctx.scheduler.sink(asyncio.get_running_loop())
    return Job(ids, options, sink, echo=echo, received=received, on_token=ctx.metrics.token)


def _submit(ctx: Context, jobs: list[Job]) -> list[Job]:
    """Every choice's job queued, or none (503: the queue cannot hold them all)."""
    for k, job in enumerate(jobs):
        try:
            ctx.scheduler.submit(job)
        except QueueFull:
            for queued in jobs[:k]:
                ctx.scheduler.cancel(queued)
            message = f"the server is busy: {ctx.served.max_queue} requests wait already; retry later"
            raise ApiError(503, message, code="queue_full") from None
    return jobs


def _too_long(e: ContextLengthError, positions: int) -> str:
    """The engine's message names the CLI flag; a client gets the server's, which says whether the flag would help:
    no context holds more than the model's positions."""
    message = f"the prompt is {e.tokens} tokens; this server's context holds {e.context} "
    if e.tokens < positions:
        return message + f"(start it with a larger --max-context, up to the model's {positions})"
    return message + f"and the model's positions end at {positions}, whatever --max-context: shorten the prompt"


async def watch(scheduler: Runs, call: Call, request: Request) -> None:
    """Cancel the job as soon as its client disconnects, streaming or not, until the job is done."""
    while not call.done:
        if await request.is_disconnected():
            for job in call.jobs:
                scheduler.cancel(job)
            return
        await asyncio.sleep(POLL_S)


async def events(ctx: Context, call: Call) -> AsyncIterator[str]:
    """A streamed answer's server-sent events, up to [DONE] or an error's body (then no [DONE]: a stream cut short
    never looks complete)."""
    a, choices, inbox = call.answer, call.choices, Inbox(call.jobs)
    ended: dict[int, Generation] = {}
    try:
        if call.req.chat:
            for c in choices:
                yield sse(a.chunk(role=True, index=c.index))
        while len(ended) < len(choices):
            for i, item in await inbox.take():
                out = _event(call, choices[i], item, ended)
                if out:
                    yield out
    except (ApiError, ToolCallError) as e:
        _cancel(ctx, call)
        yield sse((e if isinstance(e, ApiError) else _malformed(e)).body())
        return
    finally:
        inbox.close()
    results = [ended[c.index] for c in choices]
    if call.req.include_usage:
        yield sse(a.usage_chunk(results))
    yield sse("[DONE]")


def _event(call: Call, choice: Choice, item: object, ended: dict[int, Generation]) -> str:
    """The events of one item of a choice's channel ("" for none); ApiError or ToolCallError to end the stream."""
    a = call.answer
    if isinstance(item, Progress):
        return progress_comment(item) if choice.index == 0 else ""
    if isinstance(item, PromptLogprobs):
        choice.prompt = item.entries
        return ""
    if not isinstance(item, (list, Generation)):
        # an error, or None: cancelled because the client left (unread) or the server is shutting down
        raise ApiError.of(item) if item is not None else ApiError(503, CANCELLED, code="cancelled")
    # a completion's echo goes first
    head = sse(a.piece_chunk(choice.index, echo)) if (echo := choice.start()) is not None else ""
    if isinstance(item, list):
        piece = choice.feed(item)
        if piece is None:
            return head
        if piece.plain and choice.index == 0:
            return head + a.event(piece.reasoning, piece.text)
        return head + sse(a.piece_chunk(choice.index, piece))
    ended[choice.index] = item
    piece, finish = choice.end(item)
    wait_s = call.jobs[choice.index].wait_s
    return head + sse({**a.piece_chunk(choice.index, piece, finish), "stats": stats(item, wait_s)})


class Inbox:
    """The items of a request's jobs as they come, (choice, item) in order, a choice's deltas in a row as one list:
    deltas that queued while the last chunk went out leave as one chunk. One job's channel is read as it is; several
    are forwarded into one."""

    def __init__(self, jobs: list[Job]):
        self.one = len(jobs) == 1
        self.queue: asyncio.Queue = jobs[0].out if self.one else asyncio.Queue()
        self.tasks = [] if self.one else [asyncio.create_task(self._forward(i, job)) for i, job in enumerate(jobs)]

    async def _forward(self, i: int, job: Job) -> None:
        while isinstance(item := await job.out.get(), (Delta, Progress, PromptLogprobs)):
            self.queue.put_nowait((i, item))
        self.queue.put_nowait((i, item))

    async def take(self) -> list[tuple[int, object]]:
        """What has come (waiting for the first)."""
        got = [await self.queue.get()]
        while not self.queue.empty():
            got.append(self.queue.get_nowait())
        out: list[tuple[int, object]] = []
        for i, item in ((0, x) for x in got) if self.one else got:
            if not isinstance(item, Delta):
                out.append((i, item))
            elif out and out[-1][0] == i and isinstance(out[-1][1], list):
                out[-1][1].append(item)
            else:
                out.append((i, [item]))
        return out

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
