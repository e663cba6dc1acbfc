"""What a request asks of its answer's shape besides sampling: the tools the model may call (`tools`, `tool_choice`,
`parallel_tool_calls`) and `response_format`'s JSON. From them: the tools the prompt describes, the grammar decoding
follows, and how the answer reads back as reasoning, content and tool calls. Free of torch: the server's HTTP process
builds it (the Python API and `run --batch` through the engine).

The rules, as docs/server.md gives them:
- tool_choice "none": the tools are not rendered into the prompt and the answer is content, unparsed (a model that
  is not told of tools has none to call; an agent's earlier calls and results still reach the prompt).
- "auto": the tools are rendered and the answer's calls parsed; "required" and a named function are forced by a
  grammar of the format's call markup (tools.tool_choice_grammar).
- response_format json_object / json_schema: a grammar; beside tools under "auto" the answer is the JSON or a block
  of calls; with a forced tool_choice it is refused (the calls are the answer).
- A prompt that leaves the model thinking (R1's <think>): every grammar applies after </think>, the reasoning free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer.grammar import Grammar
from dsfp4.runtime.generate.answer.tool_calls import ToolCall, ToolCallStream, parse_tool_calls
from dsfp4.runtime.generate.answer.tool_grammar import GAP, seq
from dsfp4.runtime.generate.answer.tools import ToolChoice, check_tool_choice, check_tools, tool_choice_grammar
from dsfp4.runtime.generate.reasoning import THINK_END, split_reasoning

if TYPE_CHECKING:
    from dsfp4.runtime.generate.generation import Generation
    from dsfp4.runtime.generate.tokenizer import ChatTokenizer

# llguidance's options inside a grammar's %json: compact JSON (a random model fills flexible whitespace with blanks)
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
ANY_OBJECT = {"type": "object"}


def _closed(schema: Mapping[str, Any] | None) -> dict:
    """A function's parameters as its grammar holds them: compact, and an object's undeclared keys refused (OpenAI's
    strict functions; the prompt keeps the tools as given)."""
    out = {**(schema or ANY_OBJECT), **COMPACT}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _closed_tool(tool: Mapping) -> dict:
    f = tool["function"]
    return {**tool, "function": {**f, "parameters": _closed(f.get("parameters"))}}


@dataclass(frozen=True)
class AnswerFormat:
    """A request's tools (checked; None: none), its tool choice, whether calls may come several at once, and
    response_format's grammar (None: text)."""

    tools: list[dict] | None = None
    choice: ToolChoice = ToolChoice("none")
    parallel: bool = True
    response: Grammar | None = None

    @staticmethod
    def of(
        tokenizer: ChatTokenizer,
        tools: object = None,
        tool_choice: object = None,
        parallel_tool_calls: object = True,
        response_format: object = None,
    ) -> AnswerFormat:
        """The request's fields checked against the model's tool format; ConfigError naming the field."""
        checked = check_tools(tools)
        if checked and tokenizer.tool_format is None:
            raise ConfigError("tools: this model's prompt format has no tool calls (its chat template writes none)")
        choice = check_tool_choice(tool_choice, checked)
        if not isinstance(parallel_tool_calls, bool):
            raise ConfigError("parallel_tool_calls: must be true or false")
        response = Grammar.from_response_format(response_format) if response_format is not None else None
        if response is not None and choice.forced:
            raise ConfigError(
                f"response_format: tool_choice {choice.function or choice.mode!r} makes the answer a tool call; "
                "leave response_format out or set tool_choice auto"
            )
        return AnswerFormat(checked, choice, parallel_tool_calls, response)

    @property
    def calls(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.tools is not None and self.choice.mode != "none"

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tools the prompt describes."""
        return self.tools if self.calls else None

    @property
    def constrained(self) -> bool:
        return self.choice.forced or self.response is not None

    def grammar(self, tokenizer: ChatTokenizer, reasoning: bool) -> Grammar | None:
        """What decoding must follow (None: nothing); `reasoning`: the answer opens with thinking up to </think>."""
        if not self.constrained:
            return None
        fmt, ids = tokenizer.tool_format, tokenizer.marker_ids()
        if self.choice.forced:
            tools = [_closed_tool(t) for t in self.tools or ()]
            text = tool_choice_grammar(fmt, tools, self.choice, ids, self.parallel, reasoning)
            return Grammar.lark(text, origin="tool_choice")
        if not reasoning and not self.calls:
            return self.response
        schema = ANY_OBJECT if self.response.kind == "json_object" else json.loads(self.response.source)
        rules = f"answer: %json {json.dumps({**schema, **COMPACT}, ensure_ascii=False)}\n"
        body = "answer"
        if self.calls:
            body = "(answer | tool_calls)"
            rules += fmt.grammar([_closed_tool(t) for t in self.tools], self.parallel, ids)
        gap = f"/\\s{{0,{GAP}}}/"
        start = f"start: /(?s:.*)/ {seq(THINK_END, ids)} {gap} {body}\n" if reasoning else f"start: {body}\n"
        return Grammar.lark(start + rules, origin=self.response.origin)

    def stream(self, tokenizer: ChatTokenizer, id_prefix: str | None = None) -> ToolCallStream | None:
        """A parser of the streamed answer's calls (the text after its reasoning); None where calls are not read."""
        return ToolCallStream(tokenizer.tool_format, self.tools, id_prefix) if self.calls else None

    def read(
        self, tokenizer: ChatTokenizer, text: str, reasoning: bool, id_prefix: str | None = None
    ) -> tuple[str, str, list[ToolCall]]:
        """A whole answer -> (reasoning, content, calls); ToolCallError where its calls are malformed."""
        thought, content = split_reasoning(text, reasoning)
        if not self.calls:
            return thought, content, []
        content, calls = parse_tool_calls(content, tokenizer.tool_format, self.tools, id_prefix)
        return thought, content, calls

    def finish(self, g: Generation, tokenizer: ChatTokenizer, reasoning: bool) -> Generation:
        """`g` with its tool calls read (Generation.tool_calls) where calls are read; ToolCallError if malformed."""
        if self.calls:
            g.tool_calls = self.read(tokenizer, g.text, reasoning)[2]
        return g


def no_grammar_beside(grammar: object, answer: AnswerFormat) -> None:
    """A call gives its own grammar or one of the answer's (response_format, a forced tool_choice), not both."""
    if grammar is not None and answer.constrained:
        field = "response_format" if answer.response is not None else "tool_choice"
        raise ConfigError(f"grammar: {field} gives the answer's grammar already; give one of them")


def tool_calls_dict(calls: Sequence[ToolCall]) -> list[dict]:
    """Calls in OpenAI's message.tool_calls shape."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
