"""RMSNorm as transformers computes it: normalize in fp32, cast back, then scale by the weight (V3); with an
fp32 weight (V4 keeps its norms in fp32, as its reference does) scale in fp32 and cast once. On CUDA one
Triton pass (kernels/rmsnorm.py), elsewhere its torch reference."""

from __future__ import annotations

import torch
from torch import nn

from dsfp4.kernels.backend import use_kernels
from dsfp4.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x) and x.stride(-1) == 1:
            return rmsnorm(x, self.weight, self.eps)
        return rmsnorm_ref(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and this norm of its result, in one pass on CUDA: -> (x + delta, norm(x + delta))."""
        # else torch broadcasts and promotes
        same = (delta.shape, delta.dtype) == (x.shape, x.dtype)
        if use_kernels(x) and same and x.stride(-1) == delta.stride(-1) == 1:
            return add_rmsnorm(x, delta, self.weight, self.eps)
        return add_rmsnorm_ref(x, delta, self.weight, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (V4's per-head query norm and the mHC input), the factor taken in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
