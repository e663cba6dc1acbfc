"""A model's tool-call format, as a table entry: its markers, how its prompts write an assistant's calls and
describe the tools, how its output's calls are read back and the grammar that forces a call. Which entry a model
has: V4's release format for a family that builds its prompts in code (its model_type), else what the chat template
writes (V3 / R1's fenced calls or V3.1's plain ones), else none: such a model refuses tools."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dsfp4.runtime.generate.answer import tool_markup as mk
from dsfp4.runtime.generate.answer.tool_grammar import grammar_dsml, grammar_v3, grammar_v31
from dsfp4.runtime.generate.answer.tool_scan import Scan, scan_dsml, scan_v3


@dataclass(frozen=True)
class ToolFormat:
    """name: the format's name (the V3 family's two call shapes are two entries that read each other's calls);
    start: the marker that opens a block of calls in the model's output; tokens: its marker strings that are single
    tokens of the release's vocabulary; calls: [(name, arguments JSON)] -> the block as a prompt writes it;
    describe: the OpenAI tools list -> the tools' description for the system prompt; scan: the text after `start`
    -> the calls so far (tool_scan.py); grammar: (tools, parallel, marker token ids) -> the Lark rules of a block
    of calls (tool_grammar.py)."""

    name: str
    start: str
    tokens: tuple[str, ...]
    calls: Callable[[Sequence[mk.Call]], str]
    describe: Callable[[Sequence[Mapping]], str]
    scan: Callable[[str], Scan]
    grammar: Callable[[Sequence[Mapping], bool, Mapping[str, int]], str]


V3, V31, V4 = "deepseek_v3", "deepseek_v31", "deepseek_v4"
TOOL_FORMATS: dict[str, ToolFormat] = {
    V3: ToolFormat(V3, mk.CALLS_BEGIN, mk.V3_TOKENS, mk.calls_v3, mk.describe_v3, scan_v3, grammar_v3),
    V31: ToolFormat(V31, mk.CALLS_BEGIN, mk.V3_TOKENS, mk.calls_v31, mk.describe_v31, scan_v3, grammar_v31),
    V4: ToolFormat(V4, mk.DSML_CALLS, mk.V4_TOKENS, mk.calls_v4, mk.describe_v4, scan_dsml, grammar_dsml),
}


def template_tool_format(source: str | None) -> ToolFormat | None:
    """The format a chat template writes calls in: V3 / R1's (its calls carry a ```json fence) or V3.1's; None for
    a template that writes no DeepSeek tool calls."""
    if source is None or mk.CALL_BEGIN not in source:
        return None
    return TOOL_FORMATS[V3] if "```json" in source else TOOL_FORMATS[V31]
