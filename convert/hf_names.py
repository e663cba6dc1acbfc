"""Hugging Face DeepSeek tensor names -> dsfp4 names, as data, with a completeness check.

dsfp4 names follow DeepSeek's reference inference/model.py (embed, attn.wq_a, ffn.w1, ...). Every source
tensor must be consumed exactly once or skipped for a stated reason; a missing, unexpected, misshapen or
oddly typed tensor is a SourceError naming it. Matrices are found in whichever storage the source uses:
FP8 with weight_scale_inv (DeepSeek), NVFP4 with weight_scale/_2 (NVIDIA ModelOpt), or plain BF16.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dsfp4.config import V4_FAMILY, ModelArgs
from dsfp4.errors import FormatError, SourceError
from dsfp4.layout.formats import FORMATS, component_shapes, shape_numel
from dsfp4.layout.safetensors_file import TensorInfo

LINEAR = "linear"  # matrix DeepSeek's release stores in FP8: goes to the backbone format
AUX = "aux"  # matrix kept in the form the source stores it (MTP eh_proj)
PLAIN = "plain"  # norms, router, bias, embedding, head: kept as stored
EXPERT = "expert"  # routed expert projection: goes into the layer's expert records

Shape = Callable[[Any], tuple[int, ...]]  # of the ModelArgs, or of a placed rule's shape context


def _always(a: ModelArgs) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """hf: source name under the prefix (a module path for matrices); ref: dsfp4 name under the prefix."""

    hf: str
    ref: str
    kind: str
    shape: Shape
    when: Callable[[ModelArgs], bool] = _always


def _q_lora(a: ModelArgs) -> bool:
    return a.q_lora_rank > 0


TOP_RULES = (
    Rule("model.embed_tokens.weight", "embed.weight", PLAIN, lambda a: (a.vocab_size, a.dim)),
    Rule("model.norm.weight", "norm.weight", PLAIN, lambda a: (a.dim,)),
    Rule("lm_head.weight", "head.weight", PLAIN, lambda a: (a.vocab_size, a.dim), lambda a: not a.tie_word_embeddings),
)
ATTN_RULES = (
    Rule("input_layernorm.weight", "attn_norm.weight", PLAIN, lambda a: (a.dim,)),
    Rule("post_attention_layernorm.weight", "ffn_norm.weight", PLAIN, lambda a: (a.dim,)),
    Rule("self_attn.q_a_proj", "attn.wq_a", LINEAR, lambda a: (a.q_lora_rank, a.dim), _q_lora),
    Rule("self_attn.q_a_layernorm.weight", "attn.q_norm.weight", PLAIN, lambda a: (a.q_lora_rank,), _q_lora),
    Rule("self_attn.q_b_proj", "attn.wq_b", LINEAR, lambda a: (a.n_heads * a.qk_head_dim, a.q_lora_rank), _q_lora),
    Rule(
        "self_attn.q_proj",
        "attn.wq",
        LINEAR,
        lambda a: (a.n_heads * a.qk_head_dim, a.dim),
        lambda a: a.q_lora_rank == 0,
    ),
    Rule("self_attn.kv_a_proj_with_mqa", "attn.wkv_a", LINEAR, lambda a: (a.kv_lora_rank + a.qk_rope_head_dim, a.dim)),
    Rule("self_attn.kv_a_layernorm.weight", "attn.kv_norm.weight", PLAIN, lambda a: (a.kv_lora_rank,)),
    Rule(
        "self_attn.kv_b_proj",
        "attn.wkv_b",
        LINEAR,
        lambda a: (a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
    ),
    Rule("self_attn.o_proj", "attn.wo", LINEAR, lambda a: (a.dim, a.n_heads * a.v_head_dim)),
)
DENSE_RULES = (
    Rule("mlp.gate_proj", "ffn.w1", LINEAR, lambda a: (a.inter_dim, a.dim)),
    Rule("mlp.up_proj", "ffn.w3", LINEAR, lambda a: (a.inter_dim, a.dim)),
    Rule("mlp.down_proj", "ffn.w2", LINEAR, lambda a: (a.dim, a.inter_dim)),
)


def _shared(a: ModelArgs) -> bool:
    return a.n_shared_experts > 0


MOE_RULES = (
    Rule("mlp.gate.weight", "ffn.gate.weight", PLAIN, lambda a: (a.n_routed_experts, a.dim)),
    Rule(
        "mlp.gate.e_score_correction_bias",
        "ffn.gate.bias",
        PLAIN,
        lambda a: (a.n_routed_experts,),
        lambda a: a.has_gate_bias,
    ),
    Rule(
        "mlp.shared_experts.gate_proj",
        "ffn.shared_experts.w1",
        LINEAR,
        lambda a: (a.n_shared_experts * a.moe_inter_dim, a.dim),
        _shared,
    ),
    Rule(
        "mlp.shared_experts.up_proj",
        "ffn.shared_experts.w3",
        LINEAR,
        lambda a: (a.n_shared_experts * a.moe_inter_dim, a.dim),
        _shared,
    ),
    Rule(
        "mlp.shared_experts.down_proj",
        "ffn.shared_experts.w2",
        LINEAR,
        lambda a: (a.dim, a.n_shared_experts * a.moe_inter_dim),
        _shared,
    ),
)
# {e} is the expert index; the ref name's last component is the projection (w1 gate, w3 up, w2 down).
EXPERT_RULES = (
    Rule("mlp.experts.{e}.gate_proj", "ffn.experts.{e}.w1", EXPERT, lambda a: (a.moe_inter_dim, a.dim)),
    Rule("mlp.experts.{e}.up_proj", "ffn.experts.{e}.w3", EXPERT, lambda a: (a.moe_inter_dim, a.dim)),
    Rule("mlp.experts.{e}.down_proj", "ffn.experts.{e}.w2", EXPERT, lambda a: (a.dim, a.moe_inter_dim)),
)
# The MTP module's own pieces, beside its full decoder block (checkpoint-spec c.9).
MTP_RULES = (
    Rule("embed_tokens.weight", "embed.weight", PLAIN, lambda a: (a.vocab_size, a.dim)),
    Rule("enorm.weight", "enorm.weight", PLAIN, lambda a: (a.dim,)),
    Rule("hnorm.weight", "hnorm.weight", PLAIN, lambda a: (a.dim,)),
    Rule("eh_proj", "eh_proj", AUX, lambda a: (a.dim, 2 * a.dim)),
    Rule("shared_head.norm.weight", "head_norm.weight", PLAIN, lambda a: (a.dim,)),
    Rule("shared_head.head.weight", "head.weight", PLAIN, lambda a: (a.vocab_size, a.dim)),
)
SKIP_PATTERNS = (
    (
        re.compile(r"model\.layers\.\d+\.self_attn\.[kv]_proj\.[kv]_scale"),
        "FP8 KV-cache scale of an NVFP4 export (the MLA latent cache stays BF16)",
    ),
)
INPUT_SCALE_REASON = "static activation scale of an NVFP4 export (activations stay BF16)"
NO_MTP_REASON = "MTP layer left out by --no-mtp"


@dataclass(frozen=True)
class SourceStorage:
    """How a family's checkpoint stores weights. matrices: format -> component -> (name suffix after the
    module path, safetensors dtype), the first listed with a matching weight dtype wins where several share a
    scale suffix; plain: safetensors dtype -> plain format."""

    matrices: dict[str, dict[str, tuple[str, str]]]
    plain: dict[str, str]

    def matrix_format(self, hf: str, tensors: dict[str, TensorInfo]) -> str | None:
        """The format a matrix at module path `hf` is stored in (None: no scale tensor, a plain matrix)."""
        found = [f for f, comps in self.matrices.items() if f"{hf}.{comps['scale'][0]}" in tensors]
        weight = tensors.get(f"{hf}.weight")
        typed = [f for f in found if weight is not None and self.matrices[f]["weight"][1] == weight.dtype]
        return (typed or found or [None])[0]


PLAIN_STORAGE = {"BF16": "bf16", "F16": "f16", "F32": "f32"}
V3_STORAGE = SourceStorage(
    {
        "fp8_e4m3_b128": {"weight": ("weight", "F8_E4M3"), "scale": ("weight_scale_inv", "F32")},
        "nvfp4": {
            "weight": ("weight", "U8"),
            "scale": ("weight_scale", "F8_E4M3"),
            "scale_2": ("weight_scale_2", "F32"),
        },
    },
    PLAIN_STORAGE,
)


@dataclass(frozen=True)
class MappedTensor:
    """One dsfp4 weight and the source tensors it is made of (components as in FORMATS[storage])."""

    ref: str
    kind: str
    part: str
    shape: tuple[int, ...]
    storage: str
    sources: dict[str, str]
    expert: int | None = None


@dataclass(frozen=True)
class TensorMap:
    items: tuple[MappedTensor, ...]
    skipped: dict[str, str]


def part_name(block: int | None) -> str:
    return "top" if block is None else f"layer-{block:03d}"


class _Mapper:
    def __init__(
        self,
        args: ModelArgs,
        tensors: dict[str, TensorInfo],
        where: dict[str, str],
        index: str,
        storage: SourceStorage = V3_STORAGE,
    ):
        self.args, self.tensors, self.where, self.index, self.storage = args, tensors, where, index, storage
        self.consumed: set[str] = set()
        self.skipped: dict[str, str] = {}
        self.items: list[MappedTensor] = []

    def take(self, name: str, dtype: str, shape: tuple[int, ...], why: str) -> None:
        if name not in self.tensors:
            raise SourceError(f"tensor {name} is missing from {self.index} ({why})")
        if name in self.consumed:
            raise SourceError(f"tensor {name} would be consumed twice; the name map is inconsistent")
        info = self.tensors[name]
        if info.dtype != dtype:
            raise SourceError(f"tensor {name} in {self.where[name]} has dtype {info.dtype}, expected {dtype}")
        same = info.shape == shape or (shape == () and shape_numel(info.shape) == 1)
        if not same:
            raise SourceError(
                f"tensor {name} in {self.where[name]} has shape {list(info.shape)}; config.json implies {list(shape)}"
            )
        self.consumed.add(name)

    def add(self, rule: Rule, prefix: str, block: int | None, expert: int | None = None, ctx: object = None) -> None:
        """ctx: what the rule's shape reads (default: the ModelArgs; V4 passes the layer's geometry)."""
        plain = self.storage.plain
        hf = prefix + rule.hf.format(e=expert)
        ref = ("" if block is None else f"layers.{block}.") + rule.ref.format(e=expert)
        shape = rule.shape(self.args if ctx is None else ctx)
        why = "config.json implies it"
        if rule.kind == PLAIN:
            info = self.tensors.get(hf)
            storage = plain.get(info.dtype) if info else "bf16"
            if storage is None:
                raise SourceError(
                    f"tensor {hf} in {self.where[hf]} has dtype {info.dtype}, expected one of {', '.join(plain)}"
                )
            self.take(hf, info.dtype if info else "BF16", shape, why)
            sources = {"weight": hf}
        else:
            storage = self.storage.matrix_format(hf, self.tensors)
            if storage is None:
                info = self.tensors.get(f"{hf}.weight")
                storage = plain.get(info.dtype, "bf16") if info else "bf16"
                if info and info.dtype not in plain:
                    scale = next(iter(self.storage.matrices.values()))["scale"][0]
                    raise SourceError(
                        f"tensor {hf}.weight in {self.where[hf + '.weight']} has dtype "
                        f"{info.dtype} but no scale tensor; expected {', '.join(plain)}, or FP8 "
                        f"with {hf}.{scale}"
                    )
            spec = FORMATS[storage]
            try:
                shapes = component_shapes(spec, shape, hf)
            except FormatError as e:
                raise SourceError(str(e)) from e
            stored = self.storage.matrices.get(storage, {"weight": ("weight", spec.components[0][1])})
            sources = {}
            for (comp, _), comp_shape in zip(spec.components, shapes, strict=True):
                suffix, dtype = stored[comp]
                sources[comp] = f"{hf}.{suffix}"
                self.take(sources[comp], dtype, comp_shape, why)
            if storage == "nvfp4" and f"{hf}.input_scale" in self.tensors:
                self.skip(f"{hf}.input_scale", INPUT_SCALE_REASON)
        self.items.append(MappedTensor(ref, rule.kind, part_name(block), shape, storage, sources, expert))

    def skip(self, name: str, reason: str) -> None:
        self.skipped[name] = reason
        self.consumed.add(name)


Placed = tuple[Rule, str, "int | None", "int | None", object]  # rule, source prefix, block, expert, shape context


def _placed_rules(args: ModelArgs, include_mtp: bool = True) -> Iterator[Placed]:
    """Every rule that applies to this model, with its name prefix, block, expert and shape context."""
    yield from ((r, "", None, None, args) for r in TOP_RULES if r.when(args))
    for block in range(args.n_blocks if include_mtp else args.n_layers):
        prefix = f"model.layers.{block}."
        rules = ATTN_RULES + (MOE_RULES if args.is_moe_layer(block) else DENSE_RULES)
        rules += MTP_RULES if block >= args.n_layers else ()
        yield from ((r, prefix, block, None, args) for r in rules if r.when(args))
        if args.is_moe_layer(block):
            yield from ((r, prefix, block, e, args) for e in range(args.n_routed_experts) for r in EXPERT_RULES)


@dataclass(frozen=True)
class NameMap:
    """One family's checkpoint names: its rules placed for a model, how it stores weights, the name prefixes
    of its MTP blocks, and the tensors it skips on purpose (pattern, reason)."""

    placed: Callable[[ModelArgs, bool], Iterator[Placed]]
    storage: SourceStorage
    mtp_prefixes: Callable[[int, int], tuple[str, ...]]  # (n_layers, n_mtp_layers) -> source name prefixes
    skips: tuple[tuple[re.Pattern, str], ...] = ()


V3_NAMES = NameMap(
    _placed_rules,
    V3_STORAGE,
    lambda n, extra: tuple(f"model.layers.{b}." for b in range(n, n + extra)),
    SKIP_PATTERNS,
)


def name_map(args: ModelArgs | str | None) -> NameMap:
    """The name map of the model's family (ModelArgs.family: config.json's model_type; V3's when unknown)."""
    if (args.family if isinstance(args, ModelArgs) else args) == V4_FAMILY:
        from dsfp4.convert.v4_names import V4_NAMES  # it builds on this module's rules and mapper

        return V4_NAMES
    return V3_NAMES


def source_names(args: ModelArgs) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name (matrices: their weight) -> (logical shape, rule kind) of every tensor a checkpoint of this shape
    holds, in the family's own naming."""
    names = {}
    for rule, prefix, _, expert, ctx in name_map(args).placed(args, True):
        name = prefix + rule.hf.format(e=expert)
        names[name if rule.kind == PLAIN else name + ".weight"] = (rule.shape(ctx), rule.kind)
    return names


def plain_checkpoint_names(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of an unquantized (BF16) Hugging Face checkpoint of this shape."""
    return {name: shape for name, (shape, _) in source_names(args).items()}


def map_tensors(
    args: ModelArgs, tensors: dict[str, TensorInfo], where: dict[str, str], index: str, include_mtp: bool = True
) -> TensorMap:
    """Map every source tensor (name -> header info; `where`: name -> shard) or raise SourceError."""
    names = name_map(args)
    m = _Mapper(args, tensors, where, index, names.storage)
    for rule, prefix, block, expert, ctx in names.placed(args, include_mtp):
        try:
            m.add(rule, prefix, block, expert, ctx)
        except SourceError as e:
            if block is not None and block >= args.n_layers:
                raise SourceError(f"{e}; to convert without the MTP layer pass --no-mtp") from e
            raise
    mtp_prefixes = names.mtp_prefixes(args.n_layers, args.n_mtp_layers)
    for name in tensors:
        if name in m.consumed:
            continue
        if not include_mtp and name.startswith(mtp_prefixes):
            m.skip(name, NO_MTP_REASON)
        elif reason := next((r for p, r in names.skips if p.fullmatch(name)), None):
            m.skip(name, reason)
    unexpected = sorted(set(tensors) - m.consumed)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise SourceError(
            f"unexpected tensor {unexpected[0]} in {where[unexpected[0]]}{more}: config.json "
            f"({args.family}, {args.n_layers} layers + {args.n_mtp_layers} MTP, "
            f"{args.n_routed_experts} experts) has no place for it"
        )
    return TensorMap(tuple(m.items), m.skipped)
