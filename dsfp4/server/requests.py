"""OpenAI request bodies, checked field by field.

What /v1/chat/completions and /v1/completions accept, and the 4xx each bad field gets: an OpenAI-style error
body that names the field. Fields the API defines but dsfp4 does not implement are accepted at their
neutral value only (n=1, no penalties, no logprobs, no tools), so a client never gets a silently different
answer than it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dsfp4.runtime.generate.prompt import ROLES

# each stop string is checked against the text's end at every token
MAX_STOPS = 16
SEED_LIMIT = 1 << 63
COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
}
# defined by the API, served only at these values
NEUTRAL: dict[str, tuple] = {
    "n": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
}
CHAT_ONLY = {
    "messages",
    "chat_template_kwargs",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
}
COMPLETION_ONLY = {
    "prompt",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "logit_bias",
    "echo",
    "suffix",
    "best_of",
}


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


def _messages(value: object) -> list[dict[str, str]]:
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
        if "content" not in m:
            raise _bad(f"{where}.content", "is missing")
        # a field the prompt would not carry is refused, not dropped (an agent's tool calls, a speaker's name)
        if extra := sorted(set(m) - {"role", "content"}):
            raise _bad(f"{where}.{extra[0]}", "not served: dsfp4's prompts carry a message's role and content only")
        out.append({"role": ROLES[role], "content": _text(m["content"], f"{where}.content")})
    return out


def _prompt(value: object) -> str | list[int]:
    """A completion prompt: text or token ids, one of each at most (n=1)."""
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
    }
    return GenRequest(
        chat=chat,
        prompt=_messages(body.get("messages")) if chat else _prompt(body.get("prompt")),
        model=model,
        stream=bool(stream),
        include_usage=bool((options or {}).get("include_usage")),
        max_tokens=lengths["max_completion_tokens"] or lengths["max_tokens"],
        sampling={k: v for k, v in sampling.items() if v is not None},
        thinking=_thinking(body.get("chat_template_kwargs")) if chat else None,
    )
