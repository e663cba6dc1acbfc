"""DeepSeek-V3's (and V2's) own config.json keys, read after the keys every family shares (hf_config.py): the dense
MLP and layers, the router's groups, MLA's ranks and heads, YaRN's mscales."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsfp4.convert.source.config_value import config_value
from dsfp4.layout.model_args import ModelArgs


def one_rope_set(rope: dict) -> tuple[dict, None]:
    """V3's config holds one set of RoPE keys (YaRN's where it scales)."""
    return rope, None


def v3_args(
    c: dict[str, Any], f: Callable[..., Any], common: dict[str, Any], rope: dict, main_rope: None, source: str
) -> ModelArgs:
    """ModelArgs of the shared fields (`common`) and V3's own keys (`f` reads config.json's)."""

    def r(key: str, default: float) -> float:
        return config_value(rope, key, float, f"{source} (rope)", default)

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
        rope_theta=config_value(rope, "rope_theta", float, source, None) or f("rope_theta", float, 10000.0),
        mscale=r("mscale", 1.0),
        mscale_all_dim=r("mscale_all_dim", 0.0),
    )
