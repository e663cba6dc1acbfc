"""y = x @ W^T with W in FP4 (NVFP4 or MXFP4) as stored in an expert record or a backbone tensor: codes and
block scales are decoded in registers (kernels/fp4/codes.py), never written out as a dense copy.

Byte j of a row holds elements 2j (low nibble) and 2j+1 (high nibble), so the kernels split x into its even
and odd elements instead of re-packing the weight. `fp4_matmul` launches one of two Triton kernels:
  - fp4_gemv_kernel (T <= GEMV_MAX_TOKENS): fp32 FMA. A program decodes BLOCK_N rows once per K step and
    applies them to every token; the block scale multiplies each G-element partial sum.
  - fp4_gemm_kernel (larger T): tl.dot over tiles of tokens. The MMA needs whole weights, so codes are
    scaled per element and rounded to bf16, which is exact (an e2m1 code times an e4m3 or power-of-two
    scale has at most 6 significant bits); fp16 activations are rounded to bf16 too. fp32 activations take
    an fp32 (ieee) dot instead, so that fp32 runs stay exact.
`fp4_matmul_ref` is the torch reference. Legend: T tokens, N output rows, K input columns, G block (16 for
NVFP4, 32 for MXFP4). A per-row global scale covers a fused gate+up matrix whose halves may carry
different NVFP4 global scales: rows below `split` use g[0], the others g[1] (MXFP4: none).
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import interpreted, tl, triton
from dsfp4.kernels.fp4.codes import E2M1_UNBIAS, block_scale, e2m1_halves
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.formats import get_format, next_pow2
from dsfp4.layout.fp4 import mxfp4_dequantize, nvfp4_dequantize

# beyond it tensor cores beat per-token FMA (kernels-limits 4.1)
GEMV_MAX_TOKENS = DECODE_TOKENS
# rows per GEMV program: many small programs keep the memory system busy
GEMV_BLOCK_N = 16
# elements per GEMV step (128 bytes of each row)
GEMV_MAX_BLOCK_K = 256
# from here 128-token tiles amortize each decoded weight tile over more tokens
GEMM_LARGE_T = 1024
GEMM_BLOCK_N = 64
GEMM_BLOCK_K = 128


def fp4_matmul_ref(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor | None, split: int, fmt: str
) -> torch.Tensor:
    """x: [T, K] float, packed: [N, K/2] u8, scale: [N, K/G] u8 (e4m3 or e8m0 bytes), g: fp32 global scales
    (rows below `split` take g[0], the rest g[1]; None: no global scale) -> [T, N] f32."""
    if fmt == "nvfp4":
        w = nvfp4_dequantize(packed, scale.view(torch.float8_e4m3fn), torch.ones((), device=packed.device))
    else:
        w = mxfp4_dequantize(packed, scale)
    if g is not None:
        w = w * g[(torch.arange(w.shape[0], device=w.device) >= split).long()][:, None]
    return x.float() @ w.T


if triton is not None:
    UNBIAS = tl.constexpr(E2M1_UNBIAS)

    @triton.jit
    def _decode_tile(
        w_ptr,
        s_ptr,
        rows,
        k0,
        K,
        stride_wn,
        stride_sn,
        BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """Elements k0..k0+BK of `rows`: (lo, hi) [BN, BK/2] e2m1 * 2^-14, the partners of x[2j] and x[2j+1];
        scale [BN, BK/G] fp32. Columns past K decode to zero."""
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=(cols < K // 2)[None, :], other=0)
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        sbytes = tl.load(
            s_ptr + rows[:, None] * stride_sn + groups[None, :], mask=(groups < K // GROUP)[None, :], other=0
        )
        lo, hi = e2m1_halves(packed, USE_ASM)
        return lo, hi, block_scale(sbytes, E8M0)

    @triton.jit
    def _store(acc, y_ptr, g_ptr, offs_t, offs_n, T, N, split, stride_yt, HAS_GLOBAL: tl.constexpr):
        """acc [BT, BN] of products with codes * 2^-14 -> y, with 2^14 and each row's global scale applied."""
        acc = acc * UNBIAS
        # NVFP4: one fp32 scale per row, g[0] below `split`, g[1] from it on
        if HAS_GLOBAL:
            acc = acc * tl.load(g_ptr + (offs_n >= split).to(tl.int32), mask=offs_n < N, other=0.0)[None, :]
        mask = (offs_t < T)[:, None] & (offs_n < N)[None, :]
        # int64: T * N may pass 2^31
        y_rows = y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt
        tl.store(y_rows + offs_n[None, :], acc, mask=mask)

    @triton.jit
    def fp4_gemv_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        y_ptr,
        T,
        N,
        K,
        split,
        stride_xt,
        stride_wn,
        stride_sn,
        stride_yt,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        HAS_GLOBAL: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows past N read row r % N, dropped at the store
        rows = offs_n % N
        lanes = tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            lo, hi, scale = _decode_tile(w_ptr, s_ptr, rows, k0, K, stride_wn, stride_sn, BLOCK_K, GROUP, E8M0, USE_ASM)
            cols = k0 + tl.arange(0, BLOCK_K)
            # the decoded weights stay in registers for every token
            for t in range(T):
                xv = tl.load(x_ptr + t * stride_xt + cols, mask=cols < K, other=0.0).to(tl.float32)
                # x[2j] meets the low nibble of byte j
                xe, xo = tl.split(tl.reshape(xv, (BLOCK_K // 2, 2)))
                part = tl.sum(
                    tl.reshape(lo * xe[None, :] + hi * xo[None, :], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), 2
                )
                acc += tl.where(lanes[:, None] == t, tl.sum(part * scale, 1)[None, :], 0.0)
        _store(acc, y_ptr, g_ptr, lanes, offs_n, T, N, split, stride_yt, HAS_GLOBAL)

    @triton.jit
    def fp4_gemm_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        y_ptr,
        T,
        N,
        K,
        split,
        stride_xt,
        stride_wn,
        stride_sn,
        stride_yt,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        HAS_GLOBAL: tl.constexpr,
        USE_ASM: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """IEEE: fp32 operands and products (fp32 activations, or the interpreter, which multiplies bf16 dot
        operands wrongly: there the operands are rounded to DOT_DTYPE first, as on the GPU)."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        # wrapped rows and tokens are dropped at the store
        rows = offs_n % N
        # int64: T * K may pass 2^31
        x_rows = x_ptr + (offs_t % T).to(tl.int64)[:, None] * stride_xt
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            lo, hi, scale = _decode_tile(w_ptr, s_ptr, rows, k0, K, stride_wn, stride_sn, BLOCK_K, GROUP, E8M0, USE_ASM)
            s = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)), lo.shape)
            w_lo, w_hi = (lo * s).to(DOT_DTYPE), (hi * s).to(DOT_DTYPE)  # [BN, BK/2], exact
            cols = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)  # [BT, BK]
            xe, xo = tl.split(tl.reshape(xv, (BLOCK_T, BLOCK_K // 2, 2)))  # [BT, BK/2] each
            xe, xo = xe.to(DOT_DTYPE), xo.to(DOT_DTYPE)
            if IEEE:
                acc = tl.dot(xe.to(tl.float32), tl.trans(w_lo.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xo.to(tl.float32), tl.trans(w_hi.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xe, tl.trans(w_lo), acc)
                acc = tl.dot(xo, tl.trans(w_hi), acc)
        _store(acc, y_ptr, g_ptr, offs_t, offs_n, T, N, split, stride_yt, HAS_GLOBAL)


def _block_k(k: int, group: int, most: int) -> int:
    """The K step: a power of two holding whole scale blocks, no larger than `most` nor than K needs."""
    return min(most, max(group, next_pow2(k)))


def _gemm_tiles(t: int, exact: bool) -> tuple[int, int, int]:
    """The GEMM's token rows per tile, warps and pipeline stages. The fp32 (exact) dot stages fp32 operands
    in shared memory: 32-row tiles and two stages (~70 KB) fit every GPU's."""
    if exact:
        return 32, 4, 2
    if t <= 32:
        return 32, 4, 3
    return (64, 4, 3) if t < GEMM_LARGE_T else (128, 8, 3)


def fp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor | None, split: int, fmt: str
) -> torch.Tensor:
    """Triton version of fp4_matmul_ref (same arguments, same result up to summation order; bf16/fp16
    activations beyond 16 tokens are multiplied as bf16)."""
    t, k = x.shape
    n = packed.shape[0]
    group = get_format(fmt).block[1]
    assert packed.shape[1] * 2 == k and scale.shape == (n, k // group), "record part shapes do not fit x"
    assert g is None or (g.dtype == torch.float32 and g.is_contiguous()), "global scales: contiguous fp32"
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous().view(torch.uint8)
    y = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    # any pointer serves when there is no g
    args = (x, packed, scale, y if g is None else g, y, t, n, k, split)
    args += (x.stride(0), packed.stride(0), scale.stride(0), y.stride(0))
    common = dict(GROUP=group, E8M0=fmt == "mxfp4", HAS_GLOBAL=g is not None, USE_ASM=not interpreted())
    if t <= GEMV_MAX_TOKENS:
        block_k = _block_k(k, group, GEMV_MAX_BLOCK_K)
        block_t = next_pow2(t)
        fp4_gemv_kernel[(triton.cdiv(n, GEMV_BLOCK_N),)](
            *args, BLOCK_T=block_t, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=block_k, **common
        )
        return y
    exact = x.dtype == torch.float32
    block_t, warps, stages = _gemm_tiles(t, exact)
    fp4_gemm_kernel[(triton.cdiv(t, block_t), triton.cdiv(n, GEMM_BLOCK_N))](
        *args,
        BLOCK_T=block_t,
        BLOCK_N=GEMM_BLOCK_N,
        BLOCK_K=_block_k(k, group, GEMM_BLOCK_K),
        DOT_DTYPE=tl.float32 if exact else tl.bfloat16,
        IEEE=exact or interpreted(),
        num_warps=warps,
        num_stages=stages,
        **common,
    )
    return y
