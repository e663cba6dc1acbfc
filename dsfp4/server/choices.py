"""One choice of a request as its text comes back: reasoning split from the answer (R1's <think>), the answer's tool
calls read (answer_format.py) into OpenAI's delta.tool_calls as they stream and message.tool_calls whole, and the
log-probabilities laid out in chat's shape (logprobs.content) or completions' legacy one (tokens, token_logprobs,
top_logprobs, text_offset). Streamed pieces add up to the whole answer's fields. Malformed calls raise ToolCallError
(the app answers with an error, never a stream that looks complete)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dsfp4.runtime.generate.answer.answer_format import AnswerFormat, tool_calls_dict
from dsfp4.runtime.generate.answer.tool_calls import ToolCallDelta
from dsfp4.runtime.generate.answer.tool_scan import ToolCallError
from dsfp4.runtime.generate.generation import Delta, Generation, TokenLogprob
from dsfp4.runtime.generate.reasoning import ReasoningSplitter
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.server.answers import Piece

TOOL_CALLS = "tool_calls"


def call_deltas(deltas: Sequence[ToolCallDelta]) -> list[dict]:
    """OpenAI's delta.tool_calls entries: a call's first names it with empty arguments (as the openai client starts
    one), its argument text follows in entries of their own."""
    out = []
    for d in deltas:
        if d.id is not None:
            head = {"name": d.name, "arguments": ""}
            out.append({"index": d.index, "id": d.id, "type": "function", "function": head})
        if d.arguments:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def legacy_logprobs(
    tokens: Sequence[int], entries: Sequence[TokenLogprob | None], text: Callable[[int], str], offset: int
) -> tuple[dict, int]:
    """Completions' logprobs of these tokens, whose text starts at `offset` of the choice's -> (it, the offset
    after them). An entry None (the prompt's first token) has no log-probability."""
    texts = [text(t) for t in tokens]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    shape = {
        "tokens": texts,
        "token_logprobs": [e.logprob if e is not None else None for e in entries],
        "top_logprobs": [{text(t): lp for t, lp in e.top} if e is not None else None for e in entries],
        "text_offset": offsets,
    }
    return shape, offset


@dataclass(frozen=True)
class Asked:
    """What a request's choices share: the endpoint, the answer's format, the prompt (ids, and the text a completion
    echoes: "" when it does not), whether the prompt leaves the model thinking, log-probabilities asked."""

    chat: bool
    fmt: AnswerFormat
    tokenizer: ChatTokenizer
    prompt_ids: list[int]
    thinking: bool
    logprobs: bool
    echo: str = ""
    # a call's id: call_{prefix}_{choice}_{n}
    id_prefix: str = ""


class Choice:
    """One choice's text on its way out, streamed (start, feed, end) or whole."""

    def __init__(self, index: int, asked: Asked):
        self.index, self.asked = index, asked
        self.splitter = ReasoningSplitter(asked.thinking) if asked.chat else None
        self.calls = asked.fmt.stream(asked.tokenizer, self._prefix) if asked.chat else None
        # the prompt's entries (a completion's echo with logprobs), the streamed tokens' not yet sent, how many went
        self.prompt: list[TokenLogprob | None] | None = None
        self.pending: list[TokenLogprob] = []
        self.sent = 0
        # completions: where the next token's text starts in the choice's
        self.offset = 0
        self.started = False

    @property
    def _prefix(self) -> str:
        return f"{self.asked.id_prefix}_{self.index}"

    def _text(self, token: int) -> str:
        return self.asked.tokenizer.decode_alone(token)

    def _logprobs(self, tokens: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict | None:
        if not self.asked.logprobs:
            return None
        if self.asked.chat:
            return {"content": [e.to_openai(self._text) for e in entries if e is not None]}
        shape, self.offset = legacy_logprobs(tokens, entries, self._text, self.offset)
        return shape

    def start(self) -> Piece | None:
        """A streamed completion's echo, once, before its first text: the prompt's text (and its tokens'
        log-probabilities)."""
        started, self.started = self.started, True
        if started or not self.asked.echo:
            return None
        entries = self.prompt if self.prompt is not None else []
        tokens = self.asked.prompt_ids if self.prompt is not None else []
        piece = Piece(text=self.asked.echo, logprobs=self._logprobs(tokens, entries))
        self.offset = len(self.asked.echo)
        return piece

    def feed(self, deltas: Sequence[Delta]) -> Piece | None:
        """A stream's next deltas -> the piece to send now (None: nothing is certain yet)."""
        text = "".join(d.text for d in deltas)
        entries = [d.logprob for d in deltas if d.logprob is not None]
        self.pending += entries
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        calls: list[dict] = []
        if self.calls is not None and content:
            got = self.calls.feed(content)
            content, calls = got.content, call_deltas(got.calls)
        if not (reasoning or content or calls):
            return None
        return self._piece(reasoning, content, calls)

    def _piece(self, reasoning: str, content: str, calls: list[dict]) -> Piece:
        entries, self.pending = self.pending, []
        self.sent += len(entries)
        return Piece(reasoning, content, calls, self._logprobs([e.token for e in entries], entries))

    def end(self, g: Generation) -> tuple[Piece, str]:
        """The stream's end: what was held back, the tokens' entries that came with no delta (the EOS) -> the last
        piece and the finish reason ("tool_calls" where the answer made calls)."""
        reasoning, content = self.splitter.flush() if self.splitter is not None else ("", "")
        calls: list[dict] = []
        if self.calls is not None:
            got = self.calls.feed(content) if content else None
            content, calls = (got.content, call_deltas(got.calls)) if got is not None else ("", [])
            content += self._finish_calls(g).content
        self.pending += (g.logprobs or [])[self.sent + len(self.pending) :]
        made = self.calls is not None and bool(self.calls.calls)
        return self._piece(reasoning, content, calls), TOOL_CALLS if made else g.finish_reason

    def _finish_calls(self, g: Generation):  # noqa: ANN202  (a ToolPiece)
        try:
            return self.calls.finish()
        except ToolCallError as e:
            raise _cut_short(e, g) from None

    def whole(self, g: Generation) -> tuple[str, str, str, Piece]:
        """A non-streamed choice -> (reasoning, text, finish reason, its calls and log-probabilities)."""
        a = self.asked
        if a.chat:
            try:
                reasoning, text, calls = a.fmt.read(a.tokenizer, g.text, a.thinking, self._prefix)
            except ToolCallError as e:
                raise _cut_short(e, g) from None
        else:
            reasoning, text, calls = "", a.echo + g.text, []
        tokens, entries = list(g.token_ids), list(g.logprobs or [])
        if self.prompt is not None:
            tokens, entries = [*a.prompt_ids, *tokens], [*self.prompt, *entries]
        logprobs = self._logprobs(tokens, entries)
        finish = TOOL_CALLS if calls else g.finish_reason
        return reasoning, text, finish, Piece(calls=tool_calls_dict(calls), logprobs=logprobs)


def _cut_short(e: ToolCallError, g: Generation) -> ToolCallError:
    """A block of calls the answer's length cut off says so."""
    if g.finish_reason == "length":
        return ToolCallError(f"{e} (the answer reached max_tokens inside its tool calls)")
    return e
