"""uvicorn's HTTP protocol (httptools') with limits on what a client sends outside the app's reads, which uvicorn
has none of there: a connection's first request head within `seconds` of its opening, every later head within
`seconds` of its first byte (its keep-alive wait is uvicorn's timeout_keep_alive), a body the app answered without
reading (a 413) over within `seconds` of the answer, else the connection is cut; and a head of HEAD_BYTES at most
(431). A head that came a line every 2 s had held its connection for good, and httptools took a header of 200 MiB.
The app's body reads have their own deadline (body.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dsfp4.server.client_limits import HEAD_BYTES

log = logging.getLogger("uvicorn.error")
ERROR = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
TIMED_OUT = (
    b"408 Request Timeout",
    b'{"error": {"message": "the request\'s head did not come whole in time (the server\'s --read-timeout)", '
    b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}',
)
TOO_LARGE = (
    b"431 Request Header Fields Too Large",
    b'{"error": {"message": "the request\'s head is larger than %d bytes", "type": "invalid_request_error", '
    b'"param": null, "code": "request_too_large"}}' % HEAD_BYTES,
)


class Deadline(HttpToolsProtocol):
    """The protocol, given `seconds` (uvicorn.Config(http=functools.partial(Deadline, seconds=S)))."""

    def __init__(self, *args: Any, seconds: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.seconds = seconds
        self.timer: asyncio.TimerHandle | None = None
        # the request being parsed has its head: the app has it
        self.headed = False
        # bytes come since the head being parsed began (None: no head is being parsed)
        self.head_bytes: int | None = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.head_bytes is not None:
            # what came before this piece, which may hold the head's end and a body's start
            if self.head_bytes > HEAD_BYTES:
                self._refuse(TOO_LARGE, f"its request's head passed {HEAD_BYTES} bytes")
                return
            self.head_bytes += len(data)
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.headed = False
        if self.timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self.headed = True
        self.head_bytes = None
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        # the next head starts with the next piece
        self.head_bytes = 0

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
        where = "the rest of its body" if self.headed else "its request's head"
        self._refuse(
            None if self.headed else TIMED_OUT, f"{where} did not come within {self.seconds:g} s (--read-timeout)"
        )

    def _refuse(self, answer: tuple[bytes, bytes] | None, why: str) -> None:
        """Close the connection, with `answer` (status line, body) where no response is under way, and one line."""
        if self.transport.is_closing():
            return
        log.warning("%s: cut, %s", _peer(self.client), why)
        if answer is not None and (self.cycle is None or self.cycle.response_complete):
            status, body = answer
            self.transport.write(ERROR % (status, len(body), body))
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
