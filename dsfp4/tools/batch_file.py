"""The offline batch's files (`dsfp4 run MODEL --batch IN --output OUT`).

IN: one JSON object per line: `prompt` (text, through the chat template as --prompt is, or as it is with `"raw":
true`) or `messages` (chat messages, with an agent's tool calls and results), optionally the sampling of that line
(max_tokens, temperature, top_p, top_k, seed, stop, the penalties, min_p, logprobs) and its answer's format as
OpenAI's chat completions take it: tools, tool_choice, parallel_tool_calls, response_format
(runtime/generate/answer/answer_format.py). Blank lines are skipped; every other line is checked before the model loads
(what needs its tokenizer, before the first answer), and a bad one is an error naming FILE:LINE.

OUT: one JSON object per answered line, in input order: `line` (its number in IN), `input_sha256` (of that line's
text), then what `run --json` prints (prompt_token_ids, token_ids, text, finish_reason, stats; tool_calls where the
line offers tools, or `error` where the model's calls are malformed). A rerun keeps the lines already answered and
answers the rest; a line torn by an interrupted write is dropped first.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsfp4.errors import ConfigError
from dsfp4.layout.atomic import atomic_write_bytes
from dsfp4.runtime.generate.answer.grammar import Grammar
from dsfp4.runtime.generate.answer.tools import check_tools
from dsfp4.runtime.generate.chat_messages import ROLES
from dsfp4.runtime.generate.prompt import Prompt
from dsfp4.runtime.options import SAMPLING, RunOptions, with_knobs

# the answer's format (AnswerFormat.of's arguments); a line's own grammar is response_format's
ANSWER = ("tools", "tool_choice", "parallel_tool_calls", "response_format")
KEYS = ("prompt", "messages", "raw", *(k for k in SAMPLING if k != "grammar"), *ANSWER)


@dataclass(frozen=True)
class BatchItem:
    # 1-based, in the input file
    line: int
    # text or chat messages
    prompt: Prompt
    raw: bool
    # the line's own sampling knobs (RunOptions fields)
    sampling: dict[str, Any]
    # its answer's format: ANSWER's fields given
    answer: dict[str, Any]
    # sha256 of the line's text: which input an output line answers
    digest: str


def parse_line(text: str, where: str, base: RunOptions) -> tuple[Prompt, bool, dict[str, Any], dict[str, Any]]:
    """One input line -> (prompt, raw, sampling knobs, answer format); ConfigError naming `where` (FILE:LINE) and
    what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg}); give one JSON object per line") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: a JSON object is expected, not {type(obj).__name__}")
    if unknown := sorted(set(obj) - set(KEYS)):
        raise ConfigError(f"{where}: unknown key {', '.join(unknown)}; a line may have {', '.join(KEYS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ConfigError(f"{where}: give one of `prompt` (text) or `messages` (chat messages)")
    raw = obj.get("raw", False)
    if not isinstance(raw, bool) or (raw and "messages" in obj):
        raise ConfigError(f"{where}: `raw` is true or false, and applies to `prompt` only")
    prompt = obj.get("prompt", obj.get("messages"))
    if "prompt" in obj and (not isinstance(prompt, str) or not prompt):
        raise ConfigError(f"{where}: `prompt` must be non-empty text")
    if "messages" in obj and not _messages(prompt):
        raise ConfigError(
            f'{where}: `messages` must be a non-empty list of {{"role": ..., "content": text}} with roles '
            f"{', '.join(ROLES)}"
        )
    sampling = {k: obj[k] for k in SAMPLING if k in obj}
    answer = {k: obj[k] for k in ANSWER if k in obj}
    try:
        with_knobs(base, sampling)
        check_tools(answer.get("tools"))
        if answer.get("response_format") is not None:
            Grammar.from_response_format(answer["response_format"])
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return prompt, raw, sampling, answer


def _messages(value: Any) -> bool:
    """Chat messages' shape; their fields are checked as the prompt is encoded (chat_messages.py)."""

    def message(m: Any) -> bool:
        calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
        content = m.get("content") if isinstance(m, dict) else None
        return isinstance(m, dict) and m.get("role") in ROLES and (isinstance(content, str) or calls)

    return isinstance(value, list) and bool(value) and all(map(message, value))


def read_batch(path: Path, base: RunOptions) -> list[BatchItem]:
    """Every line of the input checked -> its items; ConfigError naming the first bad FILE:LINE."""
    try:
        # lines end at \n only: JSON strings may hold U+2028 and its kin raw, which splitlines() would cut at
        lines = [line.removesuffix("\r") for line in Path(path).read_text(encoding="utf-8").split("\n")]
    except UnicodeDecodeError as e:
        raise ConfigError(f"--batch {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    items = []
    for n, text in enumerate(lines, 1):
        if text.strip():
            prompt, raw, sampling, answer = parse_line(text, f"{path}:{n}", base)
            items.append(BatchItem(n, prompt, raw, sampling, answer, hashlib.sha256(text.encode()).hexdigest()))
    if not items:
        raise ConfigError(f"--batch {path}: no lines to answer")
    return items


def answered(output: Path, items: list[BatchItem]) -> set[int]:
    """The input lines `output` already answers (a rerun skips them); a torn last line is dropped from the file.
    ConfigError when an output line answers a line this input does not have."""
    path = Path(output)
    if not path.exists():
        return set()
    whole = path.read_bytes()
    lines = whole.split(b"\n")
    kept, done = [], set()
    digests = {item.line: item.digest for item in items}
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            line, digest = int(obj["line"]), obj["input_sha256"]
        except (ValueError, KeyError, TypeError):
            # the last write was interrupted: answer that line again
            if i == len(lines) - 1:
                break
            raise ConfigError(f"--output {path}: line {i + 1} is not a result of `dsfp4 run --batch`") from None
        if digests.get(line) != digest:
            raise ConfigError(
                f"--output {path}: line {i + 1} answers input line {line} of another input; choose another --output"
            )
        kept.append(raw)
        done.add(line)
    data = b"".join(r + b"\n" for r in kept)
    if data != whole:
        atomic_write_bytes(path, data)
    return done


def append_result(f: Any, item: BatchItem, result: dict) -> None:
    """One output line, on disk before the next line is answered."""
    f.write(json.dumps({"line": item.line, "input_sha256": item.digest, **result}, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())
