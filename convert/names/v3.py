"""DeepSeek-V3 (and V2-Lite) checkpoint names -> dsfp4 names, as data (checkpoint-spec). dsfp4 names follow
DeepSeek's reference inference/model.py (embed, attn.wq_a, ffn.w1, ...). Matrices are found in whichever storage
the source uses: FP8 with weight_scale_inv (DeepSeek), NVFP4 with weight_scale/_2 (NVIDIA ModelOpt), or plain BF16."""

from __future__ import annotations

import re
from collections.abc import Iterator

from dsfp4.convert.names.rules import AUX, EXPERT, LINEAR, PLAIN, PLAIN_STORAGE, NameMap, Placed, Rule, SourceStorage
from dsfp4.layout.model_args import ModelArgs


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


V3_NAMES = NameMap(
    _placed_rules,
    V3_STORAGE,
    lambda n, extra: tuple(f"model.layers.{b}." for b in range(n, n + extra)),
    SKIP_PATTERNS,
)
