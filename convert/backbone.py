"""`--backbone`: the format of each backbone matrix DeepSeek ships in FP8, by its kind.

  fp8               every one in FP8 128x128 blocks, bit-exact where the source is FP8 (the default)
  fp4               every one in NVFP4 (whatever its kind: DeepSeek-V4's attention matrices too)
  fp4:KIND,KIND...  the kinds listed in NVFP4, the rest in FP8, e.g. fp4:wo,wq_b,shared

Kinds (KINDS): the attention projections wq_a, wq_b (wq where the model has no q LoRA), wkv_a, wkv_b, wo; `dense`,
the dense layers' MLPs; `shared`, the shared experts. The manifest records each matrix's format and the spec.
"""

from __future__ import annotations

import re

from dsfp4.errors import ConfigError

FP8, FP4 = "fp8_e4m3_b128", "nvfp4"
# matrices engines fuse into one layer (an MLP's gate and up; V3's q_a and kv_a, vLLM's fused_qkv_a_proj), by the last
# part of their names: in NVFP4 the two share one global scale, so a fused kernel, and an export, needs one scalar
FUSED_PAIRS = (("wq_a", "wkv_a"), ("w1", "w3"))
KINDS = {
    "wq_a": r"attn\.wq_a",
    "wq_b": r"attn\.wq_b|attn\.wq",
    "wkv_a": r"attn\.wkv_a",
    "wkv_b": r"attn\.wkv_b",
    "wo": r"attn\.wo",
    "dense": r"ffn\.w[123]",
    "shared": r"ffn\.shared_experts\.w[123]",
}
_PATTERNS = {kind: re.compile(rf"(?:layers\.\d+\.)?(?:{p})") for kind, p in KINDS.items()}


def fp4_kinds(spec: str) -> frozenset[str]:
    """The kinds a --backbone spec puts in NVFP4; ConfigError naming the flag for anything else."""
    if spec in ("fp8", "fp4"):
        return frozenset(KINDS) if spec == "fp4" else frozenset()
    head, _, listed = spec.partition(":")
    kinds = [k for k in listed.split(",") if k]
    if head != "fp4" or not kinds or (unknown := sorted(set(kinds) - set(KINDS))):
        what = f"unknown kind {', '.join(unknown)}" if head == "fp4" and kinds else "not a backbone spec"
        raise ConfigError(f"--backbone {spec}: {what}; give fp8, fp4 or fp4:KIND,KIND... with kinds {', '.join(KINDS)}")
    return frozenset(kinds)


def matrix_kind(ref: str) -> str | None:
    """The kind of a backbone matrix by its dsfp4 name (layers.3.attn.wo -> wo); None for anything else."""
    return next((kind for kind, p in _PATTERNS.items() if p.fullmatch(ref)), None)


def backbone_format(ref: str, spec: str) -> str:
    """The format --backbone `spec` gives the matrix `ref` (fp4: every one, V4's own kinds too)."""
    return FP4 if spec == "fp4" or matrix_kind(ref) in fp4_kinds(spec) else FP8
