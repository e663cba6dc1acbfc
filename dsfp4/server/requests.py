"""OpenAI request bodies, checked field by field.

What /v1/chat/completions and /v1/completions accept, and the 4xx each bad field gets: an OpenAI-style error
body that names the field. Fields the API defines but dsfp4 does not implement are accepted at their
neutral value only (no logit_bias, best_of 1, no suffix), so a client never gets a silently different answer than it
asked for. What needs the model's tokenizer (tools against its tool format, a schema compiled) is checked as the
request is accepted (app.py); here the shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dsfp4.runtime.generate.chat_messages import ROLES
from dsfp4.runtime.generate.generation import MAX_TOP
from dsfp4.runtime.generate.value_rules import SEED_LIMIT

# each stop string is checked against the text's end at every token
MAX_STOPS = 16
# choices of one request: each is a generation of its own in the scheduler
MAX_N = 16
COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "logit_bias",
}
# defined by the API, served only at these values
NEUTRAL: dict[str, tuple] = {
    "logit_bias": ({},),
    "suffix": ("",),
    "best_of": (1,),
}
# defined by the API and refused whatever their value: why
REFUSED = {
    "functions": "OpenAI's deprecated form of tools; give tools",
    "function_call": "OpenAI's deprecated form of tool_choice; give tool_choice",
}
CHAT_ONLY = {
    "messages",
    "chat_template_kwargs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    *REFUSED,
}
COMPLETION_ONLY = {"prompt", "echo", "suffix", "best_of"}


class ApiError(Exception):
    """A request the server refuses: HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    # pickled whole: an error crosses from the engine's process to the HTTP one
    def __reduce__(self) -> tuple:
        return ApiError, (self.status, self.message, self.param, self.code)

    @classmethod
    def of(cls, e: BaseException) -> ApiError:
        """What the client hears of an exception that ended its generation."""
        return e if isinstance(e, ApiError) else cls(500, f"generation failed: {e}")

    @property
    def kind(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 503: "server_overloaded"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenRequest:
    """One checked generation request: the prompt as Engine.encode takes it and the options given."""

    chat: bool
    prompt: str | list[dict[str, str]] | list[int]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    # Engine.stream keywords that were given
    sampling: dict[str, Any] = field(default_factory=dict)
    # chat_template_kwargs' thinking switch (None: the server's --thinking)
    thinking: bool | None = None
    # choices, each a generation (seeds seed, seed + 1, ...)
    n: int = 1
    # log-probabilities asked for: the alternatives per token (None: none)
    logprobs: int | None = None
    # completions: the prompt's text (and with logprobs its tokens') before the answer
    echo: bool = False
    # chat: the answer's format as the request gives it (answer_format.AnswerFormat.of checks it with the model's
    # tokenizer)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    response_format: Any = None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _bad(name: str, what: str) -> ApiError:
    return ApiError(400, f"{name}: {what}", param=name)


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or v != v or v > hi or v < lo or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(name, f"must be a number in {interval}, got {json.dumps(v)}")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v < hi:
        raise _bad(name, f"must be an integer from {lo} to {hi - 1}, got {json.dumps(v)}")
    return v


def _text(content: object, where: str) -> str:
    """Message content: a string, or a list of text parts (the API's array form)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _bad(where, 'must be a string or a list of {"type": "text", "text": ...} parts (text only)')


def _messages(value: object) -> list[dict]:
    """The messages' shapes: roles, text content (parts joined); their tool calls, tool results and other fields go
    on to chat_messages.py, which refuses what the model's format cannot carry, field by field."""
    if not isinstance(value, list) or not value:
        raise _bad("messages", 'must be a non-empty list of {"role": ..., "content": ...} objects')
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {json.dumps(role)}")
        # an assistant's turn of tool calls may leave its content out or null
        calls = role == "assistant" and bool(m.get("tool_calls"))
        if "content" not in m and not calls:
            raise _bad(f"{where}.content", "is missing")
        content = m.get("content")
        out.append({**m, "content": None if content is None and calls else _text(content, f"{where}.content")})
    return out


def _prompt(value: object) -> str | list[int]:
    """A completion prompt: text or token ids, one prompt per request (a list of prompts is refused)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return list(value)
    raise _bad("prompt", "must be a non-empty string or a non-empty list of token ids (one prompt per request)")


# vLLM's and SGLang's names for the prompt format's switch
THINKING_KEYS = ("thinking", "enable_thinking")


def _thinking(value: object) -> bool | None:
    """chat_template_kwargs: only the thinking switch, under either name, true or false."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - set(THINKING_KEYS) or len(set(value.values())) > 1:
        raise _bad("chat_template_kwargs", 'holds only "thinking" (or "enable_thinking"): true or false')
    switch = next(iter(value.values()), None)
    if not isinstance(switch, bool | None):
        raise _bad("chat_template_kwargs", f'"thinking" must be true or false, got {json.dumps(switch)}')
    return switch


def _stop(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings")
    return tuple(stops)


def parse_request(raw: bytes, chat: bool) -> GenRequest:
    """The body of a chat (chat=True) or completions request -> GenRequest, or ApiError naming the field."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    known = COMMON | (CHAT_ONLY if chat else COMPLETION_ONLY)
    if unknown := sorted(set(body) - known):
        raise ApiError(400, f"unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    for name in known & set(NEUTRAL):
        if body.get(name) is not None and body[name] not in NEUTRAL[name]:
            allowed = " or ".join(json.dumps(v) for v in NEUTRAL[name])
            raise _bad(name, f"dsfp4 serves only {allowed} here, got {json.dumps(body[name])}")
    if refused := next((name for name in REFUSED if body.get(name) is not None), None):
        raise _bad(refused, f"not served: {REFUSED[refused]}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "must be a string")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "must be true or false")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _bad("stream_options", 'applies with "stream": true and holds only include_usage')
    lengths = {n: _integer(body, n, 1, 1 << 31) for n in ("max_tokens", "max_completion_tokens")}
    if None not in lengths.values() and len(set(lengths.values())) > 1:
        raise _bad("max_completion_tokens", "differs from max_tokens; give one of them")
    sampling = {
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1, lo_open=True),
        "top_k": _integer(body, "top_k", 0, 1 << 31),
        "seed": _integer(body, "seed", 0, SEED_LIMIT),
        "stop": _stop(body.get("stop")),
        "presence_penalty": _number(body, "presence_penalty", -2, 2),
        "frequency_penalty": _number(body, "frequency_penalty", -2, 2),
        "repetition_penalty": _number(body, "repetition_penalty", 0, 2, lo_open=True),
        "min_p": _number(body, "min_p", 0, 1),
    }
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be true or false")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise _bad("echo", "must be true or false")
    return GenRequest(
        chat=chat,
        prompt=_messages(body.get("messages")) if chat else _prompt(body.get("prompt")),
        model=model,
        stream=bool(stream),
        include_usage=bool((options or {}).get("include_usage")),
        max_tokens=lengths["max_completion_tokens"] or lengths["max_tokens"],
        sampling={k: v for k, v in sampling.items() if v is not None},
        thinking=_thinking(body.get("chat_template_kwargs")) if chat else None,
        n=_integer(body, "n", 1, MAX_N + 1) or 1,
        logprobs=_logprobs(body, chat),
        echo=bool(echo),
        tools=body.get("tools"),
        tool_choice=body.get("tool_choice"),
        parallel_tool_calls=parallel is not False,
        response_format=body.get("response_format"),
    )


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives per token asked for, None: no log-probabilities. Chat: logprobs true and top_logprobs (0 to
    20); completions: logprobs, the number itself (0 to 20; OpenAI's stops at 5)."""
    if not chat:
        return _integer(body, "logprobs", 0, MAX_TOP + 1)
    asked, top = body.get("logprobs"), _integer(body, "top_logprobs", 0, MAX_TOP + 1)
    if asked is not None and not isinstance(asked, bool):
        raise _bad("logprobs", "must be true or false (top_logprobs gives the alternatives)")
    if top is not None and not asked:
        raise _bad("top_logprobs", 'applies with "logprobs": true')
    return (top or 0) if asked else None
