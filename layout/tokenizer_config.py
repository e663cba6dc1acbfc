"""tokenizer_config.json as every reader takes it (convert checks it before copying it, the tokenizer and the GGUF
export read it): a JSON object whose special tokens, add_*_token switches and chat template have the shapes
transformers writes, else one line naming the file and the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsfp4.errors import DsfpError, ManifestError
from dsfp4.value_types import kind

NAME = "tokenizer_config.json"


def _token_ok(value: Any) -> bool:
    """A special token: text, or an {"content": text, ...} object."""
    if isinstance(value, dict):
        return isinstance(value.get("content"), str)
    return value is None or isinstance(value, str)


def _template_ok(value: Any) -> bool:
    """The chat template: text, or a list of {"name": ..., "template": text} objects."""
    if value is None or isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    )


def config_problem(cfg: Any) -> str | None:
    """None when `cfg` (parsed tokenizer_config.json) has the shape its readers take, else what is wrong."""
    if not isinstance(cfg, dict):
        return f"expected a JSON object, found {kind(cfg)}"
    for key in ("bos_token", "eos_token"):
        if not _token_ok(cfg.get(key)):
            return f"{key} must be text or an object with a text `content`"
    for key in ("add_bos_token", "add_eos_token"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            return f"{key} must be true or false"
    if not _template_ok(cfg.get("chat_template")):
        return "chat_template must be text or a list of {name, template} objects"
    return None


def read_tokenizer_config(
    path: Path, error: type[DsfpError] = ManifestError, fix: str = "copy it again from the source checkpoint"
) -> dict[str, Any]:
    """The checked contents of `path` ({} where there is no such file); `error` with `fix` where it is damaged."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); {fix}") from e
    if (problem := config_problem(cfg)) is not None:
        raise error(f"{path}: {problem}; {fix}")
    return cfg
