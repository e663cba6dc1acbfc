"""The conversion plan: which output each source tensor becomes, in which format, in which file.

A plan is computed from the source's headers alone (no tensor data), so `--dry-run`, the disk-space
check and resuming all see the same sizes. Work is split into parts: "top" (embedding, final norm,
head) and one part per decoder block (its backbone file and, for MoE blocks, its expert file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from dsfp4.convert.backbone import FUSED_PAIRS, backbone_format, fp4_kinds
from dsfp4.convert.names.rules import AUX, EXPERT, LINEAR, MappedTensor, TensorMap, part_name
from dsfp4.convert.source.checkpoint import INDEX_NAME, SourceCheckpoint
from dsfp4.errors import ConfigError
from dsfp4.layout.formats import FORMATS, FP4_FORMATS, component_shapes, get_format, stored_nbytes
from dsfp4.layout.manifest import BACKBONE_DIR, MANIFEST_VERSION
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.record import RecordLayout
from dsfp4.units import format_bytes
from dsfp4.version import __version__

# each fused matrix's other half
PARTNER = {x: y for a, b in FUSED_PAIRS for x, y in ((a, b), (b, a))}
# --head -> the format a BF16 head is stored in (None: as stored)
HEADS = {"bf16": None, "fp8": "fp8_e4m3_b128"}
# safetensors JSON header estimate, for the size plan only
HEADER_BYTES_PER_TENSOR = 128
AUTO_FORMAT = "auto"
# for experts the source stores in FP8 or BF16
DEFAULT_EXPERT_FORMAT = "nvfp4"
# (model shape, expert format) -> a --backbone spec
BackboneChooser = Callable[[ModelArgs, str], str]


def expert_format(requested: str, tmap: TensorMap) -> str:
    """--format auto: the FP4 format the source's routed experts are stored in (repacked byte for byte:
    NVIDIA's NVFP4 exports, DeepSeek-V4's MXFP4), else nvfp4; any other value is taken as given."""
    stored = {i.storage for i in tmap.items if i.kind == EXPERT}
    if requested != AUTO_FORMAT:
        return requested
    return stored.pop() if len(stored) == 1 and stored <= set(FP4_FORMATS) else DEFAULT_EXPERT_FORMAT


@dataclass(frozen=True)
class ConvertOptions:
    """Knobs of `dsfp4 convert`; each field is the flag of the same name."""

    # the source's own FP4 format, else nvfp4 (expert_format)
    format: str = AUTO_FORMAT
    # a --backbone spec (convert/backbone.py), or auto: the caller's chooser decides (make_plan)
    backbone: str = "fp8"
    # the output head: bf16 as the releases store it, or fp8 (128x128 blocks)
    head: str = "bf16"
    no_mtp: bool = False
    workers: int = 2
    device: str = "auto"
    force: bool = False
    dry_run: bool = False

    def __post_init__(self) -> None:
        if self.format not in (AUTO_FORMAT, *FP4_FORMATS):
            raise ConfigError(f"--format {self.format}: choose one of {', '.join((AUTO_FORMAT, *FP4_FORMATS))}")
        if self.backbone != AUTO_FORMAT:
            # a one-line error for a bad spec
            fp4_kinds(self.backbone)
        if self.head not in HEADS:
            raise ConfigError(f"--head {self.head}: choose one of {', '.join(HEADS)}")
        if self.workers < 1:
            raise ConfigError(f"--workers {self.workers}: give at least 1")


@dataclass(frozen=True)
class OutTensor:
    """One backbone weight of the output: its source, its target format and stored component names."""

    item: MappedTensor
    format: str
    names: dict[str, str]
    # up for gate and gate for up: one NVFP4 global scale
    amax_partner: MappedTensor | None = None

    @property
    def is_copy(self) -> bool:
        """Stored as the source stores it: the bytes are copied, never decoded."""
        return self.format == self.item.storage

    def entries(self) -> list[tuple[str, str, tuple[int, ...]]]:
        spec = FORMATS[self.format]
        shapes = component_shapes(spec, self.item.shape, self.item.ref)
        return [(self.names[c], dt, s) for (c, dt), s in zip(spec.components, shapes, strict=True)]


@dataclass(frozen=True)
class Part:
    name: str
    block: int | None
    backbone: tuple[OutTensor, ...]
    # (w1, w3, w2) by expert id
    experts: tuple[tuple[MappedTensor, MappedTensor, MappedTensor], ...]
    in_bytes: int
    out_bytes: int

    @property
    def backbone_file(self) -> str:
        return f"{BACKBONE_DIR}/{self.name}.safetensors"

    @property
    def experts_file(self) -> str | None:
        return f"experts/{self.name}.bin" if self.experts else None


@dataclass(frozen=True)
class Plan:
    args: ModelArgs
    options: ConvertOptions
    parts: tuple[Part, ...]
    record: RecordLayout | None
    skipped: dict[str, str]
    source_info: dict
    fingerprint: str

    @property
    def in_bytes(self) -> int:
        return sum(p.in_bytes for p in self.parts)

    @property
    def out_bytes(self) -> int:
        return sum(p.out_bytes for p in self.parts)

    def manifest_options(self) -> dict:
        o = self.options
        return {"format": o.format, "backbone": o.backbone, "head": o.head, "mtp": not o.no_mtp}


def is_head(ref: str) -> bool:
    """The output head: the main model's and an MTP layer's (layers.61.head.weight)."""
    return ref == "head.weight" or ref.endswith(".head.weight")


def target_format(item: MappedTensor, backbone: str, head: str = "bf16") -> str:
    """Backbone matrices DeepSeek ships in FP8 go to FP8 (kept bit-exact when already FP8) or to NVFP4, by their
    kind and the --backbone spec (convert/backbone.py); NVFP4 sources stay NVFP4; a BF16 head goes to --head's
    format; everything else as stored."""
    if is_head(item.ref) and item.storage == "bf16" and HEADS[head]:
        return HEADS[head]
    if item.kind != LINEAR or item.storage == "nvfp4":
        return item.storage
    return backbone_format(item.ref, backbone)


def out_tensor(item: MappedTensor, options: ConvertOptions) -> OutTensor:
    """What convert stores a backbone tensor as: its format (target_format) and its components' names."""
    fmt = target_format(item, options.backbone, options.head)
    spec = get_format(fmt)
    names = {"weight": item.ref} if spec.scale is None else {c: f"{item.ref}.{c}" for c, _ in spec.components}
    return OutTensor(item, fmt, names)


def _pair_fused(backbone: tuple[OutTensor, ...]) -> tuple[OutTensor, ...]:
    """The two matrices of a FUSED_PAIRS pair (convert/backbone.py) quantized to NVFP4 share a global scale from their
    joint amax, as NVIDIA's exports do for gate and up."""
    by_ref = {t.item.ref: t for t in backbone}
    out = []
    for t in backbone:
        base, _, proj = t.item.ref.rpartition(".")
        other = by_ref.get(f"{base}.{PARTNER[proj]}") if proj in PARTNER else None
        if t.format == "nvfp4" and not t.is_copy and other and other.format == "nvfp4" and not other.is_copy:
            t = dataclasses.replace(t, amax_partner=other.item)
        out.append(t)
    return tuple(out)


def make_plan(
    src: SourceCheckpoint, tmap: TensorMap, options: ConvertOptions, choose_backbone: BackboneChooser | None = None
) -> Plan:
    """`choose_backbone`: what --backbone auto becomes for the model's shape and expert format (the CLI sizes it for
    the machine: projection/backbone_choice.py); without one, fp8."""
    options = dataclasses.replace(options, format=expert_format(options.format, tmap))
    args = src.args if not options.no_mtp else dataclasses.replace(src.args, n_mtp_layers=0)
    if options.backbone == AUTO_FORMAT:
        spec = choose_backbone(args, options.format) if choose_backbone else "fp8"
        fp4_kinds(spec)
        options = dataclasses.replace(options, backbone=spec)
    record = (
        RecordLayout.for_expert(options.format, args.dim, args.moe_inter_dim)
        if any(args.is_moe_layer(b) for b in range(args.n_blocks))
        else None
    )
    in_size = {name: t.info.nbytes for name, t in src.tensors.items()}
    parts = []
    for block in [None, *range(args.n_blocks)]:
        name = part_name(block)
        items = [i for i in tmap.items if i.part == name]
        backbone = _pair_fused(tuple(out_tensor(i, options) for i in items if i.kind != EXPERT))
        by_expert: dict[int, dict[str, MappedTensor]] = {}
        for i in items:
            if i.kind == EXPERT:
                by_expert.setdefault(i.expert, {})[i.ref.rsplit(".", 1)[1]] = i
        experts = tuple((p["w1"], p["w3"], p["w2"]) for _, p in sorted(by_expert.items()))
        in_bytes = sum(in_size[s] for i in items for s in i.sources.values())
        out_bytes = sum(
            stored_nbytes(FORMATS[o.format], o.item.shape) + HEADER_BYTES_PER_TENSOR * len(o.names) for o in backbone
        )
        out_bytes += len(experts) * record.nbytes if experts else 0
        parts.append(Part(name, block, backbone, experts, in_bytes, out_bytes))
    kinds = Counter(i.storage for i in tmap.items)
    source_info = {
        "fingerprint": src.fingerprint,
        "quantization": src.quant_config.get("quant_method", "none"),
        "storage": dict(sorted(kinds.items())),
        "n_tensors": len(src.tensors),
        "nbytes": src.nbytes,
        "n_shards": len(src.shards),
    }
    key = {
        "source": src.fingerprint,
        "format": options.format,
        "backbone": options.backbone,
        "no_mtp": options.no_mtp,
        "layout": MANIFEST_VERSION,
        "dsfp4": __version__,
        # the default keeps earlier keys
        **({"head": options.head} if options.head != "bf16" else {}),
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Plan(args, options, tuple(parts), record, tmap.skipped, source_info, fingerprint)


def describe_part(part: Part, args: ModelArgs) -> str:
    if part.block is None:
        return "embedding, final norm, head"
    kind = "MTP block" if part.block >= args.n_layers else "block"
    ffn = f"MoE, {len(part.experts)} experts" if part.experts else "dense MLP"
    return f"{kind} {part.block}: attention, {ffn}"


def plan_table(plan: Plan, src_path: str, out_path: str) -> str:
    """The dry-run report: sizes in and out, per part, and what happens to each kind of tensor."""
    a, o = plan.args, plan.options
    src = plan.source_info
    lines = [
        f"source  {src_path}: {a.family}, {src['n_tensors']} tensors in {src['n_shards']} shard(s) "
        f"({INDEX_NAME if src['n_shards'] > 1 else 'single file'}), {format_bytes(src['nbytes'])}, "
        f"quantization: {src['quantization']}",
        f"output  {out_path}: experts {o.format}, backbone {o.backbone}"
        + (f", expert record {format_bytes(plan.record.nbytes)}" if plan.record else ""),
        "",
        f"{'part':<11}{'source':>12}{'output':>12}  contents",
    ]
    for p in plan.parts:
        lines.append(
            f"{p.name:<11}{format_bytes(p.in_bytes):>12}{format_bytes(p.out_bytes):>12}  {describe_part(p, a)}"
        )
    lines.append(f"{'total':<11}{format_bytes(plan.in_bytes):>12}{format_bytes(plan.out_bytes):>12}")
    actions = Counter()
    for p in plan.parts:
        for t in p.backbone:
            verb = "kept as stored" if t.is_copy else f"{t.item.storage} -> {t.format}"
            actions[f"backbone {'matrices' if t.item.kind in (LINEAR, AUX) else 'other'}: {verb}"] += 1
        for trio in p.experts:
            for i in trio:
                same = i.storage == o.format
                actions[f"routed experts: {'repacked' if same else i.storage + ' -> ' + o.format}"] += 1
    lines += ["", *(f"{n:>7} tensors  {what}" for what, n in sorted(actions.items()))]
    for reason, n in sorted(Counter(plan.skipped.values()).items()):
        lines.append(f"{n:>7} skipped  {reason}")
    return "\n".join(lines)
