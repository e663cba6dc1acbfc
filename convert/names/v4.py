"""DeepSeek-V4 checkpoint names -> dsfp4 names, as data (v4-flash-spec b.1-b.3).

V4 checkpoints use DeepSeek's reference names already (`layers.N.attn.wq_a.weight`, no `model.` prefix), so
a dsfp4 name is the checkpoint's own, with the module path of a matrix and the MTP block `mtp.i.` renamed
`layers.{n_layers + i}.` as for V3. Matrices carry a `.scale` companion: FP8 e4m3 weights with E8M0 128x128
block scales (the backbone), e2m1 codes with E8M0 1x32 scales (routed experts). The completeness check is
the vocabulary of names/rules.py: every tensor is consumed once or skipped for a stated reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dsfp4.convert.names.rules import AUX, EXPERT, LINEAR, PLAIN, NameMap, Placed, Rule, SourceStorage
from dsfp4.layout.family import CSA, SLIDING
from dsfp4.layout.model_args import ModelArgs


@dataclass(frozen=True)
class Geometry:
    """What a block's tensor shapes depend on: the model, the block's compress ratio m, and c = 2 for CSA
    (two overlapping series per token), 1 for HCA."""

    a: ModelArgs
    m: int = 0
    c: int = 1

    @property
    def hc(self) -> int:
        """Rows of an mHC projection: pre (n), post (n) and the n x n combination."""
        return (2 + self.a.hc_mult) * self.a.hc_mult


V4_STORAGE = SourceStorage(
    {
        "mxfp4": {"weight": ("weight", "I8"), "scale": ("scale", "F8_E8M0")},
        "fp8_e4m3_e8m0_b128": {"weight": ("weight", "F8_E4M3"), "scale": ("scale", "F8_E8M0")},
    },
    {"BF16": "bf16", "F32": "f32", "I64": "i64"},
)

# the mHC head that collapses the streams before the final norm; the main model's and each MTP block's
HC_HEAD_RULES = (
    Rule("hc_head_fn", "hc_head_fn", PLAIN, lambda g: (g.a.hc_mult, g.a.hc_mult * g.a.dim)),
    Rule("hc_head_base", "hc_head_base", PLAIN, lambda g: (g.a.hc_mult,)),
    Rule("hc_head_scale", "hc_head_scale", PLAIN, lambda g: (1,)),
)
TOP_RULES = (
    Rule("embed.weight", "embed.weight", PLAIN, lambda g: (g.a.vocab_size, g.a.dim)),
    Rule("head.weight", "head.weight", PLAIN, lambda g: (g.a.vocab_size, g.a.dim)),
    Rule("norm.weight", "norm.weight", PLAIN, lambda g: (g.a.dim,)),
    *HC_HEAD_RULES,
)
BLOCK_RULES = tuple(
    Rule(f"hc_{site}_{part}", f"hc_{site}_{part}", PLAIN, shape)
    for site in ("attn", "ffn")
    for part, shape in (
        ("fn", lambda g: (g.hc, g.a.hc_mult * g.a.dim)),
        ("base", lambda g: (g.hc,)),
        ("scale", lambda g: (3,)),
    )
) + (
    Rule("attn_norm.weight", "attn_norm.weight", PLAIN, lambda g: (g.a.dim,)),
    Rule("ffn_norm.weight", "ffn_norm.weight", PLAIN, lambda g: (g.a.dim,)),
    Rule("attn.wq_a", "attn.wq_a", LINEAR, lambda g: (g.a.q_lora_rank, g.a.dim)),
    Rule("attn.q_norm.weight", "attn.q_norm.weight", PLAIN, lambda g: (g.a.q_lora_rank,)),
    Rule("attn.wq_b", "attn.wq_b", LINEAR, lambda g: (g.a.n_heads * g.a.head_dim, g.a.q_lora_rank)),
    Rule("attn.wkv", "attn.wkv", LINEAR, lambda g: (g.a.head_dim, g.a.dim)),
    Rule("attn.kv_norm.weight", "attn.kv_norm.weight", PLAIN, lambda g: (g.a.head_dim,)),
    # grouped output: o_groups blocks of o_lora_rank rows, each reading its n_heads / o_groups heads
    Rule(
        "attn.wo_a",
        "attn.wo_a",
        LINEAR,
        lambda g: (g.a.o_groups * g.a.o_lora_rank, g.a.n_heads * g.a.head_dim // g.a.o_groups),
    ),
    Rule("attn.wo_b", "attn.wo_b", LINEAR, lambda g: (g.a.dim, g.a.o_groups * g.a.o_lora_rank)),
    Rule("attn.attn_sink", "attn.attn_sink", PLAIN, lambda g: (g.a.n_heads,)),
    Rule("ffn.gate.weight", "ffn.gate.weight", PLAIN, lambda g: (g.a.n_routed_experts, g.a.dim)),
    Rule(
        "ffn.shared_experts.w1",
        "ffn.shared_experts.w1",
        LINEAR,
        lambda g: (g.a.n_shared_experts * g.a.moe_inter_dim, g.a.dim),
    ),
    Rule(
        "ffn.shared_experts.w3",
        "ffn.shared_experts.w3",
        LINEAR,
        lambda g: (g.a.n_shared_experts * g.a.moe_inter_dim, g.a.dim),
    ),
    Rule(
        "ffn.shared_experts.w2",
        "ffn.shared_experts.w2",
        LINEAR,
        lambda g: (g.a.dim, g.a.n_shared_experts * g.a.moe_inter_dim),
    ),
)
HASH_RULES = (Rule("ffn.gate.tid2eid", "ffn.gate.tid2eid", PLAIN, lambda g: (g.a.vocab_size, g.a.n_activated_experts)),)
SCORE_RULES = (Rule("ffn.gate.bias", "ffn.gate.bias", PLAIN, lambda g: (g.a.n_routed_experts,)),)


def _compressor_rules(prefix: str, width: Callable[[Geometry], int]) -> tuple[Rule, ...]:
    """A compressor at `prefix`: c series of `width` per token, gated over windows of m tokens."""
    return (
        Rule(f"{prefix}.wkv", f"{prefix}.wkv", AUX, lambda g: (g.c * width(g), g.a.dim)),
        Rule(f"{prefix}.wgate", f"{prefix}.wgate", AUX, lambda g: (g.c * width(g), g.a.dim)),
        Rule(f"{prefix}.ape", f"{prefix}.ape", PLAIN, lambda g: (g.m, g.c * width(g))),
        Rule(f"{prefix}.norm.weight", f"{prefix}.norm.weight", PLAIN, lambda g: (width(g),)),
    )


COMPRESSOR_RULES = _compressor_rules("attn.compressor", lambda g: g.a.head_dim)
# the lightning indexer (CSA only): its own CSA compressor at index_head_dim, its queries from q_norm's output
INDEXER_RULES = _compressor_rules("attn.indexer.compressor", lambda g: g.a.index_head_dim) + (
    Rule(
        "attn.indexer.wq_b",
        "attn.indexer.wq_b",
        LINEAR,
        lambda g: (g.a.index_n_heads * g.a.index_head_dim, g.a.q_lora_rank),
    ),
    Rule("attn.indexer.weights_proj", "attn.indexer.weights_proj", AUX, lambda g: (g.a.index_n_heads, g.a.dim)),
)
# {e} is the expert index; w1 gate, w3 up, w2 down
EXPERT_RULES = (
    Rule("ffn.experts.{e}.w1", "ffn.experts.{e}.w1", EXPERT, lambda g: (g.a.moe_inter_dim, g.a.dim)),
    Rule("ffn.experts.{e}.w3", "ffn.experts.{e}.w3", EXPERT, lambda g: (g.a.moe_inter_dim, g.a.dim)),
    Rule("ffn.experts.{e}.w2", "ffn.experts.{e}.w2", EXPERT, lambda g: (g.a.dim, g.a.moe_inter_dim)),
)
# the MTP block's own pieces beside its decoder block; it shares embed and head with the main model
MTP_RULES = (
    Rule("e_proj", "e_proj", LINEAR, lambda g: (g.a.dim, g.a.dim)),
    Rule("h_proj", "h_proj", LINEAR, lambda g: (g.a.dim, g.a.dim)),
    Rule("enorm.weight", "enorm.weight", PLAIN, lambda g: (g.a.dim,)),
    Rule("hnorm.weight", "hnorm.weight", PLAIN, lambda g: (g.a.dim,)),
    Rule("norm.weight", "norm.weight", PLAIN, lambda g: (g.a.dim,)),
    *HC_HEAD_RULES,
)
# DeepSeek's own convert.py drops these if an MTP block carries them: the block shares the main model's
SKIP_PATTERNS = (
    (re.compile(r"mtp\.\d+\.(emb|embed|head)\.weight"), "copy of the main embedding or head in the MTP block"),
)


def _mtp_prefixes(n_layers: int, n_mtp: int) -> tuple[str, ...]:
    return tuple(f"mtp.{i}." for i in range(n_mtp))


def _placed_rules(a: ModelArgs, include_mtp: bool = True) -> Iterator[Placed]:
    top = Geometry(a)
    yield from ((r, "", None, None, top) for r in TOP_RULES)
    for block in range(a.n_blocks if include_mtp else a.n_layers):
        kind, m = a.layer_kinds[block], a.compress_ratios[block]
        g = Geometry(a, m, 2 if kind == CSA else 1)
        prefix = (
            f"layers.{block}." if block < a.n_layers else _mtp_prefixes(a.n_layers, a.n_mtp_layers)[block - a.n_layers]
        )
        rules = BLOCK_RULES + (HASH_RULES if a.is_hash_layer(block) else SCORE_RULES)
        rules += (COMPRESSOR_RULES if kind != SLIDING else ()) + (INDEXER_RULES if kind == CSA else ())
        rules += MTP_RULES if block >= a.n_layers else ()
        yield from ((r, prefix, block, None, g) for r in rules)
        yield from ((r, prefix, block, e, g) for e in range(a.n_routed_experts) for r in EXPERT_RULES)


V4_NAMES = NameMap(_placed_rules, V4_STORAGE, _mtp_prefixes, SKIP_PATTERNS)
