"""The shape manifest.json must have, as data, and the check that a parsed manifest has it.

A manifest damaged by hand or by a broken copy must fail in one line that names where it is wrong, before any of
its values is used: `check` walks the parsed JSON against SCHEMA (and ModelArgs' fields against their types) and
returns the first place that differs, as a dotted path and what was expected there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsfp4.layout.model_args import ModelArgs


@dataclass(frozen=True)
class MapOf:
    """A JSON object of any keys (`numeric`: each a decimal integer) whose values all have `value`'s shape."""

    value: Any
    numeric: bool = False


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class Nullable:
    spec: Any


NUMBER = (int, float)
RECORD = {
    "format": str,
    "dim": int,
    "inter_dim": int,
    "nbytes": int,
    "parts": ListOf({"name": str, "dtype": str, "shape": ListOf(int), "offset": int, "nbytes": int}),
}
SCHEMA = {
    "format_version": int,
    "model": dict,  # ModelArgs' fields: checked by their types below
    "source": dict,
    "options": dict,
    "tensors": MapOf({"file": str, "format": str, "shape": ListOf(int), "tensors": MapOf(str)}),
    "files": MapOf({"nbytes": int, "sha256": str}),
    "experts": {
        "record": Nullable(RECORD),
        "layers": MapOf({"file": str, "offsets": ListOf(int), "sha256": ListOf(str)}, numeric=True),
    },
}
OPTIONAL = {"created_by": str, "checksum": str, "skipped": MapOf(int), "quant_error": MapOf(NUMBER)}
FIELD_TYPES = {"int": int, "float": NUMBER, "str": str, "bool": bool}  # ModelArgs' annotations -> JSON types


def _name(spec: Any) -> str:
    if isinstance(spec, tuple):
        return "a number"
    if isinstance(spec, (dict, MapOf)) or spec is dict:
        return "an object"
    if isinstance(spec, ListOf):
        return "a list"
    return {int: "an integer", str: "a string", bool: "true or false", float: "a number"}[spec]


def json_kind(value: Any) -> str:
    """How JSON names the value's type, with its article."""
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kind.get(type(value), "a number")


def _is(value: Any, t: type | tuple) -> bool:
    """JSON's type test: true and false are not numbers."""
    return isinstance(value, t) and not (isinstance(value, bool) and bool not in (t if isinstance(t, tuple) else (t,)))


def _walk(value: Any, spec: Any, path: str) -> str | None:
    """The first place under `path` where value does not have spec's shape -> 'path: expected X, found Y'."""
    if isinstance(spec, Nullable):
        return None if value is None else _walk(value, spec.spec, path)
    if isinstance(spec, (dict, MapOf, ListOf)) or spec is dict:
        container = list if isinstance(spec, ListOf) else dict
        if not isinstance(value, container):
            return f"{path}: expected {_name(spec)}, found {json_kind(value)}"
    elif not _is(value, spec):
        return f"{path}: expected {_name(spec)}, found {json_kind(value)} {value!r:.40}"
    if isinstance(spec, dict):
        for key, sub in spec.items():
            if key not in value:
                return f"{path}.{key}: missing"
            if (err := _walk(value[key], sub, f"{path}.{key}")) is not None:
                return err
    elif isinstance(spec, MapOf):
        for key, sub in value.items():
            if spec.numeric and not key.isdecimal():
                return f"{path}: key {key!r} is not a layer number"
            if (err := _walk(sub, spec.value, f"{path}.{key}")) is not None:
                return err
    elif isinstance(spec, ListOf):
        for i, item in enumerate(value):
            if (err := _walk(item, spec.item, f"{path}[{i}]")) is not None:
                return err
    return None


def field_spec(annotation: str) -> Any:
    """The JSON shape of a ModelArgs field from its annotation: 'int', 'int | None', 'tuple[str, ...]'."""
    if annotation.endswith(" | None"):
        return Nullable(field_spec(annotation.removesuffix(" | None")))
    if annotation.startswith("tuple["):
        return ListOf(FIELD_TYPES[annotation.removeprefix("tuple[").split(",")[0]])
    return FIELD_TYPES[annotation]


def _check_model(model: dict) -> str | None:
    present = [f for f in dataclasses.fields(ModelArgs) if f.name in model]  # from_dict names missing, unknown
    for f in present:
        if (err := _walk(model[f.name], field_spec(str(f.type)), f"model.{f.name}")) is not None:
            return err
    return None


def check(d: Any) -> str | None:
    """None when the parsed manifest `d` has the manifest's shape, else where and how it does not."""
    if not isinstance(d, dict):
        return f"expected a JSON object, found {json_kind(d)}"
    for key, spec in OPTIONAL.items():
        if key in d and (err := _walk(d[key], spec, key)) is not None:
            return err
    for key, spec in SCHEMA.items():
        if key not in d:
            return f"{key}: missing"
        if (err := _walk(d[key], spec, key)) is not None:
            return err
    return _check_model(d["model"])
