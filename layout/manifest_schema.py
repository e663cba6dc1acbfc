"""The shape manifest.json must have, as data (dsfp4/value_types.py specs), and the check that a parsed manifest has
it: a manifest damaged by hand or by a broken copy fails in one line that names where it is wrong, before any of
its values is used."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsfp4.layout.model_args import ModelArgs
from dsfp4.value_types import ListOf, MapOf, Nullable, annotation_spec, check

RECORD = {
    "format": str,
    "dim": int,
    "inter_dim": int,
    "nbytes": int,
    "parts": ListOf({"name": str, "dtype": str, "shape": ListOf(int), "offset": int, "nbytes": int}),
}
SCHEMA = {
    "format_version": int,
    # an object: ModelArgs' fields are checked by their annotations
    "model": {},
    "source": dict,
    "options": dict,
    "tensors": MapOf({"file": str, "format": str, "shape": ListOf(int), "tensors": MapOf(str)}),
    "files": MapOf({"nbytes": int, "sha256": str}),
    "experts": {
        "record": Nullable(RECORD),
        "layers": MapOf({"file": str, "offsets": ListOf(int), "sha256": ListOf(str)}, numeric=True),
    },
}
OPTIONAL = {"created_by": str, "checksum": str, "skipped": MapOf(int), "quant_error": MapOf((int, float))}


def check_manifest(d: Any) -> str | None:
    """None when the parsed manifest `d` has the manifest's shape, else where and how it does not."""
    present = {k: spec for k, spec in OPTIONAL.items() if isinstance(d, dict) and k in d}
    if (err := check(d, {**SCHEMA, **present}, "manifest")) is not None:
        return err.removeprefix("manifest.")
    # from_dict: missing, unknown
    fields = [f for f in dataclasses.fields(ModelArgs) if f.name in d["model"]]
    for f in fields:
        if (err := check(d["model"][f.name], annotation_spec(str(f.type)), f"model.{f.name}")) is not None:
            return err
    return None
