"""Rotary embedding applied to adjacent pairs, as complex rotations (DeepSeek's reference layout): the torch
formula, and the same rotation inside Triton kernels. The frequencies themselves (YaRN) are runtime/models/rope.py's.
Legend: B batch, T tokens, H heads, R rotated dims.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import tl, triton  # noqa: F401 (Triton's interpreter needs tl beside every jit function)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, R] rotated by freqs_cis: [T, R/2] complex64 (or [B, T, R/2]: each sequence at positions of its
    own), adjacent elements paired, in fp32, rounded once to x's dtype."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis.unsqueeze(-2))  # [(B,) T, 1, R/2]: every head
    return out.flatten(3).to(x.dtype)


if triton is not None:

    @triton.jit
    def rotate_pairs(re, im, cos, sin):
        """(re + i im) (cos + i sin) in fp32, as torch's complex product: -> (real, imaginary)."""
        return re * cos - im * sin, re * sin + im * cos
