"""Activations in MXFP8 for the FP4 tensor-core prefill (prefill_mma.py): each row cut into blocks of GROUP
elements, each block e4m3 codes times a power-of-two scale 2^(s - 127) held as an e8m0 byte s (OCP microscaling),
the form tl.dot_scaled takes beside MXFP4 weights.

The scale is the least power of two that brings the block's largest magnitude within e4m3's 448, so no code
saturates; it is read off amax's fp32 bits (its exponent, and whether its significand passes 1.75 = 448 / 2^8),
never divided for, so torch and Triton choose the same. A code is x * 2^-scale rounded to nearest even: torch's
own conversion in the reference, integer rounding of the fp32 bits in the kernel (the interpreter's fp8 conversion
truncates subnormals, and it runs the same on every card). Legend: N rows, K columns, G = GROUP.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import tl, triton

# elements per e8m0 scale: what tl.dot_scaled's e4m3 and e2m1 operands take
GROUP = 32
# e4m3's largest finite value is 1.75 * 2^8: a block whose amax passes 1.75 * 2^E takes the scale 2^(E - 7)
E4M3_MAX_EXP = 8
E4M3_MAX_SIGNIFICAND = 0x600000  # 0.75 in fp32's 23 mantissa bits
MANTISSA_BITS = 23
MANTISSA_MASK = (1 << MANTISSA_BITS) - 1
# e8m0 byte 0 (2^-127) some Triton versions decode as 0 (triton-lang/triton#11624), and 255 is NaN: blocks of
# tinier amax (below 2^-118) take 2^-126, whose codes round to 0 as they would anyway
SCALE_MIN, SCALE_MAX = 1, 254
# fp32 exponent field of 2^(127 - s): 2^-scale for the e8m0 byte s
INV_FIELD = 254
# e4m3: 3 mantissa bits, exponent bias 7; below 2^-6 subnormals of quantum 2^-9
E4M3_MANT = 3
E4M3_BIAS = 7
E4M3_MIN_NORMAL_EXP = -6
FP32_BIAS = 127
# a shift past the significand's 24 bits leaves 0
SHIFT_MAX = MANTISSA_BITS + 2
# rows of a program, and blocks of GROUP columns
BLOCK_ROWS = 16
BLOCK_GROUPS = 4


def scale_bytes_ref(amax: torch.Tensor) -> torch.Tensor:
    """amax: [...] fp32 >= 0 -> the e8m0 bytes [...] int32 of the least power of two 2^e with amax <= 448 * 2^e."""
    bits = amax.float().view(torch.int32)
    field, significand = bits >> MANTISSA_BITS, bits & MANTISSA_MASK
    scale = field - E4M3_MAX_EXP + (significand > E4M3_MAX_SIGNIFICAND).int()
    return scale.clamp(SCALE_MIN, SCALE_MAX)


def mxfp8_quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, K] float, K a multiple of GROUP -> (codes [N, K] u8 e4m3, scales [N, K/G] u8 e8m0)."""
    n, k = x.shape
    blocks = x.float().reshape(n, k // GROUP, GROUP)
    scale = scale_bytes_ref(blocks.abs().amax(-1))  # [N, K/G]
    inv = ((INV_FIELD - scale) << MANTISSA_BITS).view(torch.float32)  # 2^-scale, exact
    codes = (blocks * inv[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(n, k), scale.to(torch.uint8)


def mxfp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes: [N, K] u8 e4m3, scales: [N, K/G] u8 e8m0 -> values [N, K] in dtype (exact in fp32 and bf16)."""
    n, k = codes.shape
    values = codes.view(torch.float8_e4m3fn).float().reshape(n, k // GROUP, GROUP)
    scale = (scales.int() << MANTISSA_BITS).view(torch.float32)  # 2^(s - 127), s >= SCALE_MIN: normal
    return (values * scale[..., None]).reshape(n, k).to(dtype)


def mxfp8_round(x: torch.Tensor) -> torch.Tensor:
    """x: [N, K] -> its MXFP8 values [N, K] in x's dtype: what the kernels multiply in its place."""
    return mxfp8_dequantize(*mxfp8_quantize_ref(x), dtype=x.dtype)


if triton is not None:
    _MANT_BITS, _MANT_MASK, _E4M3_MANT = (
        tl.constexpr(MANTISSA_BITS),
        tl.constexpr(MANTISSA_MASK),
        tl.constexpr(E4M3_MANT),
    )
    _MIN_NORMAL, _E4M3_BIAS, _FP32_BIAS = (
        tl.constexpr(E4M3_MIN_NORMAL_EXP),
        tl.constexpr(E4M3_BIAS),
        tl.constexpr(FP32_BIAS),
    )
    _MAX_EXP, _MAX_SIG = tl.constexpr(E4M3_MAX_EXP), tl.constexpr(E4M3_MAX_SIGNIFICAND)
    _SMIN, _SMAX, _INV, _SHIFT_MAX = (
        tl.constexpr(SCALE_MIN),
        tl.constexpr(SCALE_MAX),
        tl.constexpr(INV_FIELD),
        tl.constexpr(SHIFT_MAX),
    )
    _GROUP = tl.constexpr(GROUP)
    # the significand's leading 1, and the shift that keeps 3 mantissa bits of a normal
    _LEAD, _NORMAL_SHIFT = tl.constexpr(1 << MANTISSA_BITS), tl.constexpr(MANTISSA_BITS - E4M3_MANT)

    @triton.jit
    def _rne_shift(m, shift):
        """m >> shift, rounded to nearest even (shift >= 1, int32)."""
        one = m * 0 + 1
        q = m >> shift
        rem = m & ((one << shift) - 1)
        half = one << (shift - 1)
        return q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)

    @triton.jit
    def e4m3_bits(v):
        """fp32 v with |v| <= 448 -> its e4m3 code (int32, 0..255), rounded to nearest even, subnormals included."""
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        field = (bits >> _MANT_BITS) & 0xFF
        e = field - _FP32_BIAS
        m = (bits & _MANT_MASK) | _LEAD  # the significand with its leading 1
        # normals keep 3 mantissa bits; a subnormal one bit fewer per binade below 2^-6 (below 2^-10: 0)
        shift = tl.maximum(e * -1 + _MIN_NORMAL, 0) + _NORMAL_SHIFT
        q = _rne_shift(m, tl.minimum(shift, _SHIFT_MAX))
        # q is the code's significand with its leading 1 at bit 3 (a carry to 16 is the next exponent's 8)
        biased = tl.maximum(e + _E4M3_BIAS, 1) - 1
        code = tl.where(field == 0, 0, (biased << _E4M3_MANT) + q)
        return sign | code

    @triton.jit
    def mxfp8_kernel(x_ptr, q_ptr, s_ptr, n_rows, K: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr):
        """x [N, K] -> codes q [N, K] u8 and scales s [N, K/G] u8 for BR rows (pid 0) by BG blocks (pid 1)."""
        G: tl.constexpr = _GROUP
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        g = tl.program_id(1) * BG + tl.arange(0, BG)
        inside = (r < n_rows)[:, None] & (g < K // G)[None, :]  # [BR, BG]
        cols = g[:, None] * G + tl.arange(0, G)[None, :]  # [BG, G]
        at = r.to(tl.int64)[:, None, None] * K + cols[None, :, :]  # [BR, BG, G]
        x = tl.load(x_ptr + at, mask=inside[:, :, None], other=0.0).to(tl.float32)
        bits = tl.max(tl.abs(x), axis=2).to(tl.int32, bitcast=True)  # [BR, BG]
        scale = (bits >> _MANT_BITS) - _MAX_EXP + ((bits & _MANT_MASK) > _MAX_SIG).to(tl.int32)
        scale = tl.minimum(tl.maximum(scale, _SMIN), _SMAX)
        inv = ((scale * -1 + _INV) << _MANT_BITS).to(tl.float32, bitcast=True)
        codes = e4m3_bits(x * inv[:, :, None])
        tl.store(q_ptr + at, codes.to(tl.uint8), mask=inside[:, :, None])
        tl.store(s_ptr + r.to(tl.int64)[:, None] * (K // G) + g[None, :], scale.to(tl.uint8), mask=inside)


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp8_quantize_ref's codes and scales from the Triton kernel (CUDA, or the CPU under TRITON_INTERPRET)."""
    n, k = x.shape
    assert k % GROUP == 0, f"MXFP8 rows hold whole blocks of {GROUP}"
    x = x.contiguous()
    codes = torch.empty(n, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, k // GROUP, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(n, BLOCK_ROWS), triton.cdiv(k // GROUP, BLOCK_GROUPS))
    mxfp8_kernel[grid](x, codes, scales, n, K=k, BR=BLOCK_ROWS, BG=BLOCK_GROUPS)
    return codes, scales
