"""DeepSeek-V4's own config.json keys (v4-flash-spec a.1), the official ones or transformers' spellings of them, read
after the keys every family shares (hf_config.py): the schedule of layer kinds, the shared K=V head, the grouped
output, the compressors' RoPE base, the indexer, mHC and the hash layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsfp4.convert.source.config_value import config_value
from dsfp4.errors import ConfigError
from dsfp4.layout.family import CSA, HCA, SLIDING
from dsfp4.layout.model_args import ModelArgs

# transformers' layer_types names of the kinds, and the meaning of the official compress_ratios values
# (0 / 4 / 128, as both the reference and transformers read them)
HF_LAYER_KINDS = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}


def v4_rope_sets(rope: dict) -> tuple[dict, dict | None]:
    """(the YaRN set, the plain set or None): transformers' V4 config nests two, "main" (sliding layers) and
    "compress" (the YaRN one); the released config.json holds one set, and the plain base at the top level."""
    if isinstance(rope.get("compress"), dict):
        return rope["compress"], rope.get("main") or {}
    return rope, None


def _schedule(f: Callable[..., Any], n_blocks: int, source: str) -> tuple[tuple, tuple]:
    """(layer kinds, compress ratios) per block from the official compress_ratios (n_layers + MTP entries, the
    MTP ones last) or transformers' layer_types + compress_rates (main layers only: its MTP blocks are sliding,
    as the official schedule has them)."""
    ratios = f("compress_ratios", list, None)
    if ratios is not None:
        if len(ratios) < n_blocks or any(r not in RATIO_KINDS for r in ratios):
            raise ConfigError(
                f"{source}: compress_ratios must hold {n_blocks} entries (layers, then MTP) from "
                f"{sorted(RATIO_KINDS)}, got {ratios}"
            )
        ratios = tuple(ratios[:n_blocks])
        return tuple(RATIO_KINDS[r] for r in ratios), ratios
    types, rates = f("layer_types", list), f("compress_rates", dict)
    if any(t not in HF_LAYER_KINDS for t in types):
        raise ConfigError(f"{source}: layer_types entries must be one of {', '.join(HF_LAYER_KINDS)}")
    kinds = tuple(HF_LAYER_KINDS[t] for t in types) + (SLIDING,) * max(0, n_blocks - len(types))
    compressed = set(types) - {"sliding_attention"}
    kind_rate = {HF_LAYER_KINDS[t]: config_value(rates, t, int, source, minimum=1) for t in compressed}
    return kinds[:n_blocks], tuple(0 if k == SLIDING else kind_rate[k] for k in kinds[:n_blocks])


def v4_args(
    c: dict[str, Any], f: Callable[..., Any], common: dict[str, Any], rope: dict, main_rope: dict | None, source: str
) -> ModelArgs:
    """ModelArgs of the shared fields (`common`) and V4's own keys (`f` reads config.json's); `main_rope`: the plain
    RoPE set where the config nests two (v4_rope_sets), None where its keys are the top level's."""
    n_blocks = common["n_layers"] + common["n_mtp_layers"]
    kinds, ratios = _schedule(f, n_blocks, source)
    head_dim = f("head_dim", minimum=1)
    if (kv_heads := f("num_key_value_heads", default=1)) != 1:
        raise ConfigError(f"{source}: num_key_value_heads is {kv_heads}; DeepSeek-V4 has one shared K=V head")
    if f("partial_rotary_factor", float, None) is not None and "qk_rope_head_dim" not in c:
        rope_dim = round(head_dim * f("partial_rotary_factor", float))
    else:
        rope_dim = f("qk_rope_head_dim", minimum=2)
    layer_types = f("mlp_layer_types", list, None)
    # transformers: hash_moe first, then moe
    if layer_types is not None:
        n_hash = layer_types.count("hash_moe")
        if layer_types[:n_hash] != ["hash_moe"] * n_hash:
            raise ConfigError(f"{source}: mlp_layer_types must list every hash_moe layer first")
    else:
        n_hash = f("num_hash_layers")
    # transformers' nested "compress" set holds its base; the official config.json a top-level key
    nested = main_rope is not None
    compress_theta = config_value(rope, "rope_theta", float, source) if nested else f("compress_rope_theta", float)
    return ModelArgs(
        **common,
        # no dense MLP; the shared expert has the routed width
        inter_dim=common["moe_inter_dim"],
        n_dense_layers=0,
        moe_layer_freq=1,
        n_expert_groups=1,
        n_limited_groups=1,
        kv_lora_rank=0,
        qk_nope_head_dim=head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=head_dim,
        rope_theta=config_value(main_rope, "rope_theta", float, source) if nested else f("rope_theta", float),
        # V4 scales neither cos/sin nor the softmax under YaRN
        mscale=0.0,
        mscale_all_dim=0.0,
        head_dim=head_dim,
        window_size=f("sliding_window", minimum=1),
        o_groups=f("o_groups", minimum=1),
        o_lora_rank=f("o_lora_rank", minimum=1),
        layer_kinds=kinds,
        compress_ratios=ratios,
        compress_rope_theta=compress_theta,
        index_n_heads=f("index_n_heads", minimum=1),
        index_head_dim=f("index_head_dim", minimum=1),
        index_topk=f("index_topk", minimum=1),
        hc_mult=f("hc_mult", minimum=1),
        hc_sinkhorn_iters=f("hc_sinkhorn_iters", minimum=1),
        hc_eps=f("hc_eps", float),
        n_hash_layers=n_hash,
        swiglu_limit=f("swiglu_limit", float),
    )
