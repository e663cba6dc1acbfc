"""y = x @ W^T with W in FP4 (NVFP4 or MXFP4) as stored in an expert record: codes and block scales are
decoded in registers, never written out as a dense copy.

`fp4_matmul` launches the Triton kernel; `fp4_matmul_ref` is the torch reference. Legend: T tokens,
N output rows, K input columns, G block (16 for NVFP4, 32 for MXFP4). A per-row global scale covers a
fused gate+up matrix whose halves may carry different NVFP4 global scales: rows below `split` use
g[0], the others g[1] (MXFP4: both 1).
"""

from __future__ import annotations

import torch

from dsfp4.layout.fp4 import MXFP4_BLOCK, NVFP4_BLOCK, mxfp4_dequantize, nvfp4_dequantize

BLOCK_N = 64  # output rows per program
BLOCK_K_CHOICES = (128, 64, 32, 16)  # the largest that divides K is used

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton: the reference serves
    triton = None


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

    @triton.jit
    def _decode_e2m1(codes):
        """4-bit codes -> fp32 values: sign, then 0.5 * m for exponent 0, else 2^(e-1) * (1 + m/2)."""
        e = (codes >> 1) & 3
        m = (codes & 1).to(tl.float32)
        normal = (1 << tl.maximum(e - 1, 0)).to(tl.float32) * (1.0 + 0.5 * m)
        mag = tl.where(e == 0, 0.5 * m, normal)
        return tl.where((codes & 8) != 0, -mag, mag)

    @triton.jit
    def _decode_scale(b, E8M0: tl.constexpr):
        """Scale bytes -> fp32, built from exponent bits so that every value is exact."""
        b = b.to(tl.int32)
        if E8M0:  # 2^(b - 127); byte 0 is the fp32 subnormal 2^-127
            return tl.where(b == 0, 2.0**-127, (b << 23).to(tl.float32, bitcast=True))
        ex = (b >> 3) & 15
        man = b & 7
        normal = (((b >> 7) << 31) | ((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        sub = man.to(tl.float32) * (1.0 / 512.0)  # e4m3 subnormals: m * 2^-9
        return tl.where(ex == 0, tl.where((b >> 7) != 0, -sub, sub), normal)

    @triton.jit
    def fp4_matmul_kernel(
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
    ):
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_t, mask_n = offs_t < T, offs_n < N
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=mask_n[:, None], other=0)
            codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))  # even element = low nibble
            offs_s = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            sbytes = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_s[None, :], mask=mask_n[:, None], other=0)
            scale = _decode_scale(sbytes, E8M0)  # [BLOCK_N, BLOCK_K / GROUP]
            w = tl.reshape(
                tl.reshape(_decode_e2m1(codes), (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None],
                (BLOCK_N, BLOCK_K),
            )
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :], mask=mask_t[:, None], other=0.0)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        if HAS_GLOBAL:  # NVFP4: one fp32 scale per row, g[0] below `split`, g[1] from it on
            g = tl.load(g_ptr + (offs_n >= split).to(tl.int32), mask=mask_n, other=0.0)
            acc = acc * g[None, :]
        tl.store(y_ptr + offs_t[:, None] * stride_yt + offs_n[None, :], acc, mask=mask_t[:, None] & mask_n[None, :])


def fp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor | None, split: int, fmt: str
) -> torch.Tensor:
    """Triton version of fp4_matmul_ref (same arguments, same result up to summation order)."""
    t, k = x.shape
    n = packed.shape[0]
    group = NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK
    block_k = next(b for b in BLOCK_K_CHOICES if k % b == 0 and b >= group)
    assert packed.shape[1] * 2 == k and scale.shape == (n, k // group), "record part shapes do not fit x"
    assert g is None or (g.dtype == torch.float32 and g.is_contiguous()), "global scales: contiguous fp32"
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous().view(torch.uint8)
    y = torch.empty(t, n, dtype=torch.float32, device=x.device)
    block_t = 16 if t <= 16 else 32  # tl.dot needs >= 16 rows: decode pads its few tokens to 16
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, BLOCK_N))
    fp4_matmul_kernel[grid](
        x,
        packed,
        scale,
        y if g is None else g,  # any pointer will do when there is no global scale
        y,
        t,
        n,
        k,
        split,
        x.stride(0),
        packed.stride(0),
        scale.stride(0),
        y.stride(0),
        BLOCK_T=block_t,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        GROUP=group,
        E8M0=fmt == "mxfp4",
        HAS_GLOBAL=g is not None,
    )
    return y
