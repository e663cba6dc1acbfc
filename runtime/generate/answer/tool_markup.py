"""The strings of DeepSeek's tool-call formats, as each release writes them (facts of the formats, checked against
the releases' chat templates, V3.1's model card and V4-Flash's encoding/encoding_dsv4.py), and the markup of an
assistant's calls and of a prompt's tool descriptions built from them.

- V3 / V3-0324 / R1 / R1-0528 (their tokenizer_config.json templates): a block
  `<｜tool▁calls▁begin｜>` call ("\\n" call)* `<｜tool▁calls▁end｜>`, each call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`; results
  `<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>OUT<｜tool▁output▁end｜>` ("\\n" more) `<｜tool▁outputs▁end｜>`.
- V3.1 / V3.1-Terminus: the same block, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`,
  calls chained with nothing between; each result `<｜tool▁output▁begin｜>OUT<｜tool▁output▁end｜>`. Their templates
  render calls and results but not the tools: the model card gives the tool description (describe_v31).
- V4 (DSML, built on the `｜DSML｜` token): "\\n\\n" then `<｜DSML｜tool_calls>\\n` invokes joined by "\\n"
  `\\n</｜DSML｜tool_calls>`, each invoke `<｜DSML｜invoke name="NAME">\\n` parameters joined by "\\n"
  `\\n</｜DSML｜invoke>`, each parameter `<｜DSML｜parameter name="KEY" string="true">RAW</｜DSML｜parameter>` for a
  string value, `string="false">JSON<` for any other; results `<tool_result>OUT</tool_result>` in a user turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
# V3/R1's call names its type first; "function" is the only one
CALL_TYPE = "function"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"
# the V3 family's tool tokens, single tokens of its vocabulary
V3_TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, OUTPUTS_BEGIN, OUTPUTS_END, OUTPUT_BEGIN, OUTPUT_END, SEP)

DSML = "｜DSML｜"
DSML_CALLS, DSML_CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
DSML_INVOKE, DSML_INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
DSML_PARAM, DSML_PARAM_END = f"<{DSML}parameter", f"</{DSML}parameter>"
# V4 writes its calls after a blank line
DSML_LEAD = "\n\n"
RESULT_BEGIN, RESULT_END = "<tool_result>", "</tool_result>"
V4_TOKENS = (DSML,)

# Call = (function name, arguments as JSON text of an object)
Call = tuple[str, str]


def to_json(value: object) -> str:
    """JSON as the templates' tojson and the V4 encoder write it: non-ASCII kept, default separators."""
    return json.dumps(value, ensure_ascii=False)


def calls_v3(calls: Sequence[Call]) -> str:
    """V3 / R1's block: fenced JSON after the type and the name, calls separated by a newline."""
    body = "\n".join(f"{CALL_BEGIN}{CALL_TYPE}{SEP}{n}\n{FENCE_OPEN}{a}{FENCE_CLOSE}{CALL_END}" for n, a in calls)
    return CALLS_BEGIN + body + CALLS_END


def calls_v31(calls: Sequence[Call]) -> str:
    """V3.1's block: name, separator, the arguments as they are; calls chained without separators."""
    return CALLS_BEGIN + "".join(f"{CALL_BEGIN}{n}{SEP}{a}{CALL_END}" for n, a in calls) + CALLS_END


def dsml_parameter(key: str, value: object) -> str:
    """One parameter: a string as it is (string="true"), any other value as JSON."""
    raw, is_str = (value, "true") if isinstance(value, str) else (to_json(value), "false")
    return f'{DSML_PARAM} name="{key}" string="{is_str}">{raw}{DSML_PARAM_END}'


def calls_v4(calls: Sequence[Call]) -> str:
    """V4's block, after its blank line: an invoke per call, a parameter per argument (arguments: a JSON object)."""
    invokes = []
    for name, arguments in calls:
        params = "\n".join(dsml_parameter(k, v) for k, v in json.loads(arguments).items())
        invokes.append(f'{DSML_INVOKE} name="{name}">\n{params}\n{DSML_INVOKE_END}')
    return f"{DSML_LEAD}{DSML_CALLS}\n" + "\n".join(invokes) + f"\n{DSML_CALLS_END}"


def _functions(tools: Sequence[Mapping]) -> list[Mapping]:
    return [t["function"] for t in tools]


def _sections(tools: Sequence[Mapping]) -> str:
    """V3.1's per-tool sections: a heading, the description and the parameters' schema as JSON."""
    return "".join(
        f"\n### {f['name']}\nDescription: {f.get('description', '')}\n\nParameters: "
        f"{to_json(f.get('parameters', {}))}\n"
        for f in _functions(tools)
    )


# the model card's instructions after the sections (V3.1), in V3/R1's call shape for the older format
V31_RULES = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}{{additional_tool_calls}}{CALLS_END}\n"
    "\nWhere:\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n"
)
V3_RULES = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}{CALL_TYPE}{SEP}tool_call_name\n{FENCE_OPEN}tool_call_arguments{FENCE_CLOSE}"
    f"{CALL_END}{{additional_tool_calls}}{CALLS_END}\n"
    "\nWhere:\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, separate them with a newline\n"
)
TOOLS_HEAD = "## Tools\nYou have access to the following tools:\n"


def describe_v3(tools: Sequence[Mapping]) -> str:
    """The tools for a V3 / R1 prompt (their templates have no description of their own)."""
    return TOOLS_HEAD + _sections(tools) + V3_RULES


def describe_v31(tools: Sequence[Mapping]) -> str:
    """The tools for a V3.1 prompt, as its model card gives them (appended to the system prompt)."""
    return TOOLS_HEAD + _sections(tools) + V31_RULES


# V4's release text (encoding_dsv4.py's TOOLS_TEMPLATE), the schemas a JSON line per function
V4_TOOLS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{d}tool_calls>" block like the following:

<{d}tool_calls>
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
</{d}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def describe_v4(tools: Sequence[Mapping]) -> str:
    """The tools for a V4 prompt, after its system message's text and a blank line."""
    return V4_TOOLS.format(d=DSML, schemas="\n".join(to_json(f) for f in _functions(tools)))
