"""uvicorn's HTTP protocol (httptools') with a deadline on what a client sends outside the app's reads, which uvicorn
has none of: a connection's first request head within `seconds` of its opening, every later head within `seconds`
of its first byte (its keep-alive wait is uvicorn's timeout_keep_alive), and a body the app answered without
reading (a 413) over within `seconds` of the answer, else the connection is cut. A head that came a line every 2 s
had held its connection for good. The app's body reads have their own deadline (body.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("uvicorn.error")
TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n"
    b"\r\n%s"
)
TIMED_OUT_BODY = (
    b'{"error": {"message": "the request\'s head did not come whole in time (the server\'s --read-timeout)", '
    b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}'
)


class Deadline(HttpToolsProtocol):
    """The protocol, given `seconds` (uvicorn.Config(http=functools.partial(Deadline, seconds=S)))."""

    def __init__(self, *args: Any, seconds: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seconds = seconds
        self.timer: asyncio.TimerHandle | None = None
        # the request being parsed has its head: the app has it
        self.headed = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.headed = False
        if self.timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self.headed = True
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is not None and self.cycle.more_body:
            # answered before its body came whole: the rest is read and dropped, for `seconds` at most
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self.timer = self.loop.call_later(self.seconds, self._cut)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _cut(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        where = "the rest of its body" if self.headed else "its request's head"
        log.warning("%s: cut, %s did not come within %g s (--read-timeout)", _peer(self.client), where, self.seconds)
        if not self.headed and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(TIMED_OUT % (len(TIMED_OUT_BODY), TIMED_OUT_BODY))
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
