"""A request's body, read with its limits: at most `--max-body` bytes (413 past it, refused from its Content-Length
before a byte of it is read, or counted as a chunked body streams) and whole within `--read-timeout` seconds of its
head (408). A body read whole first had let one 50 MB request hold the HTTP process for minutes at 9.5 GB.

The default limit follows the context: what a prompt the context can hold needs, written out as JSON chat messages,
and the JSON around it (client_limits.py)."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import ClientDisconnect, Request

from dsfp4.server.requests import ApiError

# what a client that left mid-body gets counted as (nginx's "client closed request"; it hears nothing)
CLIENT_LEFT = 499

log = logging.getLogger("uvicorn.error")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, or an ApiError: 413 past `limit` bytes, 408 when it has not come whole within `timeout_s`, 499
    when the client left (one line in the log, not a traceback)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts: list[bytes] = []
    try:
        await asyncio.wait_for(_read(request, limit, parts), timeout_s)
    except asyncio.TimeoutError:  # noqa: UP041  (not yet the builtin on Python 3.10)
        raise ApiError(
            408,
            f"the request's body did not come whole within {timeout_s:g} s ({sum(map(len, parts))} bytes came); "
            f"send it faster (the server's --read-timeout)",
            code="request_timeout",
        ) from None
    except ClientDisconnect:
        log.warning(
            "%s %s: the client left after %d bytes of its body; nothing was answered",
            request.method,
            request.url.path,
            sum(map(len, parts)),
        )
        raise ApiError(CLIENT_LEFT, "the client left mid-body") from None
    return b"".join(parts)


async def _read(request: Request, limit: int, parts: list[bytes]) -> None:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit, so_far=True)
        parts.append(chunk)


def _too_large(size: int, limit: int, so_far: bool = False) -> ApiError:
    counted = f"more than {limit} bytes came" if so_far else f"its Content-Length is {size}"
    return ApiError(
        413,
        f"the request's body is too large: {counted}; this server takes at most {limit} bytes (its --max-body, "
        f"sized from --max-context unless given): shorten the request",
        code="request_too_large",
    )
