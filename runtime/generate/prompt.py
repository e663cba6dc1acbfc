"""What a caller may give as a prompt, and its token ids: text (through the chat template, with an optional system
message, unless raw), chat messages (through the template) or token ids as given; and what a prompt must leave of
the context (PromptRules: without the model, so the server's HTTP process checks requests with them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

from dsfp4.errors import ConfigError, ContextLengthError
from dsfp4.runtime.generate.answer.tools import check_tools
from dsfp4.runtime.generate.chat_messages import chat_messages
from dsfp4.runtime.generate.reasoning import opens_thinking
from dsfp4.runtime.generate.tokenizer import ChatTokenizer

# text, chat messages or token ids
Prompt = str | Sequence[Mapping[str, object]] | Sequence[int]
# the roles of a message that is not a tool result, as the prompt format sees them (chat_messages.ROLES has all)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# prompt tokens decoded to see whether the prompt opens a <think> block
THINK_TAIL = 8


def as_token_ids(items: list) -> list[int] | None:
    """items as token ids (plain ints; bools are not), or None when they are something else."""
    if all(isinstance(t, Integral) and not isinstance(t, bool) for t in items):
        return [int(t) for t in items]
    return None


def encode_prompt(
    tokenizer: ChatTokenizer,
    prompt: Prompt,
    system: str | None = None,
    raw: bool = False,
    thinking: bool | None = None,
    default_thinking: bool | None = None,
    tools: object = None,
) -> list[int]:
    """Token ids of a prompt: text (through the prompt format, with an optional system message, unless `raw`), chat
    messages ([{"role": ..., "content": ...}], through the format; with tool calls and results: chat_messages.py)
    or token ids as given; `thinking` switches the format's thinking where it has a switch (`default_thinking`
    where it is not given and the format is used); `tools`: an OpenAI tools list the format describes to the model
    (tools.check_tools's shape; a format without tool calls refuses it)."""
    tools = check_tools(tools)
    if not isinstance(system, (str, type(None))) or not isinstance(raw, bool):
        raise ConfigError(f"system must be text or None and raw true or false, not {system!r:.40} and {raw!r:.40}")
    if not isinstance(thinking, (bool, type(None))):
        raise ConfigError(f"thinking must be true, false or None, not {thinking!r:.40}")
    if isinstance(prompt, str):
        if raw and system is not None:
            raise ConfigError("a system message goes through the chat template, which raw skips; give one of them")
        if raw and (thinking is not None or tools):
            raise ConfigError("thinking and tools go through the prompt format, which raw skips; leave them out")
        return tokenizer.encode_prompt(
            prompt, system, raw, default_thinking if thinking is None and not raw else thinking, tools
        )
    items = list(prompt) if isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, Mapping)) else []
    if items and (ids := as_token_ids(items)) is not None:
        if system is not None or raw or thinking is not None:
            raise ConfigError("system, raw and thinking apply to text prompts and chat messages, not to token ids")
        if tools:
            raise ConfigError("tools go through the prompt format, which token ids skip; give text or chat messages")
        return ids
    if items and all(isinstance(m, Mapping) for m in items):
        chat = chat_messages(items, tokenizer.tool_format is not None, tokenizer.keeps_reasoning)
        if raw:
            raise ConfigError("raw applies to text prompts; chat messages always go through the template")
        head = [{"role": "system", "content": system}] if system is not None else []
        return tokenizer.encode_chat(
            [*head, *chat], thinking=default_thinking if thinking is None else thinking, tools=tools
        )
    raise ConfigError("the prompt must be text, a non-empty list of chat messages or a non-empty list of token ids")


@dataclass(frozen=True)
class PromptSpec:
    """What PromptRules are made of, in plain values: another process rebuilds them from it."""

    model_dir: str
    eos_token_ids: tuple[int, ...]
    max_context: int
    # the model's: what --max-context may be raised to
    max_seq_len: int
    vocab_size: int
    # the engine's --thinking: the default of prompts through the format
    thinking: bool | None


class PromptRules:
    """A model's prompts as token ids, and whether they fit its context: what an engine refuses before it runs."""

    def __init__(self, spec: PromptSpec, tokenizer: ChatTokenizer | None = None):
        self.spec = spec
        self.tokenizer = tokenizer or ChatTokenizer(Path(spec.model_dir), spec.eos_token_ids)

    @property
    def max_context(self) -> int:
        return self.spec.max_context

    def encode(
        self,
        prompt: Prompt,
        system: str | None = None,
        raw: bool = False,
        thinking: bool | None = None,
        tools: object = None,
    ) -> list[int]:
        """encode_prompt with this model's tokenizer and default thinking."""
        return encode_prompt(self.tokenizer, prompt, system, raw, thinking, self.spec.thinking, tools)

    def opens_thinking(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves the model inside an R1-style <think> block (R1's chat templates do)."""
        return opens_thinking(self.tokenizer.decode(prompt_ids[-THINK_TAIL:], keep_special=True))

    def check(self, prompt_ids: list[int], room: int = 1) -> None:
        """A prompt must leave `room` positions of the context free and name tokens of the vocabulary."""
        n, s = len(prompt_ids), self.spec
        if n == 0:
            raise ConfigError("the prompt is empty")
        if n + room > s.max_context:
            # a larger --max-context cannot help past the model's positions
            fix = (
                f"raise --max-context, up to the model's {s.max_seq_len}"
                if n + room <= s.max_seq_len
                else f"the model's positions end at {s.max_seq_len}, whatever --max-context: shorten the prompt"
            )
            raise ContextLengthError(
                f"the prompt is {n} tokens; the context holds {s.max_context} ({fix})", n, s.max_context
            )
        if bad := [t for t in prompt_ids if not 0 <= t < s.vocab_size]:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0 to {s.vocab_size - 1})")

    def room(self, prompt_tokens: int) -> int:
        """Tokens a generation after a prompt of this length may produce (the last is never fed back)."""
        return self.spec.max_context - prompt_tokens + 1
