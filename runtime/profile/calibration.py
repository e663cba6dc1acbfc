"""Calibration text for `dsfp4 profile-hot`: the built-in mixed set, or the user's prompts, as one token
stream cut into sequences.

Prompt files are plain text, one prompt per non-empty line, or (--chat-format) JSON lines, each a
conversation rendered with the model's chat template: {"messages": [{"role": ..., "content": ...}, ...]}
or the bare list of messages; a {"text": ...} line is taken as plain text. The built-in set ships with
the package in that JSON-lines form (written for dsfp4: prose, code, chats, other languages), and its
files are interleaved so that a small --tokens still sees every kind.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.resources import files
from itertools import chain, zip_longest
from pathlib import Path

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.tokenizer import ChatTokenizer

BUILTIN_FILES = ("prose.jsonl", "code.jsonl", "chat.jsonl", "languages.jsonl")
BUILTIN_SOURCE = "builtin: dsfp4 calibration text (prose, code, chat, languages)"
ROLES = ("system", "user", "assistant")

# plain text, or a conversation
Entry = str | list[dict[str, str]]


@dataclass(frozen=True)
class Calibration:
    # token ids, each at most the sequence length
    sequences: list[list[int]]
    # what the text was, for hot.json
    source: str
    # tokens the text held before the cut at --tokens
    available: int

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def _messages(value: object, where: str) -> list[dict[str, str]]:
    msgs = value.get("messages") if isinstance(value, dict) else value
    if (
        not isinstance(msgs, list)
        or not msgs
        or not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in msgs)
    ):
        raise ConfigError(
            f'{where}: expected {{"messages": [{{"role": "user", "content": "..."}}, ...]}} with roles '
            f'{", ".join(ROLES)}, or {{"text": "..."}}'
        )
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def parse_jsonl(text: str, name: str) -> list[Entry]:
    """Entries of a JSON-lines prompt file; ConfigError names the file and line."""
    entries: list[Entry] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not a JSON line ({e.msg}); drop --chat-format for plain text") from e
        if isinstance(value, dict) and isinstance(value.get("text"), str):
            entries.append(value["text"])
        else:
            entries.append(_messages(value, where))
    return entries


def read_prompts(path: Path, chat_format: bool) -> tuple[list[Entry], str]:
    """The prompts of a file, and the file's sha256 (read once)."""
    try:
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {path}: cannot read it as UTF-8 text ({e})") from e
    entries = parse_jsonl(text, str(path)) if chat_format else [line for line in text.splitlines() if line.strip()]
    if not entries:
        raise ConfigError(f"--prompts {path}: no prompts in it")
    return entries, hashlib.sha256(raw).hexdigest()


def builtin_entries() -> list[Entry]:
    """The built-in set, its files interleaved entry by entry."""
    folder = files("dsfp4") / "calibration"
    per_file = [parse_jsonl((folder / name).read_text(encoding="utf-8"), name) for name in BUILTIN_FILES]
    return [e for e in chain.from_iterable(zip_longest(*per_file)) if e is not None]


def _encode(tokenizer: ChatTokenizer, entry: Entry) -> list[int]:
    if isinstance(entry, str):
        return tokenizer.encode(entry)
    return tokenizer.encode_chat(entry, add_generation_prompt=entry[-1]["role"] != "assistant")


def calibration(
    tokenizer: ChatTokenizer, prompts: Path | None, chat_format: bool, tokens: int, seq_len: int
) -> Calibration:
    """The first `tokens` tokens of the prompts (each tokenized on its own, then concatenated), cut into
    sequences of seq_len tokens."""
    if prompts is None:
        if chat_format:
            raise ConfigError("--chat-format describes a --prompts file; give --prompts FILE")
        entries, source = builtin_entries(), BUILTIN_SOURCE
    else:
        entries, digest = read_prompts(prompts, chat_format)
        source = f"{Path(prompts).name} ({'chat' if chat_format else 'text'} lines, sha256 {digest[:16]})"
    stream: list[int] = []
    for entry in entries:
        if len(stream) >= tokens:
            break
        stream += _encode(tokenizer, entry)
    available = len(stream)
    stream = stream[:tokens]
    return Calibration([stream[i : i + seq_len] for i in range(0, len(stream), seq_len)], source, available)
