"""What an answer must spell, for constrained decoding: a JSON schema, any JSON object, or a Lark grammar as text (from
a flag, a request's response_format, or a tool_choice's grammar). A `Grammar` is a value, hashable (the compile
cache's key) and free of torch and llguidance, so the server's HTTP process checks a request's with it; compiling and
matching are grammar_matcher.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsfp4.errors import ConfigError

KINDS = ("json_object", "json_schema", "lark")


@dataclass(frozen=True)
class Grammar:
    """What a sequence's tokens must spell: `kind` one of KINDS, `source` the schema as JSON text or the Lark text
    ("" for any JSON object); `origin` names where it came from in errors (a flag, a request field)."""

    kind: str
    source: str = ""
    origin: str = field(default="grammar", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"{self.origin}: grammar kind {self.kind!r}; choose one of {', '.join(KINDS)}")

    @staticmethod
    def json_schema(schema: Mapping[str, Any] | str, origin: str = "json_schema") -> Grammar:
        """A JSON schema, as an object or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{origin}: not JSON ({e}); give a JSON schema") from e
        if not isinstance(schema, Mapping):
            raise ConfigError(f"{origin}: a JSON schema is an object, not {type(schema).__name__}")
        return Grammar("json_schema", json.dumps(schema), origin)

    @staticmethod
    def json_object(origin: str = "json_object") -> Grammar:
        """Any JSON object."""
        return Grammar("json_object", "", origin)

    @staticmethod
    def lark(text: str, origin: str = "grammar") -> Grammar:
        """A Lark grammar (llguidance's dialect: `start` is the whole answer; special tokens as <name> or <[id]>)."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{origin}: give a Lark grammar's text (it is empty)")
        return Grammar("lark", text, origin)

    @staticmethod
    def from_response_format(response_format: Mapping[str, Any]) -> Grammar | None:
        """OpenAI's response_format: {"type": "text"} (None: no grammar), {"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (enforced either way)."""
        kind = response_format.get("type") if isinstance(response_format, Mapping) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar.json_object("response_format")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema", {}) if isinstance(spec, Mapping) else None
            if schema is None:
                raise ConfigError("response_format.json_schema: give an object with the schema under 'schema'")
            return Grammar.json_schema(schema, "response_format.json_schema.schema")
        raise ConfigError(f"response_format.type {kind!r}: give text, json_object or json_schema")

    def describe(self) -> str:
        return {"json_object": "a JSON object", "json_schema": "the JSON schema", "lark": "the Lark grammar"}[self.kind]
