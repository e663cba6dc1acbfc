"""Text in and out: tokenizer.json through `tokenizers`, and the checkpoint's own chat template
(tokenizer_config.json, or chat_template.jinja) rendered with jinja2 the way transformers renders it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dsfp4.errors import ConfigError, ManifestError

THINK_END = "</think>"


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class ChatTokenizer:
    def __init__(self, model_dir: Path, eos_token_ids: tuple[int, ...] = ()):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{path} not found: copy the source checkpoint's tokenizer.json next to manifest.json")
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = {self.tok.token_to_id(self.eos_token)} if self.eos_token else set()
        self.eos_ids = frozenset((eos | set(eos_token_ids)) - {None})
        template = cfg.get("chat_template")
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self.template = env.from_string(template) if isinstance(template, str) else None

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids; `special` lets tokenizer.json's post-processor add what it adds (DeepSeek: the BOS)."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model was trained to see it (the template writes the BOS itself)."""
        if self.template is None:
            raise ConfigError("this model has no chat template (tokenizer_config.json); use a plain prompt")
        try:
            return self.template.render(
                messages=messages,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as e:
            raise ConfigError(f"the chat template refused the conversation: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.render_chat(messages), special=False)


def split_reasoning(text: str) -> tuple[str, str]:
    """R1-style output: (thinking, answer), split at the last </think>; no tag means no thinking."""
    head, sep, tail = text.rpartition(THINK_END)
    if not sep:
        return "", text
    return head.removeprefix("<think>").strip(), tail.lstrip()
