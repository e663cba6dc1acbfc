"""`dsfp4 run MODEL --serve`: an OpenAI-compatible HTTP server over one Engine.

Routes: /v1/models, /v1/chat/completions and /v1/completions (JSON, or server-sent events with "stream":
true), /health, /metrics. Every answer that is not a success carries an OpenAI-style error body. Requests
are checked and tokenized on the event loop; the generation runs on the scheduler's worker thread.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dsfp4.errors import ConfigError
from dsfp4.runtime.engine import Delta, Engine, Generation
from dsfp4.runtime.reasoning import ReasoningSplitter, opens_thinking, split_reasoning
from dsfp4.server.metrics import Metrics
from dsfp4.server.requests import ApiError, GenRequest, parse_request
from dsfp4.server.scheduler import Job, QueueFull, Scheduler

POLL_S = 0.25  # how often a waiting request checks whether its client is still there


@dataclass(frozen=True)
class Served:
    """What the server needs besides the engine."""

    model_id: str
    api_key: str | None = None
    max_queue: int = 16


@dataclass
class Call:
    """One accepted request on its way: ids for the engine and how to shape the answer."""

    req: GenRequest
    job: Job
    thinking: bool  # the prompt leaves the model inside a <think> block
    rid: str
    created: int


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(g: Generation) -> dict:
    n, m = g.stats.prompt_tokens, g.stats.generated_tokens
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    return ApiError(500, f"generation failed: {e}")


def create_app(engine: Engine, served: Served) -> FastAPI:
    metrics = Metrics()

    def done(job: Job, result: Generation | None) -> None:
        if result is not None:
            metrics.finish(result.finish_reason, result.stats)
        else:
            metrics.finish("cancelled" if job.cancelled.is_set() else "error")

    scheduler = Scheduler(engine, served.max_queue, done)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.stop()

    app = FastAPI(title="dsfp4", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(
            ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").body(), e.status_code
        )

    def check_key(request: Request) -> None:
        if served.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), served.api_key.encode()):
            raise ApiError(
                401, "incorrect or missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key"
            )

    def accept(req: GenRequest) -> Call:
        """Tokenize, check against the context, queue: an ApiError for anything the engine would refuse."""
        if req.model not in (None, served.model_id):
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {served.model_id!r}",
                           param="model", code="model_not_found")  # fmt: skip
        tok = engine.tokenizer
        try:
            if req.chat:
                text = tok.render_chat(req.prompt)
                ids, thinking = tok.encode(text, special=False), opens_thinking(text)
            else:
                ids, thinking = engine.encode(req.prompt, raw=isinstance(req.prompt, str)), False
            n, context = len(ids), engine.max_context
            if n >= context:
                raise ApiError(400, f"the prompt is {n} tokens; this server's context holds {context} "
                               f"(start it with a larger --max-context)", param="messages" if req.chat else "prompt",
                               code="context_length_exceeded")  # fmt: skip
            room = context - n + 1  # the last token is never fed back
            if req.max_tokens is not None and req.max_tokens > room:
                raise ApiError(400, f"max_tokens {req.max_tokens}: the prompt's {n} tokens leave room for {room} "
                               f"in this server's context of {context}", param="max_tokens",
                               code="context_length_exceeded")  # fmt: skip
            engine.check_prompt(ids)
        except ConfigError as e:  # the chat template refused the conversation, or a token id is out of range
            raise ApiError(400, str(e)) from None
        max_tokens = req.max_tokens or min(engine.options.max_tokens, room)
        job = Job(ids, {"max_tokens": max_tokens, **req.sampling}, asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFull:
            raise ApiError(503, f"the server is busy: {served.max_queue} requests wait already; retry later",
                           code="queue_full") from None  # fmt: skip
        prefix = "chatcmpl" if req.chat else "cmpl"
        return Call(req, job, thinking, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    async def next_item(call: Call, request: Request) -> object | None:
        """The job's next delta, result or error; None once the client has gone (the job is then cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(call.job.out.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    call.job.cancelled.set()
                    return None

    def head(call: Call, kind: str) -> dict:
        return {"id": call.rid, "object": kind, "created": call.created, "model": served.model_id}

    def choice(call: Call, reasoning: str, text: str, finish: str | None, delta: bool) -> dict:
        if not call.req.chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        body = {"content": text, "reasoning_content": reasoning or None}
        body = {k: v for k, v in body.items() if v} if delta else {"role": "assistant", **body}
        return {"index": 0, "delta" if delta else "message": body, "finish_reason": finish, "logprobs": None}

    async def events(call: Call, request: Request) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if call.req.chat else "text_completion"
        splitter = ReasoningSplitter(call.thinking)
        try:
            if call.req.chat:
                yield _sse({**head(call, kind), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                             "finish_reason": None, "logprobs": None}]})  # fmt: skip
            while (item := await next_item(call, request)) is not None:
                if isinstance(item, Delta):
                    reasoning, text = splitter.feed(item.text) if call.req.chat else ("", item.text)
                    if reasoning or text:
                        yield _sse({**head(call, kind), "choices": [choice(call, reasoning, text, None, True)]})
                    continue
                if isinstance(item, Generation):
                    reasoning, text = splitter.flush() if call.req.chat else ("", "")
                    last = {**head(call, kind), "choices": [choice(call, reasoning, text, item.finish_reason, True)]}
                    yield _sse({**last, "usage": _usage(item), "stats": item.stats.to_dict()})
                    if call.req.include_usage:
                        yield _sse({**head(call, kind), "choices": [], "usage": _usage(item)})
                    yield "data: [DONE]\n\n"
                else:
                    yield _sse(_error(item).body())
                return
        finally:
            call.job.cancelled.set()  # a client gone mid-stream frees the engine at the next token

    async def complete(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            check_key(request)
            call = accept(parse_request(await request.body(), chat))
        except ApiError as e:
            metrics.answered(endpoint, e.status)
            return JSONResponse(e.body(), e.status)
        metrics.answered(endpoint, 200)
        if call.req.stream:
            return StreamingResponse(events(call, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        try:
            while isinstance(item := await next_item(call, request), Delta):
                pass
        finally:
            call.job.cancelled.set()
        if item is None:  # the client is gone: nobody reads this answer
            return Response(status_code=499)
        if not isinstance(item, Generation):
            e = _error(item)
            return JSONResponse(e.body(), e.status)
        reasoning, text = split_reasoning(item.text, call.thinking) if chat else ("", item.text)
        kind = "chat.completion" if chat else "text_completion"
        body = {**head(call, kind), "choices": [choice(call, reasoning, text, item.finish_reason, False)]}
        return JSONResponse({**body, "usage": _usage(item), "stats": item.stats.to_dict()})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            check_key(request)
        except ApiError as e:
            return JSONResponse(e.body(), e.status)
        card = {"id": served.model_id, "object": "model", "created": 0, "owned_by": "dsfp4"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "busy": scheduler.running is not None, "queue": scheduler.depth()})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(scheduler.depth(), scheduler.running is not None)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def serve(engine: Engine, served: Served, host: str, port: int) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); the caller closes the engine."""
    import uvicorn

    config = uvicorn.Config(create_app(engine, served), host=host, port=port, log_level="warning", access_log=False)
    uvicorn.Server(config).run()
