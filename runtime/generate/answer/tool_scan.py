"""Reading a block of tool calls as far as it has been written: each format's scanner takes the text after the
block's opening marker and returns the calls seen so far (a name once it is whole, the arguments as JSON text that
only grows) and where the block ends, or raises ToolCallError at the first text the format cannot hold there.
Markup that is cut short (a marker half written) waits for more text; it is never an error until the end."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from dsfp4.errors import DsfpError
from dsfp4.runtime.generate.answer.tool_markup import (
    CALL_BEGIN,
    CALL_END,
    CALL_TYPE,
    CALLS_END,
    DSML_CALLS_END,
    DSML_INVOKE,
    DSML_INVOKE_END,
    DSML_PARAM,
    DSML_PARAM_END,
    FENCE_CLOSE,
    FENCE_OPEN,
    SEP,
    to_json,
)
from dsfp4.runtime.generate.reasoning import partial_suffix


class ToolCallError(DsfpError):
    """The model's tool-call markup cannot be read as calls (bad markup, arguments that are not a JSON object, a
    function the request did not offer, a block left open at the end)."""


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is written: `name` once whole (None before), `arguments` the JSON text so far (a prefix
    of the final text), `done` once the call's closing markup is seen."""

    name: str | None
    arguments: str
    done: bool


@dataclass(frozen=True)
class Scan:
    """The calls of a block so far, and the offset just past its closing marker (None while it is open)."""

    calls: tuple[PartialCall, ...]
    end: int | None


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip()) if text[pos:].strip() else len(text)


def _waiting(rest: str, *markers: str) -> bool:
    """Whether `rest` may still become one of the markers (it is the start of one)."""
    return any(m.startswith(rest) for m in markers)


def _settled(raw: str, done: bool, closer: str) -> str:
    """Argument text that will not change: leading and trailing whitespace dropped; while the call is open, a tail
    that may be the start of its closing markup waits."""
    text = raw.lstrip()
    if done:
        return text.rstrip()
    keep = partial_suffix(text, closer)
    return text[: len(text) - keep].rstrip()


def _fenced(name_and_rest: str, done: bool) -> PartialCall:
    """V3 / R1's call after `function<｜tool▁sep｜>`: the name, a newline, the arguments in a ```json fence."""
    line_end = name_and_rest.find("\n")
    if line_end < 0:
        if done:
            raise ToolCallError("a tool call's name is not followed by its ```json arguments")
        return PartialCall(None, "", False)
    name, rest = name_and_rest[:line_end].strip(), name_and_rest[line_end + 1 :].lstrip()
    if not rest.startswith(FENCE_OPEN):
        if done or not _waiting(rest, FENCE_OPEN):
            raise ToolCallError(f"tool call {name!r}: expected ```json before its arguments, got {rest[:40]!r}")
        return PartialCall(name, "", False)
    raw = rest[len(FENCE_OPEN) :]
    close = raw.find(FENCE_CLOSE)
    if close < 0:
        if done:
            raise ToolCallError(f"tool call {name!r}: its ```json arguments are not closed with ```")
        return PartialCall(name, _settled(raw, False, FENCE_CLOSE), False)
    after = raw[close + len(FENCE_CLOSE) :].strip()
    if after and (done or not _waiting(after, CALL_END)):
        raise ToolCallError(f"tool call {name!r}: text after its closing ```")
    return PartialCall(name, _settled(raw[:close], True, FENCE_CLOSE), done)


def _v3_call(body: str, done: bool) -> PartialCall:
    """One call of the V3 family's block, either variant: V3 / R1's `function<sep>NAME\\n```json ...` or V3.1's
    `NAME<sep>ARGS` (a call of V3.1's whose arguments start with `{` is never the fenced kind)."""
    sep = body.find(SEP)
    if sep < 0:
        if done:
            raise ToolCallError(f"a tool call without {SEP} between its name and arguments")
        return PartialCall(None, "", False)
    head, tail = body[:sep].strip(), body[sep + len(SEP) :]
    if head == CALL_TYPE and not tail.strip() and not done:
        return PartialCall(None, "", False)  # which variant: the first character after the separator says
    if head == CALL_TYPE and not tail.lstrip().startswith(("{", "[")):
        return _fenced(tail, done)
    if not head:
        raise ToolCallError("a tool call with an empty function name")
    return PartialCall(head, _settled(tail, done, CALL_END), done)


def _scan_calls(block: str, begin: str, end: str, read: Callable[[str, int], tuple[PartialCall, int | None]]) -> Scan:
    """A block of calls, each opened by `begin`, the block closed by `end`, whitespace between: `read` takes the block
    and where a call's text starts (after `begin`) -> (the call so far, where the next may start; None: still open)."""
    calls: list[PartialCall] = []
    pos = 0
    while True:
        pos = _skip_space(block, pos)
        rest = block[pos:]
        if rest.startswith(end):
            return Scan(tuple(calls), pos + len(end))
        if not rest.startswith(begin):
            if _waiting(rest, end, begin):
                return Scan(tuple(calls), None)
            raise ToolCallError(f"tool-call markup: expected {begin} or {end}, got {rest[:40]!r}")
        call, pos = read(block, pos + len(begin))
        calls.append(call)
        if pos is None:
            return Scan(tuple(calls), None)


def _v3_read(block: str, start: int) -> tuple[PartialCall, int | None]:
    close = block.find(CALL_END, start)
    if close < 0:
        return _v3_call(block[start:], False), None
    return _v3_call(block[start:close], True), close + len(CALL_END)


def scan_v3(block: str) -> Scan:
    """The V3 family's block: calls between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`, whitespace between."""
    return _scan_calls(block, CALL_BEGIN, CALLS_END, _v3_read)


INVOKE_HEAD = re.compile(r'\s+name="([^"]+)"\s*')
PARAM_HEAD = re.compile(r'\s+name="([^"]+)"\s+string="(true|false)"\s*')


def _dsml_parameters(block: str, pos: int, name: str) -> tuple[list[str], int, bool]:
    """An invoke's parameters from `pos`: ([`"key": json`] so far, where reading stopped, whether it closed)."""
    pieces: list[str] = []
    seen: set[str] = set()
    while True:
        pos = _skip_space(block, pos)
        rest = block[pos:]
        if rest.startswith(DSML_INVOKE_END):
            return pieces, pos + len(DSML_INVOKE_END), True
        if not rest.startswith(DSML_PARAM):
            if _waiting(rest, DSML_INVOKE_END, DSML_PARAM):
                return pieces, pos, False
            raise ToolCallError(f"tool call {name!r}: expected a parameter or {DSML_INVOKE_END}, got {rest[:40]!r}")
        head_end = block.find(">", pos)
        value_end = block.find(DSML_PARAM_END, head_end + 1) if head_end >= 0 else -1
        if value_end < 0:
            return pieces, pos, False
        head = PARAM_HEAD.fullmatch(block[pos + len(DSML_PARAM) : head_end])
        if head is None:
            raise ToolCallError(f"tool call {name!r}: a parameter's tag is not name=... string=...")
        key, raw = head.group(1), block[head_end + 1 : value_end]
        if key in seen:
            raise ToolCallError(f"tool call {name!r}: parameter {key!r} is given twice")
        if head.group(2) == "true":
            value: object = raw
        else:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ToolCallError(f"tool call {name!r}: parameter {key!r} is not JSON ({e.msg})") from None
        seen.add(key)
        pieces.append(f"{to_json(key)}: {to_json(value)}")
        pos = value_end + len(DSML_PARAM_END)


def _dsml_read(block: str, start: int) -> tuple[PartialCall, int | None]:
    head_end = block.find(">", start)
    if head_end < 0:
        return PartialCall(None, "", False), None
    head = INVOKE_HEAD.fullmatch(block[start:head_end])
    if head is None:
        tag = block[start - len(DSML_INVOKE) :][:40]
        raise ToolCallError(f"tool-call markup: an invoke's tag is not name=..., got {tag!r}")
    pieces, pos, closed = _dsml_parameters(block, head_end + 1, head.group(1))
    arguments = "{" + ", ".join(pieces) + "}" if closed else ("{" + ", ".join(pieces) if pieces else "")
    return PartialCall(head.group(1), arguments, closed), pos if closed else None


def scan_dsml(block: str) -> Scan:
    """V4's block: invokes with a name, each holding parameters; the arguments are the JSON object of them, written
    out a parameter at a time."""
    return _scan_calls(block, DSML_INVOKE, DSML_CALLS_END, _dsml_read)
