"""The manifest a conversion of a release would write, with no file behind it: what the planner reads to place a
model that is not on this machine (the whole DeepSeek-V3, say).

Each backbone tensor is stored as convert stores it (convert/plan.py out_tensor) from the form DeepSeek's release
ships it in (release_storage), so the rule of which tensor takes which format is convert's own.
"""

from __future__ import annotations

import functools

from dsfp4.convert.backbone import FP4, FP8
from dsfp4.convert.names.family import name_map
from dsfp4.convert.names.rules import EXPERT, LINEAR, MappedTensor, part_name
from dsfp4.convert.plan import ConvertOptions, out_tensor
from dsfp4.layout.formats import FORMATS, stored_nbytes
from dsfp4.layout.manifest import BACKBONE_DIR, ExpertFile, FileEntry, Manifest, TensorEntry
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.record import RecordLayout
from dsfp4.synthetic.hf_v4 import F32_NAMES

# a backbone given as one format -> the --backbone spec that stores every matrix so
SPECS = {FP8: "fp8", FP4: "fp4"}


def release_storage(ref: str, kind: str) -> str:
    """The format DeepSeek's release ships a backbone tensor in (as synthetic/hf_v3.py and hf_v4.py write it): the
    matrices it quantizes (LINEAR) in FP8 blocks, a hash layer's table int64, V4's mHC, sink, ape and gate-bias
    tensors fp32, the rest BF16."""
    if kind == LINEAR:
        return FP8
    if ref.endswith("tid2eid"):
        return "i64"
    return "f32" if F32_NAMES.fullmatch(ref) else "bf16"


@functools.cache
def planned_tensors(args: ModelArgs, backbone: str) -> dict[str, TensorEntry]:
    """Every backbone tensor's manifest entry, by reference name, as convert --backbone `backbone` (a spec, or one
    format for every matrix) writes it from the release: the family's name map placed for this model, experts left
    out."""
    options = ConvertOptions(backbone=SPECS.get(backbone, backbone))
    tensors = {}
    for rule, prefix, block, _, ctx in name_map(args).placed(args, True):
        if rule.kind == EXPERT:
            continue
        ref, part = rule.names(prefix, block)[1], part_name(block)
        item = MappedTensor(ref, rule.kind, part, rule.shape(ctx), release_storage(ref, rule.kind), {})
        out = out_tensor(item, options)
        tensors[ref] = TensorEntry(f"{BACKBONE_DIR}/{part}.safetensors", out.format, item.shape, out.names)
    return tensors


def planned_manifest(args: ModelArgs, backbone: str = FP8, expert_format: str = "nvfp4") -> Manifest:
    """The manifest a conversion of this shape would write (planned_tensors), with no file behind it. No checksums;
    a file's size is its tensors' stored bytes (the planner counts the largest, mapped while it loads)."""
    # the cached table stays as it is
    tensors = dict(planned_tensors(args, backbone))
    sizes: dict[str, int] = {}
    for t in tensors.values():
        sizes[t.file] = sizes.get(t.file, 0) + stored_nbytes(FORMATS[t.format], t.shape)
    files = {name: FileEntry(n, "") for name, n in sizes.items()}
    n = args.n_routed_experts
    record = RecordLayout.for_expert(expert_format, args.dim, args.moe_inter_dim)
    experts = {
        b: ExpertFile(f"experts/{part_name(b)}.bin", tuple(e * record.nbytes for e in range(n)), ("",) * n)
        for b in range(args.n_blocks)
        if args.is_moe_layer(b)
    }
    return Manifest(args, {}, {}, tensors, files, record, experts)
