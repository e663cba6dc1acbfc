"""The experts' activation: silu(gate) * up, with DeepSeek-V4's clamp (swiglu_limit) when a limit is given:
gate clamped above at it, up to [-limit, limit], before the product. `swiglu` is the torch reference;
`swiglu_tl` the same inside Triton kernels (LIMIT a compile-time constant, 0.0 for none)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsfp4.kernels.backend import tl, triton


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """gate, up: [..., I] -> silu(gate) * up, clamped first when limit > 0."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def swiglu_tl(gate, up, LIMIT: tl.constexpr):
        if LIMIT > 0:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return gate * tl.sigmoid(gate) * up
