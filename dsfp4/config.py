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

    def __post_init__(self) -> None:
        """Reject shapes the router cannot route, with the config key to fix."""
        e, g, k = self.n_routed_experts, self.n_expert_groups, self.n_activated_experts
        problems = []
        if e % g:
            problems.append(f"n_routed_experts ({e}) is not a multiple of n_group ({g})")
        elif self.n_limited_groups > g:
            problems.append(f"topk_group ({self.n_limited_groups}) exceeds n_group ({g})")
        elif k > self.n_limited_groups * (e // g if g > 1 else e):
            problems.append(f"num_experts_per_tok ({k}) exceeds the experts in the kept groups")
        elif self.topk_method == "noaux_tc" and g > 1 and e // g < 2:
            problems.append(f"n_group ({g}) leaves fewer than 2 experts per group")
        if problems:
            raise ConfigError(f"config.json: {problems[0]}")

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

    @property
    def mtp_prefixes(self) -> tuple[str, ...]:
        """Name prefixes of the MTP blocks in dsfp4's tensor names (layers.N. for N past the main layers)."""
        return tuple(f"layers.{i}." for i in range(self.n_layers, self.n_blocks))

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


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object"}


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

    # transformers 5 writes rope_parameters; the released checkpoints write rope_scaling (or nothing).
    rope = f("rope_scaling", dict, None) or f("rope_parameters", dict, {})
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
    return ModelArgs(
        family=family,
        vocab_size=f("vocab_size", minimum=1),
        dim=f("hidden_size", minimum=1),
        inter_dim=f("intermediate_size", minimum=1),
        moe_inter_dim=f("moe_intermediate_size", minimum=1),
        n_layers=f("num_hidden_layers", minimum=1),
        n_dense_layers=f("first_k_dense_replace", default=0),
        moe_layer_freq=f("moe_layer_freq", default=1, minimum=1),
        n_mtp_layers=f("num_nextn_predict_layers", default=0),
        n_heads=f("num_attention_heads", minimum=1),
        n_routed_experts=f("n_routed_experts", minimum=1),
        n_shared_experts=f("n_shared_experts", default=0),
        n_activated_experts=f("num_experts_per_tok", minimum=1),
        n_expert_groups=f("n_group", default=1, minimum=1),
        n_limited_groups=f("topk_group", default=1, minimum=1),
        score_func=f("scoring_func", str),
        topk_method=f("topk_method", str),
        route_scale=f("routed_scaling_factor", float, 1.0),
        norm_topk_prob=f("norm_topk_prob", bool, False),
        q_lora_rank=f("q_lora_rank", default=0),
        kv_lora_rank=f("kv_lora_rank", minimum=1),
        qk_nope_head_dim=f("qk_nope_head_dim"),
        qk_rope_head_dim=f("qk_rope_head_dim"),
        v_head_dim=f("v_head_dim", minimum=1),
        norm_eps=f("rms_norm_eps", float, 1e-6),
        rope_theta=_field(rope, "rope_theta", float, source, None) or f("rope_theta", float, 10000.0),
        rope_type=rope_type,
        rope_factor=factor,
        original_seq_len=int(r("original_max_position_embeddings", f("max_position_embeddings", minimum=1))),
        beta_fast=r("beta_fast", 32.0),
        beta_slow=r("beta_slow", 1.0),
        mscale=r("mscale", 1.0),
        mscale_all_dim=r("mscale_all_dim", 0.0),
        max_seq_len=f("max_position_embeddings", minimum=1),
        bos_token_id=f("bos_token_id", default=None),
        eos_token_ids=tuple(eos_ids),
        tie_word_embeddings=f("tie_word_embeddings", bool, False),
    )
