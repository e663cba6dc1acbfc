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
Not here: tools (the server refuses them), the release's reasoning-effort preamble and its task markers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.reasoning import THINK_END, THINK_START

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
ROLES = ("system", "user", "assistant")


def _merged(messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """The turns as the release renders them: consecutive user messages become one."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m["role"] not in ROLES:
            raise ConfigError(f"DeepSeek-V4's prompt format has no role {m['role']!r}; use {', '.join(ROLES)}")
        if m["role"] == "user" and out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    return out


def encode_v4(messages: Sequence[Mapping[str, str]], thinking: bool, add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation ([{"role", "content"}, and for assistant turns optionally
    "reasoning_content"]) in thinking mode or chat mode. Without add_generation_prompt a conversation that ends with
    a user turn stops before the hand-over (the release always writes it)."""
    turns = _merged(messages)
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    parts = [BOS]
    for i, m in enumerate(turns):
        if m["role"] == "system":
            parts.append(m["content"])
        elif m["role"] == "user":
            parts.append(USER + m["content"])
        else:
            # reasoning survives only after the last user turn
            kept = thinking and i > last_user
            reasoning = m.get("reasoning_content") or ""
            parts.append((reasoning + THINK_END if kept else "") + m["content"] + EOS)
        following = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if m["role"] == "user" and following in ("assistant", None):
            if following is None and not add_generation_prompt:
                break
            parts.append(ASSISTANT + (THINK_START if thinking and i == last_user else THINK_END))
    return "".join(parts)
