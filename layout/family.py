"""The model families, as data: config.json's model_type names one, and its entry here holds what the on-disk
contract knows of it: its name in messages, the FP4 format its conversion stores routed experts in, the rules its
config must keep beyond the router's (ModelArgs checks them), and the bytes its model holds beside the weights (its
caches, RoPE tables and one forward's transient tensors, which the planner budgets: runtime/plan/planner.py).

A family's name map and config reader are convert's (convert/family.py), its model class and what its runs may do
the runtime's (runtime/models/families.py): a new family is an entry in each of the three tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsfp4.layout.model_args import ModelArgs

V2_FAMILY, V3_FAMILY, V4_FAMILY = "deepseek_v2", "deepseek_v3", "deepseek_v4"
# V4 attention kinds: a sliding window only, compressed sparse attention (CSA: overlapping windows and the
# lightning indexer), heavily compressed attention (HCA: every compressed entry)
SLIDING, CSA, HCA = "sliding", "csa", "hca"
FP32 = 4


def _no_expansion(a: ModelArgs) -> float:
    return 0.0


@dataclass(frozen=True)
class Family:
    """What the contract knows of one family. layer_cache: (args, layer, context, element size) -> (bytes that grow
    with the context, fixed bytes) of one layer's caches for one sequence; activations: (args, tokens, context,
    element size, attention scores held at once, FP8 attention) -> bytes of one forward's transient tensors (an upper
    estimate)."""

    title: str
    expert_format: str
    problems: Callable[[ModelArgs], list[str]]
    layer_cache: Callable[[ModelArgs, int, int, int], tuple[int, int]]
    # [context, rope_dim / 2] complex64 tables its model builds, one per RoPE base
    rope_tables: int
    activations: Callable[[ModelArgs, int, int, int, int, bool], int]
    # (args, position) -> FLOPs of a prompt token's attention scores and values there, over the main layers
    attention_flops: Callable[[ModelArgs, int], float]
    # its model can keep a layer's caches in pinned RAM, read in place (MLA's latent cache: a row per position)
    caches_in_ram: bool = False
    # (args, context, element size, scores held at once, kernels, FP8 attention) -> (fixed bytes, bytes a token) of a
    # layer-wise pass's attention half over many tokens of one sequence at once; None: its attention takes a chunk at
    # a time
    attention_bytes: Callable[[ModelArgs, int, int, int, bool, bool], tuple[int, int]] | None = None
    # (args) -> FLOPs of bringing one cached position's keys and values to the form prefill attends in, over the main
    # layers: paid per attention call for every position it reads (MLA's latent rows through wkv_b; 0: none)
    key_expansion_flops: Callable[[ModelArgs], float] = _no_expansion
    # its prefill attention has the FP8 variant (run --fp8-attention: MLA's decompressed form, kernels/mla/prefill.py)
    fp8_attention: bool = False


def _no_problems(a: ModelArgs) -> list[str]:
    return []


def _v4_problems(a: ModelArgs) -> list[str]:
    """V4's schedule of layer kinds, grouped output, hash layers and RoPE width, and the floats it needs above 0
    (other families leave them at 0)."""
    problems = [
        f"{k} must be above 0, got {v}"
        for k, v in (("compress_rope_theta", a.compress_rope_theta), ("hc_eps", a.hc_eps))
        if not v > 0
    ]
    if len(a.layer_kinds) != a.n_blocks or len(a.compress_ratios) != a.n_blocks:
        problems.append(
            f"compress_ratios / layer_types give {len(a.layer_kinds)} layer kinds; "
            f"{a.n_layers} layers + {a.n_mtp_layers} MTP need {a.n_blocks}"
        )
    elif bad := [i for i, k in enumerate(a.layer_kinds) if (k == SLIDING) != (a.compress_ratios[i] == 0)]:
        i = bad[0]
        problems.append(f"layer {i}: kind {a.layer_kinds[i]} with compress ratio {a.compress_ratios[i]}")
    if a.o_groups < 1 or a.n_heads % a.o_groups:
        problems.append(f"num_attention_heads ({a.n_heads}) is not a multiple of o_groups ({a.o_groups})")
    if a.n_hash_layers > a.n_layers:
        problems.append(f"num_hash_layers ({a.n_hash_layers}) exceeds num_hidden_layers ({a.n_layers})")
    rope = a.qk_rope_head_dim
    if rope > min(a.head_dim, a.index_head_dim) or rope % 2:
        problems.append(f"qk_rope_head_dim ({rope}) must be even and fit head_dim and index_head_dim")
    return problems


def _latent_cache(a: ModelArgs, layer: int, max_context: int, elt: int) -> tuple[int, int]:
    """MLA: the latent cache and its RoPE part, a row per position."""
    return max_context * (a.kv_lora_rank + a.qk_rope_head_dim) * elt, 0


def _v4_cache(a: ModelArgs, layer: int, max_context: int, elt: int) -> tuple[int, int]:
    """The sliding window's ring of window_size keys; on CSA and HCA layers max_context // m compressed entries and
    the compressor's fp32 state (rings of the recent projections' values and gates: own series [m, W], CSA's first
    halves [2m, W]); on CSA layers the indexer's entries and state too (an overlapping compressor at index_head_dim)."""
    m, csa = a.compress_ratios[layer], a.layer_kinds[layer] == CSA
    compressors = ([(a.head_dim, csa)] if m else []) + ([(a.index_head_dim, True)] if csa else [])
    grows, fixed = 0, a.window_size * a.head_dim * elt
    for width, overlap in compressors:
        grows += max_context // m * width * elt
        # values and gates: pending [m, c W], CSA prev [m, W]
        fixed += 2 * m * width * (3 if overlap else 1) * FP32
    return grows, fixed


def _mla_activations(a: ModelArgs, t: int, max_context: int, elt: int, scores: int, fp8: bool = False) -> int:
    """The residual stream and its temporaries, absorbed queries, expert hidden states, two copies of a chunk's
    scores; and a prefill's dense wkv_b with, in the decompressed form (kernels/mla/prefill.py), a key block (k_nope and
    v of at most `scores` elements, k_pe) and the chunk's outputs (fp32 with their log-sum-exp, then in elt); fp8: the
    e4m3 copies its FP8 variant rounds (_mla_fp8_query)."""
    h = a.n_heads
    acts = t * elt * (12 * a.dim + 3 * h * (a.kv_lora_rank + a.qk_rope_head_dim) + 6 * a.moe_inter_dim)
    acts += 2 * min(scores, t * h * max_context) * FP32
    outputs = t * h * ((a.v_head_dim + 1) * FP32 + a.v_head_dim * elt)
    return acts + _mla_prefill_fixed(a, max_context, elt, scores, fp8) + outputs + t * _mla_fp8_query(a, fp8)


def _mla_prefill_fixed(a: ModelArgs, max_context: int, elt: int, scores: int, fp8: bool = False) -> int:
    """A decompressed prefill's bytes whatever its tokens: the dense wkv_b and one key block (k_nope and v of every
    head, of at most `scores` elements, and its k_pe); fp8: the block's e4m3 copy beside it, with k_nope's scale a
    key and head and v's a head and channel."""
    h, kv_width = a.n_heads, a.qk_nope_head_dim + a.v_head_dim
    rows = min(max_context, max(1, scores // (h * kv_width)))
    fixed = h * kv_width * a.kv_lora_rank * elt + rows * (h * kv_width + a.qk_rope_head_dim) * elt
    return fixed + (rows * h * (kv_width + FP32) + h * a.v_head_dim * FP32 if fp8 else 0)


def _mla_fp8_query(a: ModelArgs, fp8: bool) -> int:
    """A token's bytes of the FP8 variant's e4m3 q_nope and its scale a head (0 without it)."""
    return a.n_heads * (a.qk_nope_head_dim + FP32) if fp8 else 0


def _mla_attention_bytes(
    a: ModelArgs, max_context: int, elt: int, scores: int, kernels: bool, fp8: bool = False
) -> tuple[int, int]:
    """The decompressed attention half of many tokens (kernels/mla/prefill.py): fixed, _mla_prefill_fixed and, for
    the torch formula, two copies of a block's scores; a token, its input, norm, query path, latent row, fp32 output
    with its log-sum-exp, the output rounded, its projection and the residual sum (fp8: and its e4m3 query)."""
    h = a.n_heads
    fixed = _mla_prefill_fixed(a, max_context, elt, scores, fp8) + (0 if kernels else 2 * scores * FP32)
    token = elt * (5 * a.dim + 2 * a.q_lora_rank + h * a.qk_head_dim + a.kv_lora_rank + a.qk_rope_head_dim)
    token += h * ((a.v_head_dim + 1) * FP32 + a.v_head_dim * elt) + _mla_fp8_query(a, fp8)
    return fixed, token


def _mla_key_expansion_flops(a: ModelArgs) -> float:
    """A latent row through wkv_b into every head's k_nope and v, in each main layer."""
    return 2.0 * a.n_layers * a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)


def _v4_activations(a: ModelArgs, t: int, max_context: int, elt: int, scores: int, fp8: bool = False) -> int:
    """The mHC streams and their fp32 mixing, queries and outputs of every head, the compressors' fp32 projections
    and window slots, the keys (window and every compressed entry) with their fp32 copy and masks, three copies of a
    chunk's scores (masked, with the sink, softmax), the indexer's fp32 scores of every head and entry (fp8: never
    set, its attention has no FP8 variant)."""
    ratios = [m for m in a.compress_ratios if m]
    # the most a layer attends besides its window
    entries = max_context // min(ratios) if ratios else 0
    keys = a.window_size + t + entries
    acts = t * a.hc_mult * a.dim * (4 * FP32 + 2 * elt)  # [T, N, D] streams
    # queries and outputs [T, H, W]
    acts += t * a.n_heads * a.head_dim * (4 * elt + 2 * FP32)
    # indexer queries, fp32 x
    acts += t * a.index_n_heads * a.index_head_dim * (2 * elt + FP32) + t * a.dim * FP32
    # compressor, expert hidden states
    acts += 8 * t * 2 * a.head_dim * FP32 + 6 * t * a.moe_inter_dim * elt
    # keys [S, W], masks [T, S]
    acts += keys * a.head_dim * (elt + 2 * FP32) + 3 * t * keys
    acts += 3 * min(scores, t * a.n_heads * keys) * FP32
    csa = [m for m, k in zip(a.compress_ratios, a.layer_kinds, strict=True) if k == CSA]
    if csa:  # [T, H_i, E] relu'd scores and [T, E] index, masked
        n = max_context // min(csa)
        acts += 2 * t * a.index_n_heads * n * FP32 + 2 * t * n * FP32
    return acts


def _mla_attention_flops(a: ModelArgs, position: int) -> float:
    """Every head's scores and values against the keys up to `position`, in prefill's decompressed form: a query-key
    dot of qk_head_dim and a value row of v_head_dim per head and key."""
    return 2.0 * a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim) * (position + 1)


def _v4_attention_flops(a: ModelArgs, position: int) -> float:
    """Each layer's heads against its window and the compressed entries it reads (CSA: the indexer's top index_topk
    of them, the indexer's heads scoring every entry; HCA: every entry), a dot and a value row of head_dim a key."""
    flops = 0.0
    for m, kind in zip(a.compress_ratios[: a.n_layers], a.layer_kinds[: a.n_layers], strict=True):
        entries = (position + 1) // m if m else 0
        keys = min(position + 1, a.window_size) + (min(entries, a.index_topk) if kind == CSA else entries)
        flops += 4.0 * a.n_heads * a.head_dim * keys
        if kind == CSA:
            flops += 2.0 * a.index_n_heads * a.index_head_dim * entries
    return flops


# V2's caches and rules are V3's: MLA, and a router whose differences are config data
_MLA = dict(
    problems=_no_problems,
    layer_cache=_latent_cache,
    rope_tables=1,
    activations=_mla_activations,
    attention_flops=_mla_attention_flops,
    caches_in_ram=True,
    attention_bytes=_mla_attention_bytes,
    key_expansion_flops=_mla_key_expansion_flops,
    fp8_attention=True,
)
FAMILIES: dict[str, Family] = {
    V3_FAMILY: Family("DeepSeek-V3", "nvfp4", **_MLA),
    V2_FAMILY: Family("DeepSeek-V2", "nvfp4", **_MLA),
    # one RoPE table per base: the sliding layers' and the compressed layers' (YaRN)
    V4_FAMILY: Family("DeepSeek-V4", "mxfp4", _v4_problems, _v4_cache, 2, _v4_activations, _v4_attention_flops),
}


def family_of(name: str) -> Family:
    """The family config.json's model_type names; V3's for a name it does not know (the config reader refuses
    those: convert/source/hf_config.py)."""
    return FAMILIES.get(name, FAMILIES[V3_FAMILY])
