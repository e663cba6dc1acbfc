"""FP8 128x128-block weights to a dense dtype in one pass on the GPU: the absorbed attention multiplies by
slices of wkv_b every step (runtime/models/v3/attention.py), and torch's dequantization goes through two fp32 copies
of the whole matrix (about 10x the bytes). `fp8_dequantize_ref` is layout/fp8.py's torch function.
Legend: N rows, K columns, Nb/Kb their 128-blocks.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import hw_e4m3, tl, triton
from dsfp4.kernels.fp4.codes import block_scale
from dsfp4.layout.fp8 import FP8_BLOCK, fp8_block_dequantize

# a program writes 32 rows of one 128-column block (one scale per program)
BLOCK_N, BLOCK_K = 32, 128

fp8_dequantize_ref = fp8_block_dequantize

if triton is not None:

    @triton.jit
    def _dequant_kernel(
        q_ptr,
        s_ptr,
        w_ptr,
        N,
        K,
        stride_q,
        stride_s,
        stride_w,
        SCALE_BLOCK: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        HW_E4M3: tl.constexpr,
    ):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        ok = (rows[:, None] < N) & (cols[None, :] < K)
        b = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :], mask=ok, other=0)  # [BN, BK] e4m3 bytes
        s = tl.load(s_ptr + (tl.program_id(0) * BN // SCALE_BLOCK) * stride_s + tl.program_id(1))
        # exact e4m3 -> fp32, times the block's fp32 scale
        w = block_scale(b, E8M0=False, HW_E4M3=HW_E4M3) * s
        tl.store(w_ptr + rows[:, None] * stride_w + cols[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)


def fp8_dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    by_bits: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [N, K] e4m3, scale: [Nb, Kb] fp32 -> w [N, K] in `dtype` (written into `out`, a contiguous [N, K], where
    given): fp8_dequantize_ref's values (the product is taken in fp32 and rounded once), from one read of q and one
    write of w. e4m3 converts in hardware where the device's FP8 path does, else (or `by_bits`: the sm_80/86 path
    forced) by bit placement."""
    n, k = q.shape
    assert scale.shape == ((n + FP8_BLOCK - 1) // FP8_BLOCK, (k + FP8_BLOCK - 1) // FP8_BLOCK), "scale grid"
    assert FP8_BLOCK % BLOCK_N == 0 and BLOCK_K == FP8_BLOCK, "a program stays inside one scale block"
    w = torch.empty(n, k, dtype=dtype, device=q.device) if out is None else out
    assert w.shape == (n, k) and w.is_contiguous(), "out: a contiguous [N, K]"
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
    _dequant_kernel[grid](
        q.view(torch.uint8),
        scale,
        w,
        n,
        k,
        q.stride(0),
        scale.stride(0),
        w.stride(0),
        SCALE_BLOCK=FP8_BLOCK,
        BN=BLOCK_N,
        BK=BLOCK_K,
        HW_E4M3=hw_e4m3(q.device) and not by_bits,
    )
    return w
