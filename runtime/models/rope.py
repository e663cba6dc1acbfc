"""Rotary embedding with YaRN: the rotations per position (the pairs are rotated by kernels/rope.py).

YaRN is on exactly when config.json's rope_scaling says "yarn". DeepSeek's reference code applies it only
when its max_seq_len exceeds original_seq_len (its default 16384 > 4096 makes that true for V3);
transformers applies it whenever rope_scaling asks, and so do we. transformers also scales cos/sin by
an attention factor (1.0 when mscale == mscale_all_dim, as in every DeepSeek config); we do the same.
"""

from __future__ import annotations

import math

import torch

from dsfp4.kernels.rope import apply_rotary_emb
from dsfp4.layout.model_args import ModelArgs


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(n_rotations: float, dim: int, base: float, max_len: int) -> float:
    return dim * math.log(max_len / (n_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_freqs(args: ModelArgs, base: float, yarn: bool) -> torch.Tensor:
    """[rope_dim / 2] inverse frequencies base^(-2k / rope_dim); with `yarn`, the slow pairs interpolated by
    rope_factor (the ramp between the beta_fast and beta_slow correction dims)."""
    dim = args.qk_rope_head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn:
        low = max(math.floor(_correction_dim(args.beta_fast, dim, base, args.original_seq_len)), 0)
        high = min(math.ceil(_correction_dim(args.beta_slow, dim, base, args.original_seq_len)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        # interpolate the slow dims only
        freqs = freqs / args.rope_factor * ramp + freqs * (1 - ramp)
    return freqs


def rotations(freqs: torch.Tensor, max_len: int, scale: float = 1.0) -> torch.Tensor:
    """[max_len, len(freqs)] complex64: scale * e^(i * position * freq) for every position."""
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return torch.polar(torch.full_like(angles, scale), angles)


def precompute_freqs_cis(args: ModelArgs, max_len: int) -> torch.Tensor:
    """[max_len, rope_dim / 2] complex64: e^(i * position * theta_k) for every position and pair k."""
    freqs = rope_freqs(args, args.rope_theta, args.rope_type == "yarn")
    scale = 1.0
    if args.rope_type == "yarn":
        if args.mscale and args.mscale_all_dim:
            scale = yarn_mscale(args.rope_factor, args.mscale) / yarn_mscale(args.rope_factor, args.mscale_all_dim)
        else:
            scale = yarn_mscale(args.rope_factor, 1.0)
    return rotations(freqs, max_len, scale)


def softmax_scale(args: ModelArgs) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' rule; the
    reference uses `mscale`: both are 1.0 for V3 and 0.707 for V2-Lite, so they agree)."""
    scale = args.qk_head_dim**-0.5
    if args.rope_type == "yarn" and args.mscale_all_dim:
        scale *= yarn_mscale(args.rope_factor, args.mscale_all_dim) ** 2
    return scale


def apply_rotary_tail(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, W] with RoPE on its last R = 2 * freqs_cis.shape[-1] dims only (V4 puts the rotated dims
    after the others), freqs_cis: [T, R/2]."""
    r = 2 * freqs_cis.shape[-1]
    return torch.cat([x[..., :-r], apply_rotary_emb(x[..., -r:], freqs_cis)], dim=-1)
