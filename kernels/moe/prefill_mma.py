"""The routed experts' prefill on FP4 tensor cores (W4A8): prefill.py's grouped GEMMs with each product taken by
tl.dot_scaled, Blackwell's block-scaled MMA (sm_100, sm_120), instead of FP4 decoded to bf16 in software.

The weights go in as the record holds them: MXFP4's e2m1 codes with their e8m0 scale per 32 are what dot_scaled
takes. The activations are rounded to MXFP8 (act_mxfp8.py): x per token before gate+up, the SwiGLU output (in x's
dtype) per pair row before down; that rounding is the variant's only loss (moe_w4a8_ref computes it exactly).
NVFP4 records do not go: their e4m3 scales per 16 are no e8m0 scales (no exact conversion: a scale's mantissa
would have to move into the e2m1 codes), and Blackwell takes e4m3-scaled FP4 only against FP4 activations; they
keep prefill.py. backend.fp4_mma decides where this runs (kernel.py asks it). Legend as prefill.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsfp4.errors import FormatError
from dsfp4.kernels.backend import card, interpreted
from dsfp4.kernels.moe import prefill_mma_jit as jit
from dsfp4.kernels.moe.act_mxfp8 import GROUP, mxfp8_quantize, mxfp8_round
from dsfp4.kernels.moe.prefill import (
    NUM_WARPS,
    PrefillBlocks,
    _grid,
    _workspace,
    align_by_expert,
    max_blocks,
    prefill_blocks,
)
from dsfp4.kernels.moe.ref import routed
from dsfp4.kernels.swiglu import swiglu
from dsfp4.layout.record import RecordLayout

# the record format whose scales tl.dot_scaled takes as they are
MMA_FORMAT = "mxfp4"


def takes(layout: RecordLayout) -> bool:
    """Whether records of `layout` can take the FP4 MMA: MXFP4 of 4-bit codes, dims in whole scale blocks."""
    return layout.format == MMA_FORMAT and not layout.cold and layout.dim % GROUP == 0 and layout.inter_dim % GROUP == 0


def _check(layout: RecordLayout, blocks: PrefillBlocks) -> None:
    if not takes(layout):
        raise FormatError(f"the FP4 tensor-core prefill reads {MMA_FORMAT} records of 4-bit codes, not {layout.format}")
    assert blocks.bk_up % GROUP == 0 and blocks.bk_down % GROUP == 0, f"K steps must hold whole {GROUP}-blocks"


def _constants(blocks: PrefillBlocks, dtype: torch.dtype) -> dict:
    return dict(
        BM=blocks.block_m,
        BT=blocks.tail_m,
        EMULATE_RNE=interpreted() and dtype == torch.bfloat16,
        num_warps=NUM_WARPS,
    )


def moe_prefill_mma(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    blocks: PrefillBlocks | None = None,
    limit: float = 0.0,
) -> torch.Tensor:
    """moe_w4a8_ref's result from the grouped FP4 MMAs; the arguments and result as prefill.moe_prefill's."""
    t, d = x.shape
    k, n_experts = ids.shape[1], offsets.numel()
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"moe_prefill_mma computes in bf16 or fp32, not {x.dtype}")
    assert d == layout.dim and ids.shape == weights.shape == (t, k), "x, ids, weights must be [T, D], [T, K], [T, K]"
    assert records.dtype == torch.uint8 and records.data_ptr() % 16 == 0, "records: a 16-byte aligned u8 slot pool"
    blocks = blocks or prefill_blocks(t * k, n_experts, layout, card(x.device).smem)
    _check(layout, blocks)
    pairs, block_experts, _ = align_by_expert(ids, n_experts, blocks.rows)
    offsets = offsets.contiguous()
    i = layout.inter_dim
    xq, xs = mxfp8_quantize(x)  # [T, D], [T, D/G]
    act = _workspace((pairs.numel(), i), x.dtype, x.device)
    jit.gate_up_mma_kernel[_grid(i // blocks.bn_up, block_experts)](
        xq,
        xs,
        weights.contiguous(),
        pairs,
        block_experts,
        records,
        offsets,
        act,
        t * k,
        TOP_K=k,
        D=d,
        INTER=i,
        W13=layout.part("w13").offset,
        S13=layout.part("w13_scale").offset,
        BN=blocks.bn_up,
        BK=blocks.bk_up,
        LIMIT=float(limit),
        num_stages=blocks.stages_up,
        **_constants(blocks, x.dtype),
    )
    aq, as_ = mxfp8_quantize(act)  # [L, I], [L, I/G]
    out = _workspace((t * k, d), x.dtype, x.device)
    jit.down_mma_kernel[_grid(d // blocks.bn_down, block_experts)](
        aq,
        as_,
        pairs,
        block_experts,
        records,
        offsets,
        out,
        t * k,
        D=d,
        INTER=i,
        W2=layout.part("w2").offset,
        S2=layout.part("w2_scale").offset,
        BN=blocks.bn_down,
        BK=blocks.bk_down,
        num_stages=blocks.stages_down,
        **_constants(blocks, x.dtype),
    )
    # each token's pairs in slot order: the same bits on every run
    return out.view(t, k, d).sum(1)


def moe_w4a8_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    limit: float = 0.0,
    act_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch reference of moe_prefill_mma (device slots only): ref.moe_ref with the kernels' roundings, x to MXFP8
    and the SwiGLU output, rounded to act_dtype (the kernel's workspace dtype: x's by default), to MXFP8.
    x: [T, D] -> y [T, D] in x's dtype."""
    act_dtype = act_dtype or x.dtype
    xq = mxfp8_round(x)  # [T, D]
    y = torch.zeros_like(x)
    for record, token, j in routed(ids, records, offsets, layout):
        w1, w3, w2 = layout.dequantize(record, dtype=x.dtype)
        xe = xq[token]  # [n, D]
        h = swiglu(F.linear(xe, w1), F.linear(xe, w3), limit) * weights[token, j, None].to(x.dtype)  # [n, I]
        hq = mxfp8_round(h.to(act_dtype)).to(x.dtype)
        y.index_add_(0, token, F.linear(hq, w2))
    return y


def workspace_bytes(layout: RecordLayout, top_k: int, n_experts: int, tokens: int) -> int:
    """Device memory the variant holds beyond prefill.py's for a call of `tokens` tokens: the MXFP8 codes and scales
    of x and of the padded expert rows."""
    pairs = tokens * top_k
    block_rows = prefill_blocks(pairs, n_experts, layout).rows
    rows = max_blocks(pairs, n_experts, block_rows) * block_rows
    per_elt = 1 + 1 / GROUP
    return int(per_elt * (tokens * layout.dim + rows * layout.inter_dim))
