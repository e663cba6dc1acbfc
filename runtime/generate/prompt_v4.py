"""DeepSeek-V4's prompt format, built in code as the release builds it: V4-Flash ships no Jinja chat template, its
prompts come from Python (the release's encoding/encoding_dsv4.py, `encode_messages`), in a thinking mode or a
chat mode. What is written here is that format for system, user and assistant turns, checked against prompts the
release's encoder produced (tests/runtime/test_prompt_v4.py keeps them as facts).

- The BOS, then each system message's text as it is (no marker).
- A user turn is `<｜User｜>` + its text; user turns that follow each other are one, their texts joined by a blank
  line (the release merges them).
- A user turn followed by an assistant turn (or ending the conversation) hands over with `<｜Assistant｜>` and then
  `<think>` (thinking mode, the last user turn only) or `</think>`: the model answers after it, so a prompt ends
  in `<｜Assistant｜><think>` or `<｜Assistant｜></think>`.
- An assistant turn is its text and the EOS; in thinking mode a turn after the last user turn keeps its reasoning
  before a `</think>` (earlier turns lose theirs, as the release drops them).
- Tools (tool_markup.py's V4 strings): their description follows the first message's text when it is a system
  message (a system message of none first otherwise), after a blank line. An assistant's calls follow its text as a
  DSML block, before the EOS. Tool results are `<tool_result>` blocks of a user turn: results and user messages in
  a row are one turn, their parts joined by a blank line, the results in the order of the calls they answer. With
  tools every assistant turn keeps its reasoning and every user turn hands over with `<think>` in thinking mode.
Not here: the release's reasoning-effort preamble and its task markers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer.tool_markup import RESULT_BEGIN, RESULT_END, calls_v4, describe_v4
from dsfp4.runtime.generate.reasoning import THINK_END, THINK_START

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
ROLES = ("system", "user", "assistant", "tool")
PART_GAP = "\n\n"


def _part(m: Mapping) -> str:
    """A user message's text, or a tool result as its block."""
    return m["content"] if m["role"] == "user" else RESULT_BEGIN + m["content"] + RESULT_END


def _merged(messages: Sequence[Mapping], tools: Sequence[Mapping] | None) -> list[dict]:
    """The turns as the release renders them: the tools on the first message (a system one), user messages and
    tool results in a row one user turn."""
    out: list[dict] = []
    for m in messages:
        if m["role"] not in ROLES:
            raise ConfigError(f"DeepSeek-V4's prompt format has no role {m['role']!r}; use {', '.join(ROLES)}")
        if m["role"] in ("user", "tool") and out and out[-1]["role"] == "user":
            out[-1]["content"] += PART_GAP + _part(m)
        elif m["role"] in ("user", "tool"):
            out.append({"role": "user", "content": _part(m)})
        else:
            out.append(dict(m))
    if tools:
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        out[0]["content"] += PART_GAP + describe_v4(tools)
    return out


def _assistant(m: Mapping, reasoning: bool) -> str:
    """An assistant turn: its reasoning and </think> where kept, its text, its calls, the EOS."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
    head = (m.get("reasoning_content") or "") + THINK_END if reasoning else ""
    return head + (m.get("content") or "") + (calls_v4(calls) if calls else "") + EOS


def encode_v4(
    messages: Sequence[Mapping],
    thinking: bool,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping] | None = None,
) -> str:
    """The prompt text of a conversation ([{"role", "content"}, for assistant turns optionally "reasoning_content"
    and "tool_calls", tool results with "tool_call_id": chat_messages.py's shape, results in call order]) in
    thinking mode or chat mode, with an OpenAI tools list. Without add_generation_prompt a conversation that ends
    with a user turn stops before the hand-over (the release always writes it)."""
    turns = _merged(messages, tools)
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    # the release keeps every turn's reasoning when there are tools
    keep = bool(tools)
    parts = [BOS]
    for i, m in enumerate(turns):
        if m["role"] == "system":
            parts.append(m["content"])
        elif m["role"] == "user":
            parts.append(USER + m["content"])
        else:
            parts.append(_assistant(m, thinking and (keep or i > last_user)))
        following = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if m["role"] == "user" and following in ("assistant", None):
            if following is None and not add_generation_prompt:
                break
            parts.append(ASSISTANT + (THINK_START if thinking and (keep or i == last_user) else THINK_END))
    return "".join(parts)
