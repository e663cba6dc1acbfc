"""config.json -> ModelArgs: the only place Hugging Face key names (hidden_size, moe_intermediate_size, ...) are
read; the families' defaults and the spellings of transformers' configs included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsfp4.errors import ConfigError
from dsfp4.layout.model_args import CSA, HCA, SLIDING, V4_FAMILY, ModelArgs

# model_type -> defaults for keys that the family's config.json may leave out (transformers'
# DeepseekV3Config, for one, never writes scoring_func or topk_method: V3 always uses both).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy"},
    # topk_method is a legacy label in V4's config (neither the reference nor transformers reads it); V4 always
    # selects by score + bias outside the hash layers
    "deepseek_v4": {"topk_method": "noaux_tc"},
}
# transformers' layer_types names of the kinds, and the meaning of the official compress_ratios values
# (0 / 4 / 128, as both the reference and transformers read them)
HF_LAYER_KINDS = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}


_REQUIRED = object()
_KINDS = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "an object",
    list: "a list",
}


def _field(c: dict[str, Any], key: str, kind: type, source: str, default: Any = _REQUIRED, minimum: int = 0) -> Any:
    """One config value of the expected type (None means absent); errors name the file and the key."""
    v = c.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return default
    ok = isinstance(v, kind) and not (kind in (int, float) and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        raise ConfigError(f"{source}: {key} must be {_KINDS[kind]}, got {v!r}")
    if kind is int and v < minimum:
        raise ConfigError(f"{source}: {key} must be at least {minimum}, got {v}")
    return v


def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Build ModelArgs from a Hugging Face config.json dict; `source` names the file in errors."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    family = cfg.get("model_type")
    if family not in FAMILY_DEFAULTS:
        raise ConfigError(f"{source}: model_type {family!r} is not supported (supported: {', '.join(FAMILY_DEFAULTS)})")
    c = {**FAMILY_DEFAULTS[family], **{k: v for k, v in cfg.items() if v is not None}}

    def f(key: str, kind: type = int, default: Any = _REQUIRED, minimum: int = 0) -> Any:
        return _field(c, key, kind, source, default, minimum)

    # transformers 5 writes rope_parameters; the released checkpoints write rope_scaling (or nothing). V4's
    # transformers config nests two sets, "main" (sliding layers) and "compress" (the YaRN one).
    rope = f("rope_scaling", dict, None) or f("rope_parameters", dict, {})
    nested = family == V4_FAMILY and isinstance(rope.get("compress"), dict)
    main_rope, rope = (rope.get("main") or {}, rope["compress"]) if nested else ({}, rope)
    rope_type = _field(rope, "type", str, source, None) or _field(rope, "rope_type", str, source, "default")
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (default, yarn)")

    def r(key: str, default: float) -> float:
        return _field(rope, key, float, f"{source} (rope)", default)

    factor = r("factor", 0.0)
    if not factor:  # transformers' default when YaRN gives no factor: the context extension ratio
        factor = (
            f("max_position_embeddings", minimum=1) / r("original_max_position_embeddings", 1.0)
            if rope_type == "yarn"
            else 1.0
        )
    eos = c.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    if not eos_ids or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise ConfigError(f"{source}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    common = dict(
        family=family,
        vocab_size=f("vocab_size", minimum=1),
        dim=f("hidden_size", minimum=1),
        moe_inter_dim=f("moe_intermediate_size", minimum=1),
        n_layers=f("num_hidden_layers", minimum=1),
        n_mtp_layers=f("num_nextn_predict_layers", default=0),
        n_heads=f("num_attention_heads", minimum=1),
        n_routed_experts=f("n_routed_experts", minimum=1),
        n_shared_experts=f("n_shared_experts", default=0),
        n_activated_experts=f("num_experts_per_tok", minimum=1),
        score_func=f("scoring_func", str),
        topk_method=f("topk_method", str),
        route_scale=f("routed_scaling_factor", float, 1.0),
        norm_topk_prob=f("norm_topk_prob", bool, False),
        q_lora_rank=f("q_lora_rank", default=0),
        norm_eps=f("rms_norm_eps", float, 1e-6),
        rope_type=rope_type,
        rope_factor=factor,
        original_seq_len=int(r("original_max_position_embeddings", f("max_position_embeddings", minimum=1))),
        beta_fast=r("beta_fast", 32.0),
        beta_slow=r("beta_slow", 1.0),
        max_seq_len=f("max_position_embeddings", minimum=1),
        bos_token_id=f("bos_token_id", default=None),
        eos_token_ids=tuple(eos_ids),
        tie_word_embeddings=f("tie_word_embeddings", bool, False),
    )
    if family == V4_FAMILY:
        return _v4_args(c, f, common, rope, main_rope if nested else None, source)
    return ModelArgs(
        **common,
        inter_dim=f("intermediate_size", minimum=1),
        n_dense_layers=f("first_k_dense_replace", default=0),
        moe_layer_freq=f("moe_layer_freq", default=1, minimum=1),
        n_expert_groups=f("n_group", default=1, minimum=1),
        n_limited_groups=f("topk_group", default=1, minimum=1),
        kv_lora_rank=f("kv_lora_rank", minimum=1),
        qk_nope_head_dim=f("qk_nope_head_dim"),
        qk_rope_head_dim=f("qk_rope_head_dim"),
        v_head_dim=f("v_head_dim", minimum=1),
        rope_theta=_field(rope, "rope_theta", float, source, None) or f("rope_theta", float, 10000.0),
        mscale=r("mscale", 1.0),
        mscale_all_dim=r("mscale_all_dim", 0.0),
    )


def _v4_schedule(f: Callable[..., Any], n_blocks: int, source: str) -> tuple[tuple, tuple]:
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
    kind_rate = {HF_LAYER_KINDS[t]: _field(rates, t, int, source, minimum=1) for t in compressed}
    return kinds[:n_blocks], tuple(0 if k == SLIDING else kind_rate[k] for k in kinds[:n_blocks])


def _v4_args(
    c: dict[str, Any], f: Callable[..., Any], common: dict[str, Any], rope: dict, main_rope: dict | None, source: str
) -> ModelArgs:
    """DeepSeek-V4 (v4-flash-spec a.1): the official config.json keys, or transformers' spellings of them."""
    n_blocks = common["n_layers"] + common["n_mtp_layers"]
    kinds, ratios = _v4_schedule(f, n_blocks, source)
    head_dim = f("head_dim", minimum=1)
    if (kv_heads := f("num_key_value_heads", default=1)) != 1:
        raise ConfigError(f"{source}: num_key_value_heads is {kv_heads}; DeepSeek-V4 has one shared K=V head")
    if f("partial_rotary_factor", float, None) is not None and "qk_rope_head_dim" not in c:
        rope_dim = round(head_dim * f("partial_rotary_factor", float))
    else:
        rope_dim = f("qk_rope_head_dim", minimum=2)
    layer_types = f("mlp_layer_types", list, None)
    if layer_types is not None:  # transformers: hash_moe first, then moe
        n_hash = layer_types.count("hash_moe")
        if layer_types[:n_hash] != ["hash_moe"] * n_hash:
            raise ConfigError(f"{source}: mlp_layer_types must list every hash_moe layer first")
    else:
        n_hash = f("num_hash_layers")
    # transformers' nested "compress" set holds its base; the official config.json a top-level key
    nested = main_rope is not None
    compress_theta = _field(rope, "rope_theta", float, source) if nested else f("compress_rope_theta", float)
    return ModelArgs(
        **common,
        inter_dim=common["moe_inter_dim"],  # no dense MLP; the shared expert has the routed width
        n_dense_layers=0,
        moe_layer_freq=1,
        n_expert_groups=1,
        n_limited_groups=1,
        kv_lora_rank=0,
        qk_nope_head_dim=head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=head_dim,
        rope_theta=_field(main_rope, "rope_theta", float, source) if nested else f("rope_theta", float),
        mscale=0.0,  # V4 scales neither cos/sin nor the softmax under YaRN
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
