"""A converted model as the compressed-tensors checkpoint vLLM and SGLang load (`dsfp4 export --format
compressed-tensors`), written from the stored bytes without requantizing.

Names are the source checkpoint's (the family's name map, read backwards). Each matrix keeps its stored format:
  FP8 128x128 blocks  `weight` (F8_E4M3) and `weight_scale` (F32 multipliers), format `float-quantized`, strategy
                      block, with dynamic per-group-of-128 FP8 activations (DeepSeek's own scheme)
  NVFP4               `weight_packed` (U8, element 2k in the low nibble), `weight_scale` (E4M3, linear) and
                      `weight_global_scale` (F32 [1]: the reciprocal of the stored per-tensor multiplier), format
                      `nvfp4-pack-quantized`, strategy tensor_group of 16, weights only
  MXFP4               `weight_packed`, `weight_scale` (E8M0 as U8), format `mxfp4-pack-quantized`, group 32
  plain (BF16, F32)   `weight` as it is; a plain matrix is listed in `ignore`, with lm_head and the routers
One config group per stored format, its targets regexes of the module names with their layer and expert numbers
as \\d+ (so one group never matches another's modules, and the FP8 group matches no routed expert). A routed
expert's gate and up share one global scale in the compressed-tensors layout (vLLM fuses them): a record whose two
differ is refused, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dsfp4.convert.backbone import FP8, FUSED_PAIRS
from dsfp4.convert.names.family import name_map
from dsfp4.convert.names.rules import PLAIN
from dsfp4.errors import FormatError
from dsfp4.layout.formats import DTYPE_NBYTES, component_shapes, get_format, shape_numel
from dsfp4.layout.manifest import Manifest

PACKED = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
GROUP = {"nvfp4": 16, "mxfp4": 32}
# the tensor's bytes, read when its shard is written
Read = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class OutTensor:
    # in the exported checkpoint
    name: str
    # safetensors dtype
    dtype: str
    shape: tuple[int, ...]
    read: Read

    @property
    def nbytes(self) -> int:
        return shape_numel(self.shape) * DTYPE_NBYTES[self.dtype]


@dataclass(frozen=True)
class Module:
    """A matrix of the export: its module name and stored format (plain formats: bf16, f32)."""

    name: str
    format: str


def _template(name: str) -> str:
    """A module name with its numbers as \\d+: the regex of its kind."""
    return re.sub(r"\\\.(\d+)(?=\\\.|$)", r"\\.\\d+", re.escape(name))


def kind_formats(modules: list[Module], template: Callable[[str], str]) -> dict[str, str]:
    """Each kind of module (its name as `template` writes it, numbers generalized) -> its one stored format; an
    export's config names kinds, so a kind stored in two formats is a FormatError naming it."""
    kinds: dict[str, str] = {}
    for m in modules:
        kind = template(m.name)
        if kinds.setdefault(kind, m.format) != m.format:
            raise FormatError(f"{kind}: modules of this kind are stored as {kinds[kind]} and {m.format}")
    return kinds


def quantization_config(modules: list[Module]) -> dict:
    """The checkpoint's quantization_config: a group per quantized format, `ignore` for the rest."""
    kinds = kind_formats(modules, _template)
    groups, ignore = {}, ["lm_head", r"re:.*\.mlp\.gate$"]
    by_format: dict[str, list[str]] = {}
    for kind, fmt in sorted(kinds.items()):
        by_format.setdefault(fmt, []).append(kind)
    for fmt, names in sorted(by_format.items()):
        targets = [f"re:^(?:{'|'.join(names)})$"]
        if fmt == FP8:
            groups[f"group_{len(groups)}"] = {
                "targets": targets,
                "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
                | {"symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}
                | {"symmetric": True, "dynamic": True},
                "format": "float-quantized",
            }
        elif fmt in PACKED:
            strategy = "tensor_group" if fmt == "nvfp4" else "group"
            groups[f"group_{len(groups)}"] = {
                "targets": targets,
                "weights": {"num_bits": 4, "type": "float", "strategy": strategy, "group_size": GROUP[fmt]}
                | {"symmetric": True, "dynamic": False, **({"scale_dtype": "torch.uint8"} if fmt == "mxfp4" else {})},
                "input_activations": None,
                "format": PACKED[fmt],
            }
        else:
            ignore += [f"re:^{n}$" for n in names]
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
    }


def _matrix(module: str, fmt: str, parts: dict[str, Read], shapes: dict[str, tuple[int, ...]]) -> list[OutTensor]:
    """A stored matrix's tensors under the compressed-tensors names (parts: component -> reader; shapes: component ->
    shape, and "dtype": the stored weight's)."""
    if fmt == FP8:
        names = {"weight": ("weight", "F8_E4M3"), "scale": ("weight_scale", "F32")}
    elif fmt == "nvfp4":
        names = {"weight": ("weight_packed", "U8"), "scale": ("weight_scale", "F8_E4M3")}
    elif fmt == "mxfp4":
        names = {"weight": ("weight_packed", "U8"), "scale": ("weight_scale", "U8")}
    else:
        names = {"weight": ("weight", None)}
    out = []
    for comp, (suffix, dtype) in names.items():
        out.append(OutTensor(f"{module}.{suffix}", dtype or shapes["dtype"], shapes[comp], parts[comp]))
    if fmt == "nvfp4":
        g = parts["scale_2"]
        out.append(OutTensor(f"{module}.weight_global_scale", "F32", (1,), lambda g=g: (1.0 / g().float()).reshape(1)))
    return out


def check_fused(manifest: Manifest, read: Callable[[str, str], torch.Tensor]) -> None:
    """The backbone pairs vLLM and SGLang fuse into one layer (FUSED_PAIRS) must share their format and, in NVFP4,
    their global scale; FormatError naming the pair otherwise."""
    for name, ea in manifest.tensors.items():
        base, _, proj = name.rpartition(".")
        second = next((b for a, b in FUSED_PAIRS if a == proj), None)
        eb = manifest.tensors.get(f"{base}.{second}") if second else None
        if eb is None:
            continue
        # layers.1.attn -> attn
        kind = base.split(".", 2)[2] if base.startswith("layers.") else base
        where = f"{name} and {kind}.{second}"
        if ea.format != eb.format:
            raise FormatError(
                f"{where} are stored as {ea.format} and {eb.format}; engines fuse them into one layer: convert "
                "again with both kinds in one --backbone format"
            )
        if ea.format == "nvfp4":
            ga, gb = (read(e.file, e.tensors["scale_2"]) for e in (ea, eb))
            if not torch.equal(ga.float(), gb.float()):
                raise FormatError(
                    f"{where} have different NVFP4 global scales; engines fuse them under one: convert the model "
                    "again with this dsfp4"
                )


# a stored matrix under an export's names: (module, stored format, component readers, shapes) -> its tensors
Matrix = Callable[[str, str, dict[str, Read], dict[str, tuple[int, ...]]], list[OutTensor]]


def backbone_tensors(
    manifest: Manifest, read: Callable[[str, str], torch.Tensor], matrix: Matrix = _matrix
) -> Iterator[tuple[str, OutTensor]]:
    """(backbone file, tensor) for every stored backbone tensor, each matrix as `matrix` writes it; read(file, stored
    name) -> the tensor."""
    a = manifest.args
    for rule, prefix, block, expert, _ in name_map(a).placed(a, True):
        if expert is not None:
            continue
        hf, ref = rule.names(prefix, block)
        entry = manifest.tensors.get(ref)
        # an MTP layer converted without (--no-mtp), or a tensor the conversion skipped
        if entry is None:
            continue
        parts = {c: (lambda f=entry.file, n=n: read(f, n)) for c, n in entry.tensors.items()}
        spec = get_format(entry.format)
        if rule.kind == PLAIN:
            yield entry.file, OutTensor(hf, spec.components[0][1], entry.shape, parts["weight"])
            continue
        shapes = dict(zip((c for c, _ in spec.components), component_shapes(spec, entry.shape, ref), strict=True))
        for t in matrix(hf, entry.format, parts, {**shapes, "dtype": spec.components[0][1]}):
            yield entry.file, t


def check_plain(manifest: Manifest, model_dir: Path) -> None:
    """The tensors the engines load unquantized (lm_head, norms, routers) must be stored plain: a head converted with
    --head fp8 is refused, since the checkpoint lists lm_head in `ignore`."""
    a = manifest.args
    for rule, prefix, block, _, _ in name_map(a).placed(a, True):
        ref = rule.names(prefix, block)[1]
        entry = manifest.tensors.get(ref)
        if rule.kind == PLAIN and entry is not None and get_format(entry.format).scale is not None:
            raise FormatError(
                f"{model_dir}: {ref} is stored as {entry.format} (convert --head fp8); vLLM and SGLang load it "
                f"unquantized: convert with --head bf16 to export"
            )


def matrices(manifest: Manifest) -> list[Module]:
    """Every matrix of the export, with its stored format (routed experts included)."""
    a, out = manifest.args, []
    for rule, prefix, block, expert, _ in name_map(a).placed(a, True):
        if rule.kind == PLAIN:
            continue
        hf, ref = rule.names(prefix, block, expert)
        if expert is not None:
            if block in manifest.experts:
                out.append(Module(hf, manifest.record.format))
            continue
        entry = manifest.tensors.get(ref)
        if entry is not None:
            out.append(Module(hf, entry.format))
    return out


def expert_tensors(
    manifest: Manifest, layer: int, record: Callable[[int], dict[str, torch.Tensor]], matrix: Matrix = _matrix
) -> list[OutTensor]:
    """The routed experts of one MoE layer, each matrix as `matrix` writes it; record(e) -> the unpacked parts of
    expert e's record (gate and up are the first and second half of its w13 rows)."""
    a, layout = manifest.args, manifest.record
    i = layout.inter_dim
    rows = {"w1": slice(0, i), "w3": slice(i, 2 * i), "w2": slice(None)}
    out = []
    for rule, prefix, block, e, _ in name_map(a).placed(a, True):
        if block != layer or e is None:
            continue
        module, ref = rule.names(prefix, block, e)
        proj = ref.rsplit(".", 1)[-1]
        part, sl = ("w2" if proj == "w2" else "w13"), rows[proj]
        p, s = layout.part(part), layout.part(part + "_scale")
        n = p.shape[0] if proj == "w2" else i
        shapes = {"weight": (n, p.shape[1]), "scale": (n, s.shape[1]), "dtype": p.dtype}
        parts = {
            "weight": lambda e=e, part=part, sl=sl: record(e)[part][sl],
            "scale": lambda e=e, part=part, sl=sl: record(e)[part + "_scale"][sl],
        }
        if layout.format == "nvfp4":
            k = {"w1": 0, "w3": 1, "w2": 2}[proj]
            parts["scale_2"] = lambda e=e, k=k: _global(record(e), k, layer, e)
        out += matrix(module, layout.format, parts, shapes)
    return out


def _global(parts: dict[str, torch.Tensor], k: int, layer: int, e: int) -> torch.Tensor:
    g = parts["scale_2"]
    if k < 2 and g[0] != g[1]:
        raise FormatError(
            f"layer {layer} expert {e}: gate and up have different NVFP4 global scales ({float(g[0])} and "
            f"{float(g[1])}); engines fuse them under one: convert the model again with this dsfp4"
        )
    return g[k]
