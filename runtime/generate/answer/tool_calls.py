"""The model's tool calls read back from its answer (the text after any reasoning, decoded keeping special tokens):
content text and OpenAI-shaped calls, whole or as the text streams in. A stream gives content as soon as it cannot
be the start of a block of calls, and each call as OpenAI's streaming `delta.tool_calls` carries it: its index, id
and name in its first delta, then fragments of its arguments. Whitespace right before a block is the format's, not
content. Malformed markup raises ToolCallError, at the first text that shows it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsfp4.runtime.generate.answer.tool_format import ToolFormat
from dsfp4.runtime.generate.answer.tool_scan import PartialCall, ToolCallError
from dsfp4.runtime.generate.reasoning import partial_suffix


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI's message.tool_calls holds it: arguments are the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: index, id and name on its first delta (None after), then argument text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolPiece:
    """What a feed made certain: content text and call deltas, in that order."""

    content: str
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass
class _Sent:
    """What a stream sent of one call: its name once announced, its arguments so far, whether it finished."""

    name: str | None = None
    arguments: str = ""
    finished: bool = False


def function_names(tools: Sequence[Mapping] | None) -> frozenset[str] | None:
    """The names of an OpenAI tools list's functions (None: no list, any name goes)."""
    return None if tools is None else frozenset(t["function"]["name"] for t in tools)


def _arguments_object(call: ToolCall) -> None:
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        raise ToolCallError(
            f"tool call {call.name!r}: its arguments are not JSON ({e.msg}): {call.arguments:.80}"
        ) from None
    if not isinstance(value, dict):
        raise ToolCallError(f"tool call {call.name!r}: its arguments are not a JSON object: {call.arguments:.80}")


class ToolCallStream:
    """Feed the answer's text in pieces; each feed returns what is now certain. `tools`: the request's tools list
    (a call to another function is an error); `id_prefix`: makes the calls' ids (call_{prefix}_{index}), a random
    one unless given. `calls` holds the finished calls."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Mapping] | None = None, id_prefix: str | None = None):
        self.fmt, self.names = fmt, function_names(tools)
        self.prefix = uuid.uuid4().hex[:24] if id_prefix is None else id_prefix
        self.calls: list[ToolCall] = []
        self.text = ""  # content not yet certain
        self.block: str | None = None  # the open block's text after its start marker
        self.sent: list[_Sent] = []  # what was sent of the open block's calls
        self.base = 0  # the index of the open block's first call
        self.error: ToolCallError | None = None

    def feed(self, text: str) -> ToolPiece:
        if self.error is not None:
            raise self.error
        try:
            return self._feed(text)
        except ToolCallError as e:
            self.error = e
            raise

    def _feed(self, text: str) -> ToolPiece:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self.block is None:
            self.text += text
        else:
            self.block += text
        while True:
            if self.block is None:
                at = self.text.find(self.fmt.start)
                if at < 0:
                    content.append(self._certain())
                    return ToolPiece("".join(content), tuple(deltas))
                content.append(self.text[:at].rstrip())
                self.block, self.text, self.base = self.text[at + len(self.fmt.start) :], "", len(self.calls)
            scan = self.fmt.scan(self.block)
            deltas.extend(self._deltas(scan.calls))
            if scan.end is None:
                return ToolPiece("".join(content), tuple(deltas))
            # the block is closed: what follows is content again
            self.text, self.block, self.sent = self.block[scan.end :], None, []

    def _certain(self) -> str:
        """Content that can no longer be part of a block's start (nor whitespace before one): out of self.text."""
        hold = partial_suffix(self.text, self.fmt.start)
        head = self.text[: len(self.text) - hold]
        cut = len(head.rstrip())
        out, self.text = self.text[:cut], self.text[cut:]
        return out

    def _deltas(self, scanned: Sequence[PartialCall]) -> list[ToolCallDelta]:
        """The open block's calls against what was sent of them: new names, new argument text, finished calls."""
        out = []
        for i, call in enumerate(scanned):
            if i == len(self.sent):
                self.sent.append(_Sent())
            sent, index = self.sent[i], self.base + i
            if call.name is None or sent.finished:
                continue
            first = sent.name is None
            if first and self.names is not None and call.name not in self.names:
                raise ToolCallError(f"the model called {call.name!r}, which is not one of the request's tools")
            if not call.arguments.startswith(sent.arguments):
                raise ToolCallError(f"tool call {call.name!r}: its arguments changed after they were sent")
            new = call.arguments[len(sent.arguments) :]
            if first or new:
                out.append(ToolCallDelta(index, self._id(index) if first else None, call.name if first else None, new))
            sent.name, sent.arguments = call.name, call.arguments
            if call.done:
                done = ToolCall(self._id(index), call.name, call.arguments)
                _arguments_object(done)
                self.calls.append(done)
                sent.finished = True
        return out

    def _id(self, index: int) -> str:
        return f"call_{self.prefix}_{index}"

    def finish(self) -> ToolPiece:
        """The end of the answer: held content is content after all; an open block is an error."""
        if self.error is not None:
            raise self.error
        if self.block is not None:
            self.error = ToolCallError(
                f"the answer ends inside a block of tool calls (started by {self.fmt.start}, never closed)"
            )
            raise self.error
        rest, self.text = self.text, ""
        return ToolPiece(rest)


def parse_tool_calls(
    text: str, fmt: ToolFormat, tools: Sequence[Mapping] | None = None, id_prefix: str | None = None
) -> tuple[str, list[ToolCall]]:
    """A whole answer -> (its content, its calls), exactly what a stream of it gives; ToolCallError if malformed."""
    stream = ToolCallStream(fmt, tools, id_prefix)
    content = stream.feed(text).content + stream.finish().content
    return content, stream.calls
