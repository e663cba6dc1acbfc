"""Values checked against types written as data: what a manifest read from disk and the options a caller passes
must hold, said once as a spec, with one message that names where a value is wrong and what it was.

A spec is a Python type (or a tuple of types: any of them), a dict of required keys and their specs (an object),
MapOf (any keys, one spec for their values), ListOf (one spec for the items) or Nullable (None, or the spec).
JSON's true and false are not numbers here, as in JSON.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", os.PathLike: "a path"}
KINDS = {dict: "an object", list: "a list", tuple: "a tuple", str: "a string", bool: "a boolean", type(None): "null"}
KINDS |= {int: "an integer", float: "a number"}
ANNOTATIONS = {"int": int, "float": (int, float), "str": str, "bool": bool, "Path": (str, os.PathLike)}


@dataclass(frozen=True)
class MapOf:
    """An object of any keys (`numeric`: each a decimal integer) whose values all have `value`'s spec."""

    value: Any
    numeric: bool = False


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class Nullable:
    spec: Any


def describe(spec: Any) -> str:
    """What a spec asks for, in words."""
    if isinstance(spec, Nullable):
        return f"{describe(spec.spec)} or null"
    if isinstance(spec, tuple):
        return "a number" if set(spec) == {int, float} else " or ".join(NAMES[t] for t in spec)
    if isinstance(spec, (dict, MapOf)) or spec is dict:
        return "an object"
    if isinstance(spec, ListOf):
        return f"a list of {describe(spec.item).removeprefix('a ').removeprefix('an ')}s"
    return NAMES[spec]


def kind(value: Any) -> str:
    """What a value is, in words, with its article."""
    return KINDS.get(type(value), type(value).__name__)


def _is(value: Any, t: type | tuple) -> bool:
    types = t if isinstance(t, tuple) else (t,)
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def check(value: Any, spec: Any, path: str) -> str | None:
    """None when `value` has `spec`'s shape, else the first place it does not: 'path: expected X, found Y'."""
    if isinstance(spec, Nullable):
        return None if value is None else check(value, spec.spec, path)
    container = (list, tuple) if isinstance(spec, ListOf) else dict if isinstance(spec, (dict, MapOf)) else None
    if spec is dict:
        container = dict
    if container is not None and not isinstance(value, container):
        return f"{path}: expected {describe(spec)}, found {kind(value)}"
    if container is None and not _is(value, spec):
        found = kind(value) if value is None else f"{kind(value)} {value!r:.40}"
        return f"{path}: expected {describe(spec)}, found {found}"
    if isinstance(spec, dict):
        for key, sub in spec.items():
            if key not in value:
                return f"{path}.{key}: missing"
            if (err := check(value[key], sub, f"{path}.{key}")) is not None:
                return err
    elif isinstance(spec, MapOf):
        for key, sub in value.items():
            if spec.numeric and not (isinstance(key, str) and key.isdecimal()):
                return f"{path}: key {key!r} is not a layer number"
            if (err := check(sub, spec.value, f"{path}.{key}")) is not None:
                return err
    elif isinstance(spec, ListOf):
        for i, item in enumerate(value):
            if (err := check(item, spec.item, f"{path}[{i}]")) is not None:
                return err
    return None


def annotation_spec(annotation: str) -> Any:
    """The spec of a dataclass field from its annotation: 'int', 'int | None', 'tuple[str, ...]', 'Path | None',
    'float | str | None'."""
    if annotation.endswith(" | None"):
        return Nullable(annotation_spec(annotation.removesuffix(" | None")))
    if annotation.startswith("tuple["):
        return ListOf(ANNOTATIONS[annotation.removeprefix("tuple[").split(",")[0]])
    # any of the types: 'float | str'
    if " | " in annotation:
        types = [ANNOTATIONS[part] for part in annotation.split(" | ")]
        return tuple(t for spec in types for t in (spec if isinstance(spec, tuple) else (spec,)))
    return ANNOTATIONS[annotation]
