"""The decode GEMV on tensor cores (fp8_linear.fp8_gemv for bf16/fp16 x of GEMV_MMA_TOKENS tokens and more):
y[t] = x[t] @ W^T for W in e4m3 with one fp32 scale per 128x128 block.

The piece kernel (gemv.py) spends CUDA-core instructions per token, so its time grows with the tokens
(docs/BENCHMARKS.md, run 62). Here a program's step is one product on the tensor cores: x's
[BLOCK_T, SCALE_BLOCK] tile (tokens padded to 16 with zeros) and a [BLOCK_N, SCALE_BLOCK] tile of W widened to x's
dtype, exactly (every e4m3 value is a bf16 and an fp16 value), whose products are exact in the fp32 accumulator;
then the step's block scale. So its error is fp32 summation only, below the piece kernel's fp16 piece sums. Under
TRITON_INTERPRET the operands are fp32 (WIDE): the same products, which the interpreter gets right.
BY_BITS (no e4m3 instruction: sm_80, sm_86): W arrives as its bytes and is widened by bit placement
(kernels/fp8/e4m3_bits.py) to its values times 2^-8, still exact in bf16 and fp16; the block scale takes the 2^8 back.
Legend: T tokens, N output rows, K input columns.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton
from dsfp4.kernels.fp8.e4m3_bits import E4M3_F16_UNSCALE

if triton is not None:
    from dsfp4.kernels.fp8.e4m3_bits import e4m3_tile

    _UNSCALE = tl.constexpr(E4M3_F16_UNSCALE)

    @triton.jit
    def fp8_gemv_mma_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        out_ptr,
        T,
        N,
        K,
        stride_xt,
        stride_qn,
        stride_sn,
        stride_ot,
        stride_os,
        k_split,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        WIDE: tl.constexpr,
        BY_BITS: tl.constexpr,
    ):
        """out[split, t, rows] = the split's K range of x[t] . W[rows] (out: y itself when there is one split).
        BLOCK_N divides SCALE_BLOCK and k_split is a multiple of it, so a step's tile has one block scale a row.
        BY_BITS: q_ptr points at W's bytes (uint8)."""
        DOT: tl.constexpr = tl.float32 if WIDE else x_ptr.dtype.element_ty
        PRECISION: tl.constexpr = "ieee" if WIDE else "tf32"
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        toks = tl.arange(0, BLOCK_T)  # [BT]
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]; rows past N read row r % N, dropped at the store
        cols = tl.arange(0, SCALE_BLOCK)  # [BK]
        k_start = pid_s * k_split
        k_end = tl.minimum(k_start + k_split, K)
        x_rows = x_ptr + toks[:, None] * stride_xt  # [BT, 1]
        w_rows = q_ptr + (rows % N)[:, None] * stride_qn  # [BN, 1]
        s_row = s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sn
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, SCALE_BLOCK):
            live = k0 + cols < k_end  # [BK]
            x = tl.load(x_rows + k0 + cols[None, :], mask=(toks[:, None] < T) & live[None, :], other=0.0)  # [BT, BK]
            w = tl.load(w_rows + k0 + cols[None, :], mask=live[None, :], other=0.0)  # [BN, BK] e4m3 (BY_BITS: u8)
            sb = tl.load(s_row + k0 // SCALE_BLOCK)
            if BY_BITS:
                wd = e4m3_tile(w, DOT)
                sb = sb * _UNSCALE
            else:
                wd = w.to(DOT)
            # the same exact products in fp32 operands (Triton's interpreter cannot multiply bf16 tiles)
            acc += tl.dot(x.to(DOT), tl.trans(wd), input_precision=PRECISION) * sb  # [BT, BN]
        out = out_ptr + pid_s * stride_os + toks[:, None] * stride_ot + rows[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(toks[:, None] < T) & (rows < N)[None, :])
