"""One config.json value of the expected type: the check every config reader makes, its errors naming the file and
the key."""

from __future__ import annotations

import math
from typing import Any

from dsfp4.errors import ConfigError

REQUIRED = object()
_KINDS = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "an object",
    list: "a list",
}


def config_value(
    c: dict[str, Any], key: str, kind: type, source: str, default: Any = REQUIRED, minimum: int = 0
) -> Any:
    """c[key] of type `kind` (None means absent: `default`, or an error where it is REQUIRED); integers are at least
    `minimum`, floats finite (JSON's NaN and Infinity are Python's), and an integer is taken for a float."""
    v = c.get(key)
    if v is None:
        if default is REQUIRED:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return default
    ok = isinstance(v, kind) and not (kind in (int, float) and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        raise ConfigError(f"{source}: {key} must be {_KINDS[kind]}, got {v!r}")
    if kind is float and not math.isfinite(v):
        raise ConfigError(f"{source}: {key} must be a finite number, got {v}")
    if kind is int and v < minimum:
        raise ConfigError(f"{source}: {key} must be at least {minimum}, got {v}")
    return v
