"""y = x @ W^T with W in FP4 (NVFP4 or MXFP4) as stored in an expert record: codes and block scales are
decoded in registers, never written out as a dense copy.

`fp4_matmul` launches the Triton kernel; `fp4_matmul_ref` is the torch reference. Legend: T tokens,
N output rows, K input columns, G block (16 for NVFP4, 32 for MXFP4). A per-row global scale covers a
fused gate+up matrix whose halves may carry different NVFP4 global scales: rows below `split` use
g[0], the others g[1] (MXFP4: both 1).
"""

from __future__ import annotations

import torch

from dsfp4.layout.fp4 import MXFP4_BLOCK, NVFP4_BLOCK, e2m1_decode, e8m0_to_float, unpack_fp4

BLOCK_N = 64  # output rows per program
BLOCK_K_CHOICES = (128, 64, 32, 16)  # the largest that divides K is used

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton: the reference serves
    triton = None


def fp4_matmul_ref(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, split: int, fmt: str
) -> torch.Tensor:
    """x: [T, K] float, packed: [N, K/2] u8, scale: [N, K/G] u8 (e4m3 or e8m0 bytes), g: [2] f32 -> [T, N] f32."""
    block = NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK
    values = e2m1_decode(unpack_fp4(packed))  # [N, K]
    n, k = values.shape
    s = scale.view(torch.float8_e4m3fn).float() if fmt == "nvfp4" else e8m0_to_float(scale)
    w = (values.view(n, k // block, block) * s[..., None]).view(n, k)
    rows = torch.arange(n, device=w.device)
    w = w * torch.where(rows < split, g[0], g[1]).float()[:, None]
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
        g = tl.where(offs_n < split, tl.load(g_ptr), tl.load(g_ptr + 1))
        acc = acc * g[None, :]
        tl.store(y_ptr + offs_t[:, None] * stride_yt + offs_n[None, :], acc, mask=mask_t[:, None] & mask_n[None, :])


def fp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, split: int, fmt: str
) -> torch.Tensor:
    """Triton version of fp4_matmul_ref (same arguments, same result up to summation order)."""
    t, k = x.shape
    n = packed.shape[0]
    group = NVFP4_BLOCK if fmt == "nvfp4" else MXFP4_BLOCK
    block_k = next(b for b in BLOCK_K_CHOICES if k % b == 0 and b >= group)
    assert packed.shape[1] * 2 == k and scale.shape == (n, k // group), "record part shapes do not fit x"
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous().view(torch.uint8)
    y = torch.empty(t, n, dtype=torch.float32, device=x.device)
    block_t = 16 if t <= 16 else 32  # tl.dot needs >= 16 rows: decode pads its few tokens to 16
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, BLOCK_N))
    fp4_matmul_kernel[grid](
        x,
        packed,
        scale,
        g.float().contiguous(),
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
        BLOCK_N=64,
        BLOCK_K=block_k,
        GROUP=group,
        E8M0=fmt == "mxfp4",
    )
    return y
