"""A request's tools and tool_choice, checked (OpenAI's shapes: a list of {"type": "function", "function": {name,
description, parameters, strict}}; "auto", "none", "required" or {"type": "function", "function": {"name": ...}}),
and the grammar that enforces a choice of "required" or a named function."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer.tool_format import ToolFormat
from dsfp4.runtime.generate.answer.tool_grammar import seq
from dsfp4.runtime.generate.reasoning import THINK_END

# OpenAI's rule for a function's name
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
MODES = ("auto", "none", "required")


def _function(i: int, tool: object) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
        raise ConfigError(f'{where}: must be {{"type": "function", "function": {{"name": ..., ...}}}}')
    f = tool.get("function")
    if not isinstance(f, Mapping):
        raise ConfigError(f"{where}.function: must be an object with the function's name")
    if extra := sorted(set(f) - FUNCTION_FIELDS):
        raise ConfigError(f"{where}.function: field {extra[0]!r} is not one of {', '.join(sorted(FUNCTION_FIELDS))}")
    if not isinstance(f.get("name"), str) or not FUNCTION_NAME.fullmatch(f["name"]):
        raise ConfigError(f"{where}.function.name: must be 1 to 64 letters, digits, _ or -, got {f.get('name')!r:.40}")
    if not isinstance(f.get("description", ""), str):
        raise ConfigError(f"{where}.function.description: must be text")
    params = f.get("parameters")
    if params is not None and (not isinstance(params, Mapping) or params.get("type", "object") != "object"):
        raise ConfigError(f"{where}.function.parameters: must be a JSON schema of an object")
    if not isinstance(f.get("strict", False), bool):
        raise ConfigError(f"{where}.function.strict: must be true or false")
    return {"type": "function", "function": dict(f)}


def check_tools(tools: object) -> list[dict] | None:
    """An OpenAI tools list, checked and copied; None (or an empty list): no tools."""
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ConfigError("tools: must be a list of functions")
    out = [_function(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in out]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise ConfigError(f"tools: function {dup!r} is listed twice")
    return out or None


@dataclass(frozen=True)
class ToolChoice:
    """mode: auto (the model decides), none (no calls), required (one call or more), function (a call of
    `function`, once)."""

    mode: str
    function: str | None = None

    @property
    def forced(self) -> bool:
        """Whether decoding must produce calls (a grammar enforces it)."""
        return self.mode in ("required", "function")


def check_tool_choice(choice: object, tools: Sequence[Mapping] | None) -> ToolChoice:
    """A request's tool_choice against its (checked) tools; unset: auto with tools, none without."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    names = [t["function"]["name"] for t in tools or ()]
    if isinstance(choice, str):
        if choice not in MODES:
            raise ConfigError(f"tool_choice: must be one of {', '.join(MODES)} or a named function, got {choice!r:.40}")
        if choice == "required" and not names:
            raise ConfigError("tool_choice: 'required' needs tools to call; give tools")
        return ToolChoice(choice)
    f = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise ConfigError('tool_choice: a named function is {"type": "function", "function": {"name": ...}}')
    if f["name"] not in names:
        raise ConfigError(f"tool_choice: names {f['name']!r}, which is not one of the request's tools")
    return ToolChoice("function", f["name"])


def tool_choice_grammar(
    fmt: ToolFormat,
    tools: Sequence[Mapping],
    choice: ToolChoice,
    ids: Mapping[str, int],
    parallel: bool = True,
    reasoning: bool = False,
) -> str | None:
    """The Lark grammar (llguidance's dialect) of an answer that is a block of calls as the choice demands: for
    "required" one or more calls of the tools (one with parallel false), for a named function one call of it;
    None where the choice forces nothing. `ids`: the single-token markers of the format (and </think>) -> their
    token ids (ChatTokenizer.marker_ids). `reasoning`: the answer opens with reasoning the model closes with
    </think> (a thinking prompt), then the calls."""
    if not choice.forced:
        return None
    chosen = [t for t in tools if choice.mode == "required" or t["function"]["name"] == choice.function]
    start = "start: tool_calls\n"
    if reasoning:
        start = f"start: /(?s:.*)/ {seq(THINK_END, ids)} tool_calls\n"
    return start + fmt.grammar(chosen, parallel and choice.mode == "required", ids)
