"""ModelArgs: the shape of a DeepSeek MoE model, built once from config.json (convert/source/hf_config.py) and
kept in the manifest.

Field names follow DeepSeek's reference `inference/model.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dsfp4.errors import ConfigError
from dsfp4.layout.family import Family, family_of

# every float field: (its config.json key, its least value, whether that value itself is allowed); fields a family
# does not use default to 0
FLOAT_RANGES = {
    "route_scale": ("routed_scaling_factor", 0.0, False),
    "norm_eps": ("rms_norm_eps", 0.0, False),
    "rope_theta": ("rope_theta", 0.0, False),
    "rope_factor": ("rope_scaling.factor", 0.0, False),
    "beta_fast": ("rope_scaling.beta_fast", 0.0, False),
    "beta_slow": ("rope_scaling.beta_slow", 0.0, False),
    "mscale": ("rope_scaling.mscale", 0.0, True),
    "mscale_all_dim": ("rope_scaling.mscale_all_dim", 0.0, True),
    "compress_rope_theta": ("compress_rope_theta", 0.0, True),
    "hc_eps": ("hc_eps", 0.0, True),
    "swiglu_limit": ("swiglu_limit", 0.0, True),
}


def float_problems(args: ModelArgs) -> list[str]:
    """The float fields of `args` that are not finite numbers in their range (FLOAT_RANGES), by config.json key."""
    problems = []
    for name, (key, least, closed) in FLOAT_RANGES.items():
        v = getattr(args, name)
        if not math.isfinite(v) or v < least or (v == least and not closed):
            bound = f"at least {least:g}" if closed else f"above {least:g}"
            problems.append(f"{key} must be a finite number {bound}, got {v}")
    return problems


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
    # DeepSeek-V4 (family deepseek_v4) only; the defaults describe V3/V2, whose manifests predate them
    # per-head width, also the width of the one shared K=V vector per token
    head_dim: int = 0
    # sliding window, counting the current token
    window_size: int = 0
    # grouped output projection: head groups, and each group's output width
    o_groups: int = 0
    o_lora_rank: int = 0
    # per block (main layers, then MTP): SLIDING, CSA or HCA (layout/family.py)
    layer_kinds: tuple[str, ...] = ()
    # per block: tokens per compressed entry (0 for sliding)
    compress_ratios: tuple[int, ...] = ()
    # RoPE base of layers with a compressor (the YaRN fields apply there only)
    compress_rope_theta: float = 0.0
    # lightning indexer of CSA layers: heads, head width, entries kept per query
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # mHC residual streams, Sinkhorn iterations and epsilon
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    # leading MoE layers routed by the token-id table tid2eid
    n_hash_layers: int = 0
    # SwiGLU clamp (0: none)
    swiglu_limit: float = 0.0

    def __post_init__(self) -> None:
        """Reject shapes the router cannot route and float fields out of their range, with the config key to fix."""
        e, g, k = self.n_routed_experts, self.n_expert_groups, self.n_activated_experts
        problems = float_problems(self) + self.family_spec.problems(self)
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
    def family_spec(self) -> Family:
        """What the contract knows of the model's family (layout/family.py)."""
        return family_of(self.family)

    def is_hash_layer(self, layer: int) -> bool:
        """V4: the layer's experts come from tid2eid[token] (known before the layer runs)."""
        return layer < self.n_hash_layers

    def layer_has_gate_bias(self, layer: int) -> bool:
        return self.has_gate_bias and not self.is_hash_layer(layer)

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
        """Fields left at their defaults are left out: a V3 manifest (and its conversion hash, which hot
        profiles bind to) reads the same as before the V4 fields existed."""
        d = dataclasses.asdict(self)
        return {f.name: d[f.name] for f in dataclasses.fields(self) if d[f.name] != f.default}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        """Fields added later have defaults: manifests written before them still load."""
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING}
        if not required <= set(d) <= names:
            raise ConfigError(
                f"model args do not match this dsfp4: unknown {sorted(set(d) - names)}, "
                f"missing {sorted(required - set(d))}; reconvert with this version"
            )
        tuples = {f.name: tuple(d[f.name]) for f in fields if f.name in d and str(f.type).startswith("tuple")}
        return cls(**{**d, **tuples})
