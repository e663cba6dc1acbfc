"""DeepSeek-V4's mHC weights from their projection, in one launch: the pre and post gates and the
doubly stochastic stream mixing (Sinkhorn iterations). Torch runs each iteration as six tiny kernels, so
with V4-Flash's 20 iterations the two mHCs of a layer cost ~250 launches per decode step; here each
token's N x N mixing matrix stays in registers.

`mhc_weights_ref` is the formula (v4-flash-spec d.2): with mix = [pre | post | comb] of one token,
pre = sigmoid(pre s0 + b) + eps, post = 2 sigmoid(post s1 + b), comb = softmax over each row of
(comb s2 + b) + eps, then columns normalized, then (rows, columns) iters - 1 more times, each sum + eps.
Legend: M tokens, N streams (hc_mult).
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import tl, triton
from dsfp4.layout.formats import next_pow2


def mhc_weights_ref(
    mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix: [..., (2 + N) N] fp32, scale: [3], base: [(2 + N) N] -> pre [..., N], post [..., N], comb [..., N, N]."""
    pre, post, comb = mix.split([n, n, n * n], dim=-1)
    base_pre, base_post, base_comb = base.split([n, n, n * n])
    pre = torch.sigmoid(pre * scale[0] + base_pre) + eps
    post = 2 * torch.sigmoid(post * scale[1] + base_post)
    comb = torch.softmax((comb * scale[2] + base_comb).unflatten(-1, (n, n)), dim=-1) + eps
    # columns first, then rows and columns
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


if triton is not None:

    @triton.jit
    def _mhc_kernel(
        mix_ptr,
        scale_ptr,
        base_ptr,
        pre_ptr,
        post_ptr,
        comb_ptr,
        eps,
        N: tl.constexpr,
        NP: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        """One token: its (2 + N) N projections in, its gates and N x N mixing out (padding rows and columns
        kept out of every sum)."""
        m = tl.program_id(0)
        width: tl.constexpr = (2 + N) * N
        row = mix_ptr + m * width
        i = tl.arange(0, NP)
        ok = i < N
        s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
        pre = tl.sigmoid(tl.load(row + i, mask=ok, other=0.0) * s0 + tl.load(base_ptr + i, mask=ok, other=0.0))
        post = tl.sigmoid(tl.load(row + N + i, mask=ok, other=0.0) * s1 + tl.load(base_ptr + N + i, mask=ok, other=0.0))
        tl.store(pre_ptr + m * N + i, pre + eps, mask=ok)
        tl.store(post_ptr + m * N + i, 2 * post, mask=ok)
        cell = i[:, None] * N + i[None, :]  # [NP, NP]
        inside = ok[:, None] & ok[None, :]
        c = tl.load(row + 2 * N + cell, mask=inside, other=0.0) * s2
        c = tl.where(inside, c + tl.load(base_ptr + 2 * N + cell, mask=inside, other=0.0), float("-inf"))
        # padding rows: exp(-inf) = 0
        e = tl.exp(c - tl.where(ok, tl.max(c, axis=1), 0.0)[:, None])
        # row softmax, + eps
        c = tl.where(inside, e / tl.where(ok, tl.sum(e, axis=1), 1.0)[:, None] + eps, 0.0)
        c = c / (tl.sum(c, axis=0)[None, :] + eps)
        for _ in range(ITERS - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + eps)
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
        tl.store(comb_ptr + m * N * N + cell, c, mask=inside)


def mhc_weights(
    mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_weights_ref's result, one program per token."""
    lead = mix.shape[:-1]
    rows = mix.reshape(-1, mix.shape[-1]).contiguous()  # [M, (2 + N) N]
    m = rows.shape[0]
    pre, post = (torch.empty(m, n, dtype=torch.float32, device=mix.device) for _ in range(2))
    comb = torch.empty(m, n, n, dtype=torch.float32, device=mix.device)
    _mhc_kernel[(m,)](rows, scale, base, pre, post, comb, eps, N=n, NP=next_pow2(n), ITERS=iters, num_warps=1)
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)
