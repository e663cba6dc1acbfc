"""The shapes of the server's answers: OpenAI chat.completion / text_completion objects (a choice each of n), their
streamed chunks as server-sent events, a prefill's progress as SSE comments, usage, and dsfp4's per-response stats."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
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


def usage(gs: Sequence[Generation]) -> dict:
    """Token counts: the prompt once, completion tokens those sampled for every choice (each EOS that ended one
    included)."""
    n, m = gs[0].stats.prompt_tokens, sum(g.stats.generated_tokens for g in gs)
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

    def _choice(self, reasoning: str, text: str, finish: str | None, delta: bool, index: int = 0) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        body = {"content": text, "reasoning_content": reasoning or None}
        body = {k: v for k, v in body.items() if v} if delta else {"role": "assistant", **body}
        return {"index": index, "delta" if delta else "message": body, "finish_reason": finish, "logprobs": None}

    def whole_choice(self, index: int, reasoning: str, text: str, finish: str, piece: Piece) -> dict:
        """One choice of the non-streamed answer: its text (or message, with its tool calls), log-probabilities."""
        choice = self._choice(reasoning, text, finish, delta=False, index=index)
        if piece.calls:
            choice["message"]["content"] = text or None
            choice["message"]["tool_calls"] = piece.calls
        choice["logprobs"] = piece.logprobs
        return choice

    def whole(self, choices: list[dict], gs: Sequence[Generation], wait_s: float) -> dict:
        """The non-streamed answer: its choices, the usage of them all, the first one's stats."""
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": choices, "usage": usage(gs), "stats": stats(gs[0], wait_s)}

    def chunk(
        self, reasoning: str = "", text: str = "", finish: str | None = None, role: bool = False, index: int = 0
    ) -> dict:
        """A streamed piece (the chat's first one of a choice names the role)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choice = self._choice(reasoning, text, finish, delta=True, index=index)
        if role:
            choice["delta"] = {"role": "assistant", "content": ""}
        return {**self._head(kind), "choices": [choice]}

    def piece_chunk(self, index: int, piece: Piece, finish: str | None = None) -> dict:
        """A streamed piece of a choice with what it carries: text, tool-call deltas, log-probabilities."""
        chunk = self.chunk(piece.reasoning, piece.text, finish, index=index)
        choice = chunk["choices"][0]
        if piece.calls:
            choice["delta"]["tool_calls"] = piece.calls
        choice["logprobs"] = piece.logprobs
        return chunk

    def event(self, reasoning: str, text: str) -> str:
        """The SSE event of a streamed piece of choice 0, as sse(self.chunk(reasoning, text)) gives it. A piece with
        one kind of text is the chunk's fixed JSON around that text's: a token's event then encodes only its text
        (whole chunks' encoding weighed on the server at 16 streams: docs/BENCHMARKS.md)."""
        if bool(reasoning) == bool(text) or bool(reasoning) not in self._around:
            return sse(self.chunk(reasoning, text))
        before, after = self._around[bool(reasoning)]
        return before + json.dumps(reasoning or text, ensure_ascii=False) + after

    def usage_chunk(self, gs: Sequence[Generation]) -> dict:
        """The last chunk when stream_options.include_usage asks for it: no choices, the usage."""
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": usage(gs),
        }


@dataclass(frozen=True)
class Piece:
    """What one choice sends at once: reasoning and text, its tool calls (OpenAI's delta.tool_calls entries
    streamed, message.tool_calls whole) and its log-probabilities (None: not asked)."""

    reasoning: str = ""
    text: str = ""
    calls: list[dict] = field(default_factory=list)
    logprobs: dict | None = None

    @property
    def plain(self) -> bool:
        """Text alone: Answer.event's fast path."""
        return not self.calls and self.logprobs is None
