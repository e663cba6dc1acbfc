"""The manifest against itself and the model shape it records, before any reader trusts it: the record layout is
the one its format gives for the model's dims, every MoE layer has one offset and one checksum per routed expert,
and the records of a layer file neither overlap nor start off the alignment O_DIRECT reads need.

manifest_schema.py checks the types; this checks what the values must agree on. A manifest edited by hand or by a
broken tool fails here in one line naming the layer and the file, not later in a reader thread or a kernel.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from dsfp4.errors import FormatError
from dsfp4.layout.recipe import RECIPE_BITS
from dsfp4.layout.record import RECORD_ALIGN, RecordLayout

if TYPE_CHECKING:
    from dsfp4.layout.manifest import ExpertFile, Manifest


def _record_problem(m: Manifest) -> str | None:
    """Where the record layouts disagree with the model's dims, or None."""
    a, rec = m.args, m.record
    moe = [b for b in range(a.n_blocks) if a.is_moe_layer(b)]
    if rec is None:
        return "experts.record is null, but the model has MoE layers" if moe else None
    for name, have, want in (("dim", rec.dim, a.dim), ("inter_dim", rec.inter_dim, a.moe_inter_dim)):
        if have != want:
            return f"experts.record.{name} is {have}, the model's is {want}"
    try:
        exact = RecordLayout.for_expert(rec.format, a.dim, a.moe_inter_dim)
    except FormatError as e:
        return f"experts.record.format: {e}"
    if rec != exact:
        return f"experts.record does not lay out a {rec.format} record of dim {a.dim} x {a.moe_inter_dim}"
    for layer, cold in sorted(m.cold_layouts().items()):
        if cold is None:
            continue
        where = f"the cold record layout of experts.layers.{layer}"
        if any(b not in RECIPE_BITS for b in cold.code_bits) or not cold.cold:
            return f"{where} has code_bits {list(cold.code_bits)}: each of 2, 3 or 4 bits, some below 4"
        if cold != rec.cold_of(cold.code_bits):
            return f"{where} is not the {cold.code_bits}-bit cold layout of experts.record"
    return None


def _layer_problem(m: Manifest, layer: int, ef: ExpertFile) -> str | None:
    """Where one layer's entry is wrong (its lists, cold experts and record spans), or None."""
    n = m.args.n_routed_experts
    rel = PurePosixPath(ef.file)
    if rel.is_absolute() or ".." in rel.parts:
        return f"file {ef.file!r} is not a path inside the model folder"
    for name, have in (("offsets", len(ef.offsets)), ("sha256", len(ef.sha256))):
        if have != n:
            return f"{name} lists {have} experts, the model has {n}"
    if len(set(ef.cold)) != len(ef.cold) or any(not 0 <= e < n for e in ef.cold):
        return f"cold lists experts outside 0..{n - 1} or one twice"
    if ef.cold and ef.cold_record is None:
        return "cold experts are listed but no cold_record says their layout"
    if len(ef.source_sha256) != len(ef.cold):
        return f"source_sha256 lists {len(ef.source_sha256)} checksums for {len(ef.cold)} cold experts"
    spans = []
    for e, at in enumerate(ef.offsets):
        if at < 0 or at % RECORD_ALIGN:
            what = "negative" if at < 0 else f"not a multiple of {RECORD_ALIGN}"
            return f"expert {e}'s offset {at} is {what}"
        spans.append((at, at + m.layout_of((layer, e)).nbytes, e))
    spans.sort()
    for (_, end, e), (start, _, f) in zip(spans, spans[1:], strict=False):
        if start < end:
            return f"the records of experts {e} and {f} overlap"
    return None


def manifest_problem(m: Manifest) -> str | None:
    """None when `m`'s record layouts, layers and offsets agree with its model shape, else where and how not."""
    if (problem := _record_problem(m)) is not None:
        return problem
    a = m.args
    moe = {b for b in range(a.n_blocks) if a.is_moe_layer(b)}
    if missing := sorted(moe - set(m.experts)):
        return f"experts.layers has no entry for MoE layer {missing[0]}"
    if extra := sorted(set(m.experts) - moe):
        return f"experts.layers.{extra[0]} is not a MoE layer of this model"
    for layer, ef in sorted(m.experts.items()):
        if (problem := _layer_problem(m, layer, ef)) is not None:
            return f"experts.layers.{layer} ({ef.file}): {problem}"
    return None
