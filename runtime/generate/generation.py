"""What a generation gives its caller: the deltas of a stream as tokens come, and the finished Generation."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from dsfp4.errors import DsfpError
from dsfp4.runtime.generate.answer.tool_calls import ToolCall
from dsfp4.runtime.generate.stats import GenerationStats

# OpenAI's bound on top_logprobs
MAX_TOP = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability, and the `top` alternatives (id, log-probability), most likely first
    (runtime/generate/logprobs.py says under which distribution)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        """What `dsfp4 run --json` prints."""
        return {"token_id": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}

    def to_openai(self, text: Callable[[int], str]) -> dict:
        """One entry of OpenAI's chat `logprobs.content`: token text, log-probability, its UTF-8 bytes, and the top
        alternatives alike (`text`: a token id's text, e.g. ChatTokenizer.decode_alone)."""

        def one(token: int, logprob: float) -> dict:
            s = text(token)
            return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

        return {**one(self.token, self.logprob), "top_logprobs": [one(t, lp) for t, lp in self.top]}


@dataclass
class Generation:
    """One finished generation: what went in, what came out, why it ended and what it cost."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    # "stop" (EOS or a stop string), "length" or "cancelled" (the caller's cancel event)
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)
    # one entry per token of token_ids where the sampling asked for log-probabilities (logprobs.py), else None
    logprobs: list[TokenLogprob] | None = None
    # the answer's tool calls where the call offered tools (answer_format.py), else None
    tool_calls: list[ToolCall] | None = None

    def to_dict(self) -> dict:
        """What `dsfp4 run --json` prints (logprobs where they were asked for)."""
        out = {
            "prompt_token_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [e.to_dict() for e in self.logprobs]
        if self.tool_calls is not None:
            out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.tool_calls]
        return out


@dataclass(frozen=True)
class Delta:
    """One step of a stream: the token just generated and the text it completes."""

    # None for the last flush of text held back (stop-string prefixes, unfinished UTF-8)
    token_id: int | None
    # may be empty while text is held back; the deltas' texts add up to Generation.text
    text: str
    # the token's log-probability and alternatives, where the sampling asked for them
    logprob: TokenLogprob | None = None


class Stream(Iterator[Delta]):
    """The deltas of one generation as they are produced. Once the iteration ends, `generation` holds the
    result. `close()` (or starting another call on the engine) cancels the rest; the cache stays valid."""

    def __init__(self, steps: Generator[Delta, None, Generation], claim: Callable[[], AbstractContextManager]):
        self._steps, self._claim = steps, claim
        self.generation: Generation | None = None
        # a later call on the engine ended it before it finished
        self.superseded = False

    def __next__(self) -> Delta:
        if self.superseded:
            raise DsfpError("this stream was ended by a later call on its engine")
        with self._claim():
            try:
                return next(self._steps)
            except StopIteration as end:
                self.generation = end.value
                raise

    def close(self) -> None:
        self._steps.close()
