"""config.json -> ModelArgs: the keys every family shares, then the family's own through its reader, with the keys
its config may leave out (convert/family.py). With the readers (config_v3.py, config_v4.py) the only place Hugging
Face key names (hidden_size, moe_intermediate_size, ...) are read, the spellings of transformers' configs included."""

from __future__ import annotations

from typing import Any

from dsfp4.convert.family import SOURCE_FAMILIES
from dsfp4.convert.source.config_value import REQUIRED, config_value
from dsfp4.errors import ConfigError
from dsfp4.layout.model_args import ModelArgs


def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Build ModelArgs from a Hugging Face config.json dict; `source` names the file in errors."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    family = cfg.get("model_type")
    if family not in SOURCE_FAMILIES:
        raise ConfigError(f"{source}: model_type {family!r} is not supported (supported: {', '.join(SOURCE_FAMILIES)})")
    spec = SOURCE_FAMILIES[family]
    c = {**spec.config_defaults, **{k: v for k, v in cfg.items() if v is not None}}

    def f(key: str, kind: type = int, default: Any = REQUIRED, minimum: int = 0) -> Any:
        return config_value(c, key, kind, source, default, minimum)

    # transformers 5 writes rope_parameters; the released checkpoints write rope_scaling (or nothing); a family's
    # config may nest sets of its own (rope_sets: the YaRN one here, the plain one to its reader)
    rope, main_rope = spec.rope_sets(f("rope_scaling", dict, None) or f("rope_parameters", dict, {}))
    rope_type = config_value(rope, "type", str, source, None) or config_value(rope, "rope_type", str, source, "default")
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (default, yarn)")

    def r(key: str, default: float) -> float:
        return config_value(rope, key, float, f"{source} (rope)", default)

    factor = r("factor", 0.0)
    # transformers' default when YaRN gives no factor: the context extension ratio
    if not factor:
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
    return spec.read_config(c, f, common, rope, main_rope, source)
