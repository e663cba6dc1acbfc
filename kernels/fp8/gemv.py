"""The decode GEMV's piece kernel (fp8_linear.fp8_gemv for bf16/fp16 x): y[t] = x[t] @ W^T for W in e4m3 with one
fp32 scale per 128x128 block, W read in 8-byte pieces of its rows.

Tiles: a program takes BLOCK_N rows and walks its K range in steps of BLOCK_K columns = P pieces. A step is one
[P, BLOCK_N, 2] tensor of 32-bit words, so a thread holds whole pieces of every row of the program and, beside them,
the x of those pieces ([P, 1, 8]): the weights and x share one layout, nothing moves between threads until each
token's fp32 accumulator [P, BLOCK_N] is summed over P at the end. The words are loaded one step ahead.

Both maths convert a step's bytes once for every token: cvt.rn.f16x2.e4m3x2 turns two bytes into an fp16 pair
(4 instructions a piece). MATH "f16x2": fma.rn.f16x2 then takes two weights per instruction, 4 a piece and token
(lanes: even and odd columns), the lanes are added in fp16 and widened once, and one fp32 FMA applies the block
scale and 2^-s (below). MATH "f32": the pairs widened to fp32 and 8 fp32 FMAs a piece and token.

Range of the fp16 sums. x is multiplied per token and piece by a power of two 2^s that puts the piece's largest |x|
in [2^(X16_TOP - 1), 2^X16_TOP); bf16 x times 2^s is exact in fp16 down to fp16's normals. |e4m3| <= 448, so a
product is below 448 * 2^X16_TOP and a piece's sum of PIECE products below PIECE * 448 * 2^X16_TOP = 57344 with
X16_TOP = 4 (the largest exponent that stays under fp16's 65504; the partial sums' bounds i * 448 * 16 are fp16
values, so rounding cannot cross them). At the small end, the per-piece scale keeps each piece's own largest x at
8..16 whatever the token's range; what flushes (products below 2^-24) is under 2^-37 of the piece's largest
possible product, far below the bf16/fp16 output's precision. Block scales and 2^-s multiply in fp32.

On the GPU the piece maths is inline PTX; under TRITON_INTERPRET the same pairing (byte i of a word with x[i], lanes
of even and odd columns, lanes added in fp16) runs as plain integer and fp16 ops.

BY_BITS (GPUs without cvt.rn.f16x2.e4m3x2, sm_80 and sm_86): the pairs come from bit placement instead
(kernels/fp8/e4m3_bits.py), each weight times 2^-8, exact; x is scaled 2^8 higher (X16_TOP_BY_BITS), so every fp16
product and piece sum is the one the conversion instruction's pairs give, and the block scale takes the 2^8 back.
The f16x2 PTX (fma.rn.f16x2, cvt.rn.f16x2.f32) runs from sm_80.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton
from dsfp4.kernels.fp8.e4m3_bits import E4M3_F16_SHIFT, E4M3_F16_UNSCALE
from dsfp4.layout.fp4 import E4M3_MAX

# bytes (columns) of a row per thread and step: two 32-bit words
PIECE = 8
# e4m3 bytes per 32-bit word
WORD = 4
# x * 2^s < 2^X16_TOP per piece: PIECE products of |e4m3| <= 448 then sum below fp16's largest
X16_TOP = 4
F16_MAX = 65504.0
F32_EXP_BIAS = 127
F32_MANTISSA_BITS = 23
# biased exponent of 2^s = this minus that of the piece's largest |x|
UP_BIAS = X16_TOP + 2 * F32_EXP_BIAS - 1
# BY_BITS: weights placed at 2^-8 of their value meet x scaled 2^8 higher, for the same products
X16_TOP_BY_BITS = X16_TOP + E4M3_F16_SHIFT
UP_BIAS_BY_BITS = UP_BIAS + E4M3_F16_SHIFT
# biased exponents of 2^s and 2^-s add up to this
EXP_SUM = 2 * F32_EXP_BIAS
# 2^s, 2^-s stay normal fp32: biased exponents 1..253
EXP_MAX = 2 * F32_EXP_BIAS - 1
assert PIECE * E4M3_MAX * 2**X16_TOP <= F16_MAX, "a piece's fp16 sum could overflow"


def piece_ptx() -> str:
    """PTX of one piece and token: the fp16 pairs of its bytes (0, 1), (2, 3) in $1, (4, 5), (6, 7) in $2 (b64, the
    first pair lowest), x in $3 and $4 (four fp16 each, the first lowest); pair i meets x pair i in one fp16x2 FMA
    (lanes: even and odd columns); $0 = the lanes' fp16 sum, widened."""
    lines = ["{", ".reg .b32 acc, p<4>, x<4>;", ".reg .b16 l, h;", "mov.b64 {p0, p1}, $1;", "mov.b64 {p2, p3}, $2;"]
    lines += ["mov.b64 {x0, x1}, $3;", "mov.b64 {x2, x3}, $4;", "mul.rn.f16x2 acc, p0, x0;"]
    lines += [f"fma.rn.f16x2 acc, p{i}, x{i}, acc;" for i in range(1, 4)]
    lines += ["mov.b32 {l, h}, acc;", "add.rn.f16 l, l, h;", "cvt.f32.f16 $0, l;", "}"]
    return "\n".join(lines)


def x16_ptx(up_bias: int = UP_BIAS) -> str:
    """PTX of one piece's x for the f16x2 maths (_scale16 and _quads in one): fp32 x[0..7] in $3..$10 -> $0, $1:
    x * 2^s as fp16 quads (x[0..3], x[4..7], the first lowest), $2: 2^-s; up_bias: UP_BIAS, or UP_BIAS_BY_BITS."""
    lines = ["{", ".reg .f32 m, up, a<8>;", ".reg .b32 e, u, p<4>;"]
    lines += [f"abs.f32 a{i}, ${3 + i};" for i in range(PIECE)] + ["max.f32 m, a0, a1;"]
    lines += [f"max.f32 m, m, a{i};" for i in range(2, PIECE)]
    mant = F32_MANTISSA_BITS
    lines += ["mov.b32 e, m;", f"shr.u32 e, e, {mant};", f"sub.s32 u, {up_bias}, e;", "max.s32 u, u, 1;"]
    lines += [f"min.s32 u, u, {EXP_MAX};", f"shl.b32 e, u, {mant};", "mov.b32 up, e;", f"sub.s32 u, {EXP_SUM}, u;"]
    lines += [f"shl.b32 $2, u, {mant};"]
    lines += [f"mul.f32 a{i}, ${3 + i}, up;" for i in range(PIECE)]
    # a{2i} low
    lines += [f"cvt.rn.f16x2.f32 p{i}, a{2 * i + 1}, a{2 * i};" for i in range(PIECE // 2)]
    return "\n".join(lines + ["mov.b64 $0, {p0, p1};", "mov.b64 $1, {p2, p3};", "}"])


PAIRS_PTX = """{
.reg .b16 l, h;
mov.b32 {l, h}, $2;
cvt.rn.f16x2.e4m3x2 $0, l;
cvt.rn.f16x2.e4m3x2 $1, h;
}"""  # a word's bytes (0, 1) and (2, 3) as two fp16 pairs, the first byte in the low half


if triton is not None:
    from dsfp4.kernels.fp4.codes import fp16_low
    from dsfp4.kernels.fp8.e4m3_bits import e4m3_word_pairs

    _PIECE_PTX = tl.constexpr(piece_ptx())
    _X16_PTX = tl.constexpr(x16_ptx())
    _X16_PTX_BY_BITS = tl.constexpr(x16_ptx(UP_BIAS_BY_BITS))
    _PAIRS_PTX = tl.constexpr(PAIRS_PTX)
    _PIECE, _WORD, _MANT = tl.constexpr(PIECE), tl.constexpr(WORD), tl.constexpr(F32_MANTISSA_BITS)
    _UP_BIAS, _EXP_SUM, _EXP_MAX = tl.constexpr(UP_BIAS), tl.constexpr(EXP_SUM), tl.constexpr(EXP_MAX)
    _UP_BIAS_BY_BITS, _UNSCALE = tl.constexpr(UP_BIAS_BY_BITS), tl.constexpr(E4M3_F16_UNSCALE)

    @triton.jit
    def _bytes16(w):
        """u32 words [P, BN, W] -> their bytes as fp16 [P, BN, W, 4] (exact), byte 0 the lowest."""
        b = (w[:, :, :, None] >> (8 * tl.arange(0, _WORD))) & 0xFF
        return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)

    @triton.jit
    def _pairs(w, USE_ASM: tl.constexpr, BY_BITS: tl.constexpr):
        """u32 words [P, BN, 2] -> (bytes 0, 1 and bytes 2, 3 as fp16 pairs in u32 [P, BN, 2]), two bytes per cvt
        (BY_BITS: placed, each value * 2^-8). One return: Triton compiles the code after an early one, fp8 types
        and all."""
        if BY_BITS:
            lo, hi = e4m3_word_pairs(w)
        elif USE_ASM:
            lo, hi = tl.inline_asm_elementwise(
                _PAIRS_PTX, "=r,=r,r", [w], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1
            )
        else:
            b = _bytes16(w).to(tl.uint16, bitcast=True).to(tl.uint32)  # [P, BN, 2, 4]
            # of each pair
            first, second = tl.split(tl.reshape(b, (w.shape[0], w.shape[1], 2, 2, 2)))
            lo, hi = tl.split(first | (second << 16))
        return lo, hi

    @triton.jit
    def _piece_sums(lo, hi, xa, xb, USE_ASM: tl.constexpr):
        """Piece sums in fp16 products, widened: [P, BN] fp32 (lo, hi: _pairs; xa, xb: u64 [P, 1], the piece's x
        as fp16 quads)."""
        # words 0, 1 of the piece: [P, BN]
        lo0, lo1 = tl.split(lo)
        hi0, hi1 = tl.split(hi)
        if USE_ASM:
            a = lo0.to(tl.uint64) | (hi0.to(tl.uint64) << 32)
            b = lo1.to(tl.uint64) | (hi1.to(tl.uint64) << 32)
            return tl.inline_asm_elementwise(
                _PIECE_PTX, "=r,l,l,l,l", [a, b, xa, xb], dtype=tl.float32, is_pure=True, pack=1
            )
        pairs = tl.join(tl.join(lo0, lo1), tl.join(hi0, hi1))  # [P, BN, word, pair]
        w = tl.join(fp16_low(pairs), fp16_low(pairs >> 16))  # [P, BN, word, pair, lane]
        quads = tl.join(xa, xb)  # [P, 1, word]
        x = fp16_low(quads[:, :, :, None] >> (16 * tl.arange(0, _WORD)))  # [P, 1, word, 4]
        # rounded to fp16
        prod = w * tl.reshape(x, (xa.shape[0], 1, 2, 2, 2))
        # even, odd columns
        lanes = tl.sum(tl.reshape(prod, (lo0.shape[0], lo0.shape[1], _PIECE // 2, 2)), 2)
        even, odd = tl.split(lanes)
        return (even + odd).to(tl.float32)

    @triton.jit
    def _bytes_f32(lo, hi):
        """_pairs -> the bytes as fp32 [P, BN, 8], in memory order (exact)."""
        b = tl.join(tl.join(fp16_low(lo), fp16_low(hi)), tl.join(fp16_low(lo >> 16), fp16_low(hi >> 16)))
        # b: [P, BN, 2, 2, 2]
        return tl.reshape(b.to(tl.float32), (lo.shape[0], lo.shape[1], _PIECE))

    @triton.jit
    def _quads(x16):
        """fp16 [P, 1, 8] -> two u64 [P, 1]: x[0..3] and x[4..7] of each piece, the first lowest."""
        b = x16.to(tl.uint16, bitcast=True).to(tl.uint32)
        lo, hi = tl.split(tl.reshape(b, (x16.shape[0], 1, 4, 2)))
        pairs = (lo | (hi << 16)).to(tl.uint64)  # [P, 1, 4]: (x[2i], x[2i + 1])
        lo, hi = tl.split(tl.reshape(pairs, (x16.shape[0], 1, 2, 2)))
        return tl.split(lo | (hi << 32))

    @triton.jit
    def _scale16(x, UP_BIAS: tl.constexpr):
        """x: fp32 [P, 1, 8] -> (x * 2^s as fp16, 2^-s [P, 1]): per piece, largest |x| * 2^s in [2^(X16_TOP-1),
        2^X16_TOP) (UP_BIAS: _UP_BIAS, or 2^8 higher by _UP_BIAS_BY_BITS); zero and subnormal pieces take the
        largest 2^s (their products vanish anyway)."""
        m = tl.max(tl.abs(x), 2, keep_dims=True)  # [P, 1, 1]
        # biased exponent of the largest |x|
        e = (m.to(tl.int32, bitcast=True) >> _MANT) & 0xFF
        # tensors first: the interpreter
        up = tl.minimum(tl.maximum(-e + UP_BIAS, 1), _EXP_MAX)
        down = ((-up + _EXP_SUM) << _MANT).to(tl.float32, bitcast=True)
        return (x * (up << _MANT).to(tl.float32, bitcast=True)).to(tl.float16), tl.reshape(down, (x.shape[0], 1))

    @triton.jit
    def _x16(x, USE_ASM: tl.constexpr, BY_BITS: tl.constexpr):
        """x: fp32 [P, 1, 8] -> (xa, xb: u64 [P, 1], x * 2^s as _quads; 2^-s [P, 1]) as _scale16 scales it (BY_BITS:
        2^8 higher)."""
        if not USE_ASM:
            x16, down = _scale16(x, _UP_BIAS_BY_BITS if BY_BITS else _UP_BIAS)
            xa, xb = _quads(x16)
            return xa, xb, down
        ev, od = tl.split(tl.reshape(x, (x.shape[0], 1, 4, 2)))  # [P, 1, 4]: x[0, 2, 4, 6], x[1, 3, 5, 7]
        e04, e26 = tl.split(tl.reshape(ev, (x.shape[0], 1, 2, 2)))
        o15, o37 = tl.split(tl.reshape(od, (x.shape[0], 1, 2, 2)))
        x0, x4 = tl.split(e04)
        x2, x6 = tl.split(e26)
        x1, x5 = tl.split(o15)
        x3, x7 = tl.split(o37)
        return tl.inline_asm_elementwise(
            _X16_PTX_BY_BITS if BY_BITS else _X16_PTX,
            "=l,=l,=r" + ",r" * 8,
            [x0, x1, x2, x3, x4, x5, x6, x7],
            dtype=(tl.uint64, tl.uint64, tl.float32),
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def fp8_gemv_pieces_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        out_ptr,
        N,
        K,
        stride_xt,
        stride_qn,
        stride_sn,
        stride_ot,
        stride_os,
        k_split,
        T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        F16X2: tl.constexpr,
        USE_ASM: tl.constexpr,
        BY_BITS: tl.constexpr,
    ):
        """out[split, t, rows] = the split's K range of x[t] . W[rows] (out: y itself when there is one split).
        BLOCK_N divides SCALE_BLOCK, so a program's rows share one row of scales; K is a multiple of PIECE.
        BY_BITS: the weights widened by bit placement (no e4m3 instruction)."""
        P: tl.constexpr = BLOCK_K // _PIECE
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]; rows past N read row r % N, dropped at the store
        piece = tl.arange(0, P)[:, None, None] * _PIECE  # [P, 1, 1] a piece's first column in the step
        cols = piece + tl.arange(0, _PIECE)[None, None, :]  # [P, 1, 8]
        words = tl.arange(0, P)[:, None, None] * (_PIECE // _WORD) + tl.arange(0, _PIECE // _WORD)[None, None, :]
        w_rows = q_ptr.to(tl.pointer_type(tl.int32)) + (rows % N)[None, :, None] * (stride_qn // _WORD)  # [1, BN, 1]
        s_row = s_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_sn
        k_start = pid_s * k_split
        k_end = tl.minimum(k_start + k_split, K)
        # per token, per piece slot and row
        accs = (tl.zeros((P, BLOCK_N), dtype=tl.float32),) * T
        w = tl.load(w_rows + k_start // _WORD + words, mask=k_start + piece < k_end, other=0)  # [P, BN, 2]
        for k0 in range(k_start, k_end, BLOCK_K):
            live = k0 + piece < k_end  # [P, 1, 1]
            sb = tl.reshape(tl.load(s_row + (k0 + piece) // SCALE_BLOCK, mask=live, other=0.0), (P, 1))
            if BY_BITS:
                sb = sb * _UNSCALE
            # converted once for every token
            lo, hi = _pairs(w.to(tl.uint32, bitcast=True), USE_ASM, BY_BITS)
            if not F16X2:
                wf = _bytes_f32(lo, hi)  # [P, BN, 8]
            new = ()
            for t in tl.static_range(T):
                x = tl.load(x_ptr + t * stride_xt + k0 + cols, mask=live, other=0.0)  # [P, 1, 8]
                if F16X2:
                    xa, xb, down = _x16(x.to(tl.float32), USE_ASM, BY_BITS)
                    part = _piece_sums(lo, hi, xa, xb, USE_ASM) * (down * sb)
                else:
                    part = tl.sum(wf * x.to(tl.float32), 2) * sb
                new = new + (accs[t] + part,)
            accs = new
            # next step's words, issued last in the body: as the last load anchor, the words' layout is the one
            # Triton propagates to the piece maths (x follows it rather than the words following x)
            nxt = k0 + BLOCK_K
            w = tl.load(w_rows + nxt // _WORD + words, mask=nxt + piece < k_end, other=0)
        for t in tl.static_range(T):
            y = tl.sum(accs[t], 0)  # [BN]
            tl.store(out_ptr + pid_s * stride_os + t * stride_ot + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)
