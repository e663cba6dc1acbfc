"""ModelArgs: the shape of a DeepSeek MoE model, built once from config.json and kept in the manifest.

Field names follow DeepSeek's reference `inference/model.py`; Hugging Face key names appear only in
`from_hf_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsfp4.errors import ConfigError

# model_type -> defaults for keys that the family's config.json may leave out (transformers'
# DeepseekV3Config, for one, never writes scoring_func or topk_method: V3 always uses both).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy"},
}


@dataclass(frozen=True)
class ModelArgs:
    """Model shape and math constants.

    family: config.json model_type. dim: hidden size. inter_dim: dense-MLP width. moe_inter_dim:
    routed/shared expert width. n_layers: main decoder layers; the n_mtp_layers MTP blocks follow them
    (absolute indices n_layers ..). n_dense_layers: leading layers with a dense MLP. q_lora_rank 0 means a
    plain wq projection (V2-Lite). topk_method "noaux_tc" means group-limited top-k with the
    e_score_correction_bias. rope_type "yarn" enables the YaRN fields that follow it.
    """

    family: str
    vocab_size: int
    dim: int
    inter_dim: int
    moe_inter_dim: int
    n_layers: int
    n_dense_layers: int
    moe_layer_freq: int
    n_mtp_layers: int
    n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    n_expert_groups: int
    n_limited_groups: int
    score_func: str
    topk_method: str
    route_scale: float
    norm_topk_prob: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float
    rope_theta: float
    rope_type: str
    rope_factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    max_seq_len: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_gate_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @property
    def n_blocks(self) -> int:
        """Decoder blocks stored in the checkpoint: main layers, then MTP layers."""
        return self.n_layers + self.n_mtp_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.n_dense_layers and layer % self.moe_layer_freq == 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ConfigError(
                f"model args do not match this dsfp4: unknown {sorted(set(d) - names)}, "
                f"missing {sorted(names - set(d))}; reconvert with this version"
            )
        return cls(**{**d, "eos_token_ids": tuple(d["eos_token_ids"])})


def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Build ModelArgs from a Hugging Face config.json dict; `source` names the file in errors."""
    family = cfg.get("model_type")
    if family not in FAMILY_DEFAULTS:
        raise ConfigError(f"{source}: model_type {family!r} is not supported (supported: {', '.join(FAMILY_DEFAULTS)})")
    c = {**FAMILY_DEFAULTS[family], **{k: v for k, v in cfg.items() if v is not None}}

    def need(key: str) -> Any:
        if c.get(key) is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return c[key]

    # transformers 5 writes rope_parameters; the released checkpoints write rope_scaling (or nothing).
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    rope_type = rope.get("type") or rope.get("rope_type") or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (default, yarn)")
    eos = need("eos_token_id")
    return ModelArgs(
        family=family,
        vocab_size=need("vocab_size"),
        dim=need("hidden_size"),
        inter_dim=need("intermediate_size"),
        moe_inter_dim=need("moe_intermediate_size"),
        n_layers=need("num_hidden_layers"),
        n_dense_layers=c.get("first_k_dense_replace", 0),
        moe_layer_freq=c.get("moe_layer_freq", 1),
        n_mtp_layers=c.get("num_nextn_predict_layers", 0),
        n_heads=need("num_attention_heads"),
        n_routed_experts=need("n_routed_experts"),
        n_shared_experts=c.get("n_shared_experts") or 0,
        n_activated_experts=need("num_experts_per_tok"),
        n_expert_groups=c.get("n_group") or 1,
        n_limited_groups=c.get("topk_group") or 1,
        score_func=need("scoring_func"),
        topk_method=need("topk_method"),
        route_scale=float(c.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        q_lora_rank=c.get("q_lora_rank") or 0,
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)),
        original_seq_len=int(rope.get("original_max_position_embeddings", need("max_position_embeddings"))),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        mscale=float(rope.get("mscale", 1.0)),
        mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        max_seq_len=need("max_position_embeddings"),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
