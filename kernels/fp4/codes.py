"""Triton building blocks shared by the FP4 kernels: e2m1 codes and block scales decoded in registers.

A packed byte holds two e2m1 codes along K: the even element in the low nibble, the odd one in the high
nibble (layout/fp4.py). No weight is ever re-packed: the GEMVs split the activations instead (byte j of a
row multiplies x[2j] and x[2j+1]); the prefill GEMMs join both nibbles of a byte side by side.

Codes become floats by bit placement, sign to bit 15 and the three magnitude bits to bits 9..11 of an fp16
(e2m1_halves: exactly e2m1 * 2^-14, subnormal 0.5 included, so kernels multiply by E2M1_UNBIAS once per
output instead of once per weight) or to bits 6..8 of a bf16 (e2m1_bf16: e2m1 * 2^-126, see E4M3_LIFT). On
the GPU the placement runs as packed PTX (two prmt, then shifts and and/or on 16-bit pairs: 18 ops for 8 codes
in fp16, 14 in bf16); under TRITON_INTERPRET the same bits come from plain integer ops.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton

# 2^14: the fp16 placement's scale, folded into the epilogue
E2M1_UNBIAS = 16384.0
# e2m1_bf16 places codes as bf16 code * 2^-126 (0.5 the subnormal 2^-127). One bf16 product with an e4m3 scale
# lifted by 2^119 (at most 448 * 2^119 < 2^128) is code * scale * 2^-7 exactly: at most 6 significant bits, and
# from 0.5 * 2^-9 * 2^-7 up, all normal. e8m0 scales span 2^-127..2^127, so MXFP4 takes two products: 2^126, then
# the scale
E4M3_LIFT = 2.0**119
# 2^7, folded into the epilogue
E4M3_LIFT_UNBIAS = 128.0
E8M0_LIFT = 2.0**126
# words_sums' x: each token scaled by a power of two to a largest |x| in [2^14, 2^15)
X16_TOP_EXP = 15


def _words_ptx() -> str:
    """PTX of words_sums for two code words ($2, $3) and their x quads ($4, $5: x0 x4 x1 x5; $6, $7: x2 x6
    x3 x7, fp16): word << 4k holds the codes of elements 3 - k and 7 - k at the top of its two halves; sign
    to bit 15 and magnitude to bits 9-11 make them fp16 pairs (code * 2^-14) that meet (x[3-k], x[7-k]) in
    one fp16x2 FMA. The two lanes' sums, in fp32, go to both outputs."""
    lines = ["{", ".reg .b32 t, a, w, acc, p<4>;", ".reg .b16 l, h;", ".reg .f32 fl, fh;", "mov.b32 acc, 0;"]
    for i in range(2):
        lines += [f"mov.b64 {{p0, p1}}, ${4 + i};", f"mov.b64 {{p2, p3}}, ${6 + i};"]
        for k in range(4):
            lines += [f"shl.b32 t, ${2 + i}, {4 * k};", "and.b32 a, t, 0x70007000;", "shr.b32 a, a, 3;"]
            lines += ["and.b32 w, t, 0x80008000;", "or.b32 w, w, a;", f"fma.rn.f16x2 acc, w, p{3 - k}, acc;"]
    lines += ["mov.b32 {l, h}, acc;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;", "add.f32 $0, fl, fh;"]
    return "\n".join([*lines, "mov.b32 $1, $0;", "}"])


def _fp16_placement_ptx() -> str:
    """PTX placing the 8 codes of 4 bytes (b0..b3 in $4) as fp16 code * 2^-14: prmt spreads two bytes into the two
    halves of a register, then sign (bit 3 or 7) goes to bit 15 and magnitude (bits 0-2 or 4-6) to bits 9-11.
    $0, $1: low nibbles of b0 b1, b2 b3; $2, $3: their high nibbles."""
    lines = ["{", ".reg .b32 t01, t23, a, b;", "prmt.b32 t01, $4, 0, 0x4140;", "prmt.b32 t23, $4, 0, 0x4342;"]
    out = 0
    # the low nibble's bits, then the high nibble's (4 bits further up)
    for sign, mag in ((12, 9), (8, 5)):
        for t in ("t01", "t23"):
            lines += [f"shl.b32 a, {t}, {sign};", "and.b32 a, a, 0x80008000;", f"shl.b32 b, {t}, {mag};"]
            lines += ["and.b32 b, b, 0x0e000e00;", f"or.b32 ${out}, b, a;"]
            out += 1
    return "\n".join([*lines, "}"])


def _bf16_placement_ptx() -> str:
    """_fp16_placement_ptx's outputs for bf16 (sign to bit 15, magnitude to bits 6-8) in 14 ops for 8 codes, not 18:
    prmt puts b0 b1 (then b2 b3) in bytes 1 and 3 with zero bytes below them, so the low nibble's sign (bit 11)
    and magnitude (bits 8-10) reach bits 15 and 6-8 by shifts whose other bits land on zeros, and one and/or of
    three inputs merges them; the high nibble's sign is already at bit 15."""
    lines = ["{", ".reg .b32 t, a, b;"]
    for i, select in enumerate((0x1404, 0x3424)):
        lines += [f"prmt.b32 t, $4, 0, {select:#x};", "shl.b32 a, t, 4;", "shr.b32 b, t, 2;", "or.b32 a, a, b;"]
        lines += [f"and.b32 ${i}, a, 0x81C081C0;", "shr.b32 b, t, 6;", "and.b32 b, b, 0x01C001C0;"]
        lines += ["and.b32 a, t, 0x80008000;", f"or.b32 ${i + 2}, a, b;"]
    return "\n".join([*lines, "}"])


if triton is not None:
    # magnitude to bits 9-11: code * 2^-14 in fp16
    _FP16_PTX = tl.constexpr(_fp16_placement_ptx())
    # magnitude to bits 6-8: code * 2^-126 in bf16
    _BF16_PTX = tl.constexpr(_bf16_placement_ptx())

    @triton.jit
    def _placed(packed, PTX: tl.constexpr):
        """packed: uint8 [...] -> (low nibbles, high nibbles) as uint16 bit patterns, placed by PTX."""
        return tl.inline_asm_elementwise(
            PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.uint16, tl.uint16), is_pure=True, pack=4
        )

    @triton.jit
    def _placed_bits(packed, SIGN: tl.constexpr, MAG: tl.constexpr, UINT: tl.constexpr):
        """_placed's placement in plain integer ops of UINT (the interpreter's path): sign to bit SIGN, magnitude
        to bits MAG..MAG + 2."""
        lo, hi = (packed & 15).to(UINT), (packed >> 4).to(UINT)
        return ((lo & 8) << (SIGN - 3)) | ((lo & 7) << MAG), ((hi & 8) << (SIGN - 3)) | ((hi & 7) << MAG)

    @triton.jit
    def e2m1_halves(packed, USE_ASM: tl.constexpr):
        """packed: uint8 [...] -> (low nibbles, high nibbles) as fp32 [...], each e2m1 * 2^-14."""
        if USE_ASM:
            lo, hi = _placed(packed, _FP16_PTX)
        else:
            lo, hi = _placed_bits(packed, SIGN=15, MAG=9, UINT=tl.uint16)
        return lo.to(tl.float16, bitcast=True).to(tl.float32), hi.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def e2m1_bf16(packed, USE_ASM: tl.constexpr):
        """packed: uint8 [...] -> (low nibbles, high nibbles), each e2m1 * 2^-126: bf16 on the GPU, fp32 under the
        interpreter (which flushes bf16 subnormals; the same placement in fp32's fields)."""
        # one return below: Triton wants every return of a function to have the same type
        if USE_ASM:
            lo, hi = _placed(packed, _BF16_PTX)
            lo, hi = lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True)
        else:
            lo, hi = _placed_bits(packed, SIGN=31, MAG=22, UINT=tl.uint32)
            lo, hi = lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
        return lo, hi

    _WORDS_PTX = tl.constexpr(_words_ptx())

    @triton.jit
    def fp16_low(v):
        """The fp16 in the low 16 bits of an unsigned integer."""
        return (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)

    @triton.jit
    def words_sums(words, xa, xb, USE_ASM: tl.constexpr):
        """Sums of code * 2^-14 * x per 8-byte piece of FP4 rows, in fp16 products: [R, BW / 2] fp32 (words:
        i32 [R, BW] as loaded, 8 codes each; xa, xb: i64 [1, BW], the pieces' x quads as X16_TOP_EXP scaling and
        the 0 4 1 5 2 6 3 7 order leave them). No byte is unpacked: about half the instructions of
        e2m1_halves and fp32 FMAs (docs/BENCHMARKS.md, the probes of the decode MoE)."""
        R: tl.constexpr = words.shape[0]
        NP: tl.constexpr = words.shape[1] // 2
        if USE_ASM:
            y = tl.inline_asm_elementwise(
                _WORDS_PTX, "=r,=r,r,r,l,l,l,l", [words, xa, xb], dtype=tl.float32, is_pure=True, pack=2
            )
            # a piece's two outputs are equal
            return tl.max(tl.reshape(y, (R, NP, 2)), 2)
        w = words.to(tl.uint32, bitcast=True)
        xa, xb = xa.to(tl.uint64, bitcast=True), xb.to(tl.uint64, bitcast=True)
        acc = tl.zeros(words.shape, tl.float16)
        for k in tl.static_range(4):
            t = w << (4 * k)
            o = (t & 0x80008000) | ((t & 0x70007000) >> 3)
            # x[3 - k], x[7 - k]
            x = (xb if k < 2 else xa) >> (32 * ((k + 1) % 2))
            acc += fp16_low(o) * fp16_low(x) + fp16_low(o >> 16) * fp16_low(x >> 16)
        return tl.sum(tl.reshape(acc, (R, NP, 2)), 2).to(tl.float32)

    @triton.jit
    def block_scale(b, E8M0: tl.constexpr, HW_E4M3: tl.constexpr = False):
        """Scale bytes -> fp32, exact: e4m3 (NVFP4; by the GPU's conversion instruction with HW_E4M3, else
        from exponent bits) or e8m0 = 2^(b - 127) (MXFP4, byte 0 being the fp32 subnormal 2^-127)."""
        if HW_E4M3 and not E8M0:
            return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b = b.to(tl.int32)
        if E8M0:
            return tl.where(b == 0, 2.0**-127, (b << 23).to(tl.float32, bitcast=True))
        ex = (b >> 3) & 15
        man = b & 7
        normal = (((b >> 7) << 31) | ((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        # e4m3 subnormals: m * 2^-9
        sub = man.to(tl.float32) * (1.0 / 512.0)
        return tl.where(ex == 0, tl.where((b >> 7) != 0, -sub, sub), normal)

    @triton.jit
    def rounded(v, DTYPE: tl.constexpr, EMULATE_RNE: tl.constexpr):
        """fp32 -> DTYPE. The interpreter truncates fp32 to bf16; adding half an ulp (ties to even) to the bits
        first gives the GPU's rounding for every finite value."""
        if EMULATE_RNE:
            bits = v.to(tl.uint32, bitcast=True)
            v = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
        return v.to(DTYPE)
