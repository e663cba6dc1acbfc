"""Chat messages as a prompt format takes them, checked: roles and content, an assistant's tool_calls, tool results
with the tool_call_id of the call they answer. A field the format cannot carry is refused with its message's index
and the field named, never dropped: a speaker's name (a tool result's name only when it repeats the function of the
call it answers), tool calls and results on a model without a tool format, reasoning where the format keeps none.
Results follow the calls they answer and are put in the calls' order (V3's formats match them by position, V4's
release sorts them so)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from dsfp4.errors import ConfigError

# the roles a chat message may have, and the role the prompt format sees (OpenAI's developer is a system message)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
REASONING = "reasoning_content"


def _call(i: int, j: int, call: object) -> dict:
    """One of an assistant's tool_calls, OpenAI-shaped, its arguments JSON text (an object given is written)."""
    where = f"message {i}: tool_calls[{j}]"
    f = call.get("function") if isinstance(call, Mapping) else None
    shaped = isinstance(f, Mapping) and call.get("type", "function") == "function"
    if not shaped or set(call) - {"id", "type", "function"}:
        raise ConfigError(f'{where} must be {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}')
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise ConfigError(f"{where}: field 'id' must be the call's id (text), which its tool result names")
    if not isinstance(f.get("name"), str) or not f["name"] or set(f) - {"name", "arguments"}:
        raise ConfigError(f"{where}.function must hold the function's name and arguments only")
    arguments = f.get("arguments", "{}")
    if isinstance(arguments, Mapping):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ConfigError(f"{where}.function.arguments must be JSON text")
    return {"id": call["id"], "type": "function", "function": {"name": f["name"], "arguments": arguments}}


def _refuse(i: int, m: Mapping, allowed: set[str], tools: bool, reasoning: bool) -> None:
    """A field outside `allowed` for this message: a ConfigError saying why the format cannot carry it."""
    for key in sorted(set(m) - allowed):
        why = {
            "name": "a speaker's name has no place in DeepSeek's prompt formats; leave it out",
            "tool_calls": "tool calls belong to assistant messages"
            if tools
            else "this model's prompt format has no tool calls",
            "tool_call_id": "only a tool result names the call it answers",
            REASONING: "reasoning belongs to assistant messages"
            if reasoning
            else "this model's prompt format keeps no reasoning of earlier turns",
        }.get(key, "not a field of a chat message (role, content, tool_calls, tool_call_id)")
        raise ConfigError(f"message {i}: field {key!r}: {why}")


def _text(i: int, m: Mapping, empty_ok: bool = False) -> str | None:
    content = m.get("content")
    if not isinstance(content, str) and not (empty_ok and content is None):
        raise ConfigError(f"message {i}: content must be text, not {content!r:.40}")
    return content


def chat_messages(items: Sequence[Mapping], tools: bool, reasoning: bool) -> list[dict]:
    """The messages checked and in the format's shape; `tools`: the format has tool calls, `reasoning`: it keeps
    an assistant's reasoning_content."""
    out: list[dict] = []
    calls: dict[str, tuple[int, str]] = {}  # the last assistant's calls: id -> (order, function)
    answered: set[str] = set()
    for i, m in enumerate(items):
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ConfigError(f"message {i}: role {role!r:.40} is not one of {', '.join(ROLES)}")
        role = ROLES[role]
        if role == "tool":
            out.append(_result(i, m, calls, answered, tools))
            continue
        if role != "assistant":
            _refuse(i, m, {"role", "content"}, tools, reasoning)
            out.append({"role": role, "content": _text(i, m)})
            calls, answered = {}, set()
            continue
        _refuse(i, m, {"role", "content", "tool_calls"} | ({REASONING} if reasoning else set()), tools, reasoning)
        given = m.get("tool_calls") or []
        if given and not tools:
            _refuse(i, {"tool_calls": given}, set(), tools, reasoning)
        if not isinstance(given, Sequence) or isinstance(given, (str, bytes)):
            raise ConfigError(f"message {i}: tool_calls must be a list of calls")
        made = [_call(i, j, c) for j, c in enumerate(given)]
        content = _text(i, m, empty_ok=bool(made))
        # "" and None mean the same with calls; R1's template tells a turn of calls by content none
        message: dict = {"role": "assistant", "content": (content or None) if made else content}
        if made:
            message["tool_calls"] = made
        if isinstance(m.get(REASONING), str):
            message[REASONING] = m[REASONING]
        elif m.get(REASONING) is not None:
            raise ConfigError(f"message {i}: reasoning_content must be text")
        out.append(message)
        calls = {c["id"]: (j, c["function"]["name"]) for j, c in enumerate(made)}
        answered = set()
    return _in_call_order(out)


def _result(i: int, m: Mapping, calls: dict[str, tuple[int, str]], answered: set[str], tools: bool) -> dict:
    """A tool result: it answers a call of the assistant message before it (other results between), once."""
    if not tools:
        raise ConfigError(f"message {i}: role 'tool': this model's prompt format has no tool calls to answer")
    _refuse(i, m, {"role", "content", "tool_call_id", "name"}, tools, False)
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in calls:
        raise ConfigError(
            f"message {i}: tool_call_id {call_id!r:.40} answers no tool call of the assistant message before it"
        )
    if call_id in answered:
        raise ConfigError(f"message {i}: tool_call_id {call_id!r} is answered twice")
    if m.get("name") not in (None, calls[call_id][1]):
        raise ConfigError(
            f"message {i}: field 'name' is {m['name']!r:.40}, but call {call_id!r} is of {calls[call_id][1]!r}"
        )
    answered.add(call_id)
    return {"role": "tool", "tool_call_id": call_id, "content": _text(i, m)}


def _in_call_order(messages: list[dict]) -> list[dict]:
    """Each run of tool results sorted by the order of the calls they answer."""
    out: list[dict] = []
    order: dict[str, int] = {}
    for m in messages:
        if m["role"] == "tool":
            run = len(out)
            while run > 0 and out[run - 1]["role"] == "tool":
                run -= 1
            out.append(m)
            out[run:] = sorted(out[run:], key=lambda r: order[r["tool_call_id"]])
            continue
        if m["role"] == "assistant":
            order = {c["id"]: j for j, c in enumerate(m.get("tool_calls") or ())}
        out.append(m)
    return out


def check_rendered(prompt: str, messages: Sequence[Mapping], tools: Sequence[Mapping] | None) -> None:
    """A chat template that leaves a call, a result or a tool out of the prompt is refused, not trusted."""
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or ():
            if c["function"]["name"] not in prompt or c["function"]["arguments"] not in prompt:
                raise ConfigError(f"message {i}: the chat template leaves its tool call {c['id']!r} out of the prompt")
        if m["role"] == "tool" and m["content"] not in prompt:
            raise ConfigError(f"message {i}: the chat template leaves the tool result out of the prompt")
    for t in tools or ():
        if t["function"]["name"] not in prompt:
            raise ConfigError(f"tools: the chat template leaves {t['function']['name']!r} out of the prompt")
