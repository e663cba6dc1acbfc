"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's residual of hc_mult parallel streams.

Around every sub-block (attention, MoE) the streams X [n, D] give three sets of weights from one fp32
projection of their RMS-normalized concatenation (v4-flash-spec d.2): `pre` collapses the streams into the
sub-block's input, `post` spreads its output back over them, and `comb` (made doubly stochastic by Sinkhorn
iterations) mixes the old streams in: X'_k = post_k * f + sum_j comb[j, k] * X_j. The weights and the mixing
are computed in fp32 and rounded once, as DeepSeek's reference does (transformers rounds post and comb to the
model dtype first). Legend: B batch, T tokens, N streams (hc_mult), D dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsfp4.kernels.backend import use_kernels
from dsfp4.kernels.mhc_weights import mhc_weights, mhc_weights_ref
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.norm import rms_normalize
from dsfp4.runtime.models.weights import Weights


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x: [B, T, N, D] streams, pre: [B, T, N] -> their weighted sum [B, T, D] (fp32 math, rounded once)."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)


class HyperConnection(nn.Module):
    """One sub-block's mHC weights (`prefix`: hc_attn or hc_ffn of a layer): fn [(2 + N) N, N D], base, scale [3]."""

    def __init__(self, a: ModelArgs, prefix: str, w: Weights):
        super().__init__()
        n = self.n = a.hc_mult
        self.fn = w.plain(prefix + "_fn", ((2 + n) * n, n * a.dim), torch.float32)
        self.base = w.plain(prefix + "_base", ((2 + n) * n,), torch.float32)
        self.scale = w.plain(prefix + "_scale", (3,), torch.float32)
        self.iters, self.eps, self.norm_eps = a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps

    def weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, N, D] -> pre [B, T, N], post [B, T, N], comb [B, T, N, N] (fp32)."""
        mix = F.linear(rms_normalize(x.flatten(2).float(), self.norm_eps), self.fn)  # [B, T, (2 + N) N]
        # one launch on CUDA
        weights = mhc_weights if use_kernels(mix) else mhc_weights_ref
        return weights(mix, self.scale, self.base, self.n, self.iters, self.eps)

    @staticmethod
    def expand(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """x: [B, T, N, D] streams, f: [B, T, D] sub-block output -> the new streams [B, T, N, D]."""
        # sum over the first index of comb
        mixed = torch.matmul(comb.transpose(-1, -2), x.float())
        return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(x.dtype)


class HyperHead(nn.Module):
    """The final collapse of the streams before the last norm (`prefix`: "" or an MTP block's layers.N.)."""

    def __init__(self, a: ModelArgs, prefix: str, w: Weights):
        super().__init__()
        n = a.hc_mult
        self.fn = w.plain(prefix + "hc_head_fn", (n, n * a.dim), torch.float32)
        self.base = w.plain(prefix + "hc_head_base", (n,), torch.float32)
        self.scale = w.plain(prefix + "hc_head_scale", (1,), torch.float32)
        self.eps, self.norm_eps = a.hc_eps, a.norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, N, D] -> [B, T, D]."""
        mix = F.linear(rms_normalize(x.flatten(2).float(), self.norm_eps), self.fn)  # [B, T, N]
        return collapse(x, torch.sigmoid(mix * self.scale + self.base) + self.eps)
