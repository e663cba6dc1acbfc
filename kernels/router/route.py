"""The router's selection in one pass on the GPU: group-limited top-k over the experts' scores and the
chosen experts' weights. torch spends ~15 small kernels per MoE layer on it (two top-k sorts among them),
more than the router's matmul takes at decode.

`route_ref` is the formula (runtime/models/moe.py's Gate): the selection score is score + bias; with groups, a
group's score is the sum of its top 2 (with a bias) or its max (without), and only the best
`limited_groups` groups stay; the top k of the rest are chosen, largest first; their weights are the
scores without the bias, renormalized to sum 1 if asked, times `scale`.
Legend: T tokens, E experts, G groups, K chosen per token.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import tl, triton
from dsfp4.layout.formats import next_pow2


def route_ref(
    scores: torch.Tensor, bias: torch.Tensor | None, groups: int, limited_groups: int, k: int, norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [T, E] fp32, bias: [E] fp32 or None; groups 1 for none -> (weights [T, K] fp32, ids [T, K] int64)."""
    choice = scores if bias is None else scores + bias
    if groups > 1:
        grouped = choice.view(scores.shape[0], groups, -1)  # [T, G, E/G]
        g = grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None else grouped.amax(dim=-1)
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(limited_groups, dim=-1)[1], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
    ids = choice.topk(k, dim=-1)[1]  # [T, K]
    return chosen_weights(scores, ids, norm, scale), ids


def chosen_weights(scores: torch.Tensor, ids: torch.Tensor, norm: bool, scale: float) -> torch.Tensor:
    """scores: [T, E], ids: [T, K] -> the chosen experts' scores [T, K], renormalized to sum 1 if `norm`,
    times `scale` (also how V4's hash layers weight the experts their table picks)."""
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale


if triton is not None:

    @triton.jit
    def _route_kernel(
        s_ptr,
        b_ptr,
        w_ptr,
        id_ptr,
        scale,
        E: tl.constexpr,
        G: tl.constexpr,
        TOPG: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        NORM: tl.constexpr,
    ):
        """One token's row of E scores (E and E / G powers of two)."""
        row = tl.program_id(0)
        cols = tl.arange(0, E)
        s = tl.load(s_ptr + row * E + cols)  # [E]
        c = s + tl.load(b_ptr + cols) if HAS_BIAS else s
        if G > 1:
            grouped = tl.reshape(c, (G, E // G))
            inner = tl.arange(0, E // G)[None, :]
            top = tl.max(grouped, axis=1)  # [G]
            # the sum of the group's top 2 (a tie counts twice, as torch.topk does)
            if HAS_BIAS:
                first = tl.argmax(grouped, axis=1)
                top += tl.max(tl.where(inner == first[:, None], float("-inf"), grouped), axis=1)
            gs = tl.arange(0, G)
            keep = gs < 0
            for _ in tl.static_range(TOPG):
                best = tl.argmax(tl.where(keep, float("-inf"), top), axis=0)
                keep = keep | (gs == best)
            c = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (E,))
        ks = tl.arange(0, KP)
        ids = tl.zeros((KP,), dtype=tl.int64)
        w = tl.zeros((KP,), dtype=tl.float32)
        # largest first, as torch.topk
        for k in tl.static_range(K):
            j = tl.argmax(c, axis=0)
            ids = tl.where(ks == k, j, ids)
            w = tl.where(ks == k, tl.sum(tl.where(cols == j, s, 0.0), axis=0), w)
            c = tl.where(cols == j, float("-inf"), c)
        if NORM:
            w = w / (tl.sum(w, axis=0) + 1e-20)
        tl.store(w_ptr + row * K + ks, w * scale, mask=ks < K)
        tl.store(id_ptr + row * K + ks, ids, mask=ks < K)


def can_route(n_experts: int, groups: int) -> bool:
    """The kernel takes power-of-two expert and group sizes (every DeepSeek V3 and V4 router)."""
    return n_experts == next_pow2(n_experts) and n_experts // groups == next_pow2(n_experts // groups)


def route(
    scores: torch.Tensor, bias: torch.Tensor | None, groups: int, limited_groups: int, k: int, norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref's result in one launch (one program per token); can_route() must hold."""
    t, e = scores.shape
    scores = scores.contiguous()
    weights = torch.empty(t, k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    _route_kernel[(t,)](
        scores,
        scores if bias is None else bias,
        weights,
        ids,
        float(scale),
        E=e,
        G=groups,
        TOPG=limited_groups,
        K=k,
        KP=next_pow2(k),
        HAS_BIAS=bias is not None,
        NORM=norm,
        num_warps=1 if e <= 64 else 4,
    )
    return weights, ids
