"""RMSNorm as transformers computes it: normalize in fp32, cast back, then scale by the weight (V3); with an
fp32 weight (V4 keeps its norms in fp32, as its reference does) scale in fp32 and cast once."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype == torch.float32:
            return (self.weight * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (V4's per-head query norm and the mHC input), the factor taken in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
