"""e4m3 bytes widened by bit placement, for GPUs without the conversion instruction (sm_80, sm_86: the BY_BITS
path of kernels/backend.py) and never through Triton's fp8 types, which Triton refuses below sm_89.

e4m3fn is sign, 4 exponent bits (bias 7) and 3 mantissa bits; fp16 is sign, 5 exponent bits (bias 15) and 10. A byte
b placed as the fp16 bits (b & 0x80) << 8 | (b & 0x7F) << 7 puts the exponent field and the mantissa where fp16 has
them, so the fp16 reads b's value times 2^(7 - 15) = 2^-8: for normal codes (exponent field e >= 1) both are
2^(e - bias) (1 + m / 8), and the subnormal codes m * 2^-9 become fp16's subnormals m * 2^-17. Every code thus lands
exactly on value * 2^-8 (E4M3_F16_SCALE), all of them finite fp16 values (0x7F, e4m3fn's NaN, reads 1.875, but
quantized weights never hold it); the kernels fold 2^8 into the block scale. Widened to fp32, the values are normal
(>= 2^-17), and exact in bf16 too: a by-bits tile meets bf16 activations as (value * 2^-8) in bf16, never a bf16
subnormal, which tensor cores and Triton's interpreter would flush.

The other way, round_e4m3 rounds fp32 to the nearest e4m3 value by its bits, for Triton's interpreter, whose fp32 to
fp8 cast drops a mantissa carry (126.05 becomes 64, not 128): a value rounded first casts exactly.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton

# fp16's exponent bias minus e4m3's: a placed code reads value * 2^-E4M3_F16_SHIFT
E4M3_F16_SHIFT = 8
# what the kernels multiply the block scale by to undo the placement's 2^-8
E4M3_F16_UNSCALE = float(2**E4M3_F16_SHIFT)

if triton is not None:
    E4M3_MANTISSA_BITS = tl.constexpr(3)
    # smallest normal exponent; below it e4m3 steps by the subnormal 2^-9
    E4M3_MIN_EXP = tl.constexpr(-6)
    # 1.5 * 2^23: adding and subtracting it rounds |u| < 2^22 to an integer
    RINT = tl.constexpr(12582912.0)

    @triton.jit
    def round_e4m3(v):
        """fp32 v (|v| <= 448) -> the nearest e4m3 value (ties to even, sign kept), still in fp32. Rounding here
        makes the cast to fp8 exact: Triton's interpreter rounds that cast wrongly (it drops a mantissa carry)."""
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, E4M3_MIN_EXP)
        ulp_exp = e - E4M3_MANTISSA_BITS
        inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
        ulp = ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
        # ties to even, as IEEE addition rounds
        r = ((tl.abs(v) * inv_ulp + RINT) - RINT) * ulp
        # the sign bit set on r >= 0: -0.0 and values rounding to zero keep theirs (a negation compiled as 0 - r
        # drops it on the GPU)
        return (r.to(tl.int32, bitcast=True) | (bits & -(2**31))).to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_scale(amax, QMAX: tl.constexpr):
        """A row's (or group's) scale from its largest magnitude: amax / QMAX by IEEE division, 1 for all zeros."""
        return tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), 1.0)

    @triton.jit
    def e4m3_codes(x, scale, QMAX: tl.constexpr):
        """fp32 x / scale (IEEE division) clamped to +-QMAX, on e4m3's values (still fp32: the cast is then exact)."""
        v = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
        return round_e4m3(tl.minimum(tl.maximum(v, -QMAX), QMAX))

    @triton.jit
    def _place_pairs(t):
        """u32 t with two codes in bits 0-7 and 16-23 (the rest zero) -> the two fp16 placements in its halves."""
        return ((t & 0x00800080) << 8) | ((t & 0x007F007F) << 7)

    @triton.jit
    def e4m3_word_pairs(w):
        """u32 words of 4 codes [...] -> (bytes 0, 1 and bytes 2, 3 as fp16 pairs * 2^-8, u32 [...]), the first
        byte of a pair in the low half: what cvt.rn.f16x2.e4m3x2 gives, scaled by 2^-8."""
        lo = (w & 0xFF) | ((w & 0xFF00) << 8)
        hi = ((w >> 16) & 0xFF) | ((w >> 8) & 0xFF0000)
        return _place_pairs(lo), _place_pairs(hi)

    @triton.jit
    def e4m3_f16(b):
        """uint8 codes [...] -> fp16 [...], each value * 2^-8 (exact)."""
        b = b.to(tl.uint16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)

    @triton.jit
    def e4m3_tile(b, DTYPE: tl.constexpr):
        """uint8 codes [...] -> DTYPE (fp16, bf16 or fp32) [...], each value * 2^-8 (exact: bf16 through fp32, where
        the fp16 subnormals are normal)."""
        return e4m3_f16(b).to(DTYPE)
