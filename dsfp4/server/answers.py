"""The shapes of the server's answers: OpenAI chat.completion / text_completion objects, their streamed
chunks as server-sent events, a prefill's progress as SSE comments, usage, and dsfp4's per-response stats."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from dsfp4.runtime.generate.generation import Generation
from dsfp4.server.jobs import Progress

# a streamed prefill's progress: `: prefill DONE/TOTAL`, a comment line, which SSE clients skip
PREFILL = ": prefill "


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: ...` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def progress_comment(p: Progress) -> str:
    """A prefill's progress as an SSE comment and a blank line (an event with no data, which no client dispatches)."""
    return f"{PREFILL}{p.done}/{p.total}\n\n"


def usage(g: Generation) -> dict:
    """Token counts; completion tokens are those sampled, the EOS that ended the answer included."""
    n, m = g.stats.prompt_tokens, g.stats.generated_tokens
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def stats(g: Generation, wait_s: float) -> dict:
    """The generation's stats (as `dsfp4 run --json` prints them) and its time in the server's queue."""
    return {**g.stats.to_dict(), "queue_s": wait_s}


@dataclass(frozen=True)
class Answer:
    """The fixed parts of one request's answer and how its text is laid out."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    # event()'s: reasoning? -> (before, after)
    _around: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}")
        mark = "\x00"
        wholes = {False: sse(self.chunk("", mark)), True: sse(self.chunk(mark, ""))}
        around = {kind: tuple(whole.split(json.dumps(mark))) for kind, whole in wholes.items()}
        object.__setattr__(self, "_around", {kind: parts for kind, parts in around.items() if len(parts) == 2})

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, reasoning: str, text: str, finish: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        body = {"content": text, "reasoning_content": reasoning or None}
        body = {k: v for k, v in body.items() if v} if delta else {"role": "assistant", **body}
        return {"index": 0, "delta" if delta else "message": body, "finish_reason": finish, "logprobs": None}

    def whole(self, reasoning: str, text: str, g: Generation, wait_s: float) -> dict:
        """The non-streamed answer."""
        kind = "chat.completion" if self.chat else "text_completion"
        choice = self._choice(reasoning, text, g.finish_reason, delta=False)
        return {**self._head(kind), "choices": [choice], "usage": usage(g), "stats": stats(g, wait_s)}

    def chunk(self, reasoning: str = "", text: str = "", finish: str | None = None, role: bool = False) -> dict:
        """A streamed piece (the chat's first one names the role)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choice = self._choice(reasoning, text, finish, delta=True)
        if role:
            choice["delta"] = {"role": "assistant", "content": ""}
        return {**self._head(kind), "choices": [choice]}

    def event(self, reasoning: str, text: str) -> str:
        """The SSE event of a streamed piece, as sse(self.chunk(reasoning, text)) gives it. A piece with one kind of
        text is the chunk's fixed JSON around that text's: a token's event then encodes only its text (whole
        chunks' encoding weighed on the server at 16 streams: docs/BENCHMARKS.md)."""
        if bool(reasoning) == bool(text) or bool(reasoning) not in self._around:
            return sse(self.chunk(reasoning, text))
        before, after = self._around[bool(reasoning)]
        return before + json.dumps(reasoning or text, ensure_ascii=False) + after

    def usage_chunk(self, g: Generation) -> dict:
        """The last chunk when stream_options.include_usage asks for it: no choices, the usage."""
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": usage(g),
        }
