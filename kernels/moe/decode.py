"""The decode MoE kernels: a few tokens' routed experts straight from FP4 records, in a few small launches.

  0. (bf16 and fp16 x, words) x scaled per token by a power of two, in fp16, permuted to meet whole code words;
     from 2 tokens on, one more program writes the plan: each expert's run (the pairs that chose it) for 1 and 2.
  1. gate+up: a program per (pair, BN1 rows of the expert width). Only the first pair to choose an expert
     works: it reads the expert's rows once for every token that chose it (its run) and writes
     silu(gate) * up * routing weight to an fp32 row per pair, even elements first, so launch 2 loads
     each half contiguously (in order when down takes the words: step 1b prepares them).
  1b. (down on the words) each pair's activation row scaled, fp16 and permuted the way step 0 does x.
  2. down: a program per (pair, BN2 rows of the model dim), the same way: W2 rows times each run pair's
     activation, an fp32 output row per pair.
  3. combine: the sum over a token's K pairs in fp32, in slot order (no atomics, the same bits on every run),
     rounded to x's dtype, plus an optional addend (the shared experts' output) rounded again: a program per
     (token, BN3 columns), so that one token's row still spreads over the SMs.
Either product multiplies in fp32, or in fp16 products on the code words as loaded (fp4_decode.words_sums:
about half the instructions per byte; relative error ~6e-4) when DecodeConfig asks for it, except for fp32
x, the exact runs. A pair's run of one (every run at one token) takes a straight loop over its chunks.
Experts are found on the device through `offsets` (kernels/moe/ref.py), so routing needs no host sync and
the launches can be captured in a CUDA graph. Records in pinned host memory are read over PCIe (zero-copy).
A single persistent launch with a grid-wide barrier between the phases was measured slower on the H100
(docs/BENCHMARKS.md): its fixed programs balance worse than the hardware's scheduling of many small ones.
Legend: T tokens, K experts per token, D dim, I expert width, G scale block, P = T * K pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dsfp4.kernels.backend import DECODE_TOKENS, WARP, hw_e4m3, interpreted, tl, triton
from dsfp4.kernels.fp4.codes import E2M1_UNBIAS, X16_TOP_EXP, block_scale, e2m1_halves, rounded, words_sums
from dsfp4.kernels.moe.ref import ABSENT
from dsfp4.layout.formats import get_format, next_pow2
from dsfp4.layout.record import RecordLayout

WORD_PAIR = 2  # code words per words_sums PTX call
LOAD_FP32 = 4  # fp32 elements per 16-byte load: combine gives each thread one such load per pair
MAX_TOKENS = DECODE_TOKENS  # tokens per call: beyond this, tokens grouped by expert on tensor cores (moe_prefill) win

if triton is not None:
    from dsfp4.kernels.swiglu import swiglu_tl

    _ABSENT = tl.constexpr(ABSENT)  # kernels read globals only as constexpr
    _UNBIAS = tl.constexpr(E2M1_UNBIAS)
    _X16_TOP_EXP = tl.constexpr(X16_TOP_EXP)

    @triton.jit
    def _pick(vec, lane, i):
        """vec[i] as a scalar (vec: a small register vector, lane: its arange)."""
        return tl.sum(tl.where(lane == i, vec, 0), axis=0)

    @triton.jit
    def _chunk(wrow, srow, kb, GROUP: tl.constexpr, BK: tl.constexpr, MASK, WORDS: tl.constexpr = False):
        """Code bytes [R, BK/2] (WORDS: i32 code words [R, BK/8]) and scale bytes [R, BK/G] of the chunk starting
        at byte kb of FP4 rows (zeros where MASK is false). Counting in bytes keeps the loads' 16-byte alignment
        visible to Triton."""
        E: tl.constexpr = 4 if WORDS else 1  # bytes per element loaded
        cols = tl.arange(0, BK // (2 * E))[None, :]
        groups = tl.arange(0, BK // GROUP)[None, :]
        live = tl.where(MASK, BK, 0)  # masks built by comparison: the interpreter rejects a broadcast scalar one
        rows = wrow.to(tl.pointer_type(tl.int32)) if WORDS else wrow
        packed = tl.load(rows + kb // E + cols, mask=cols < live, other=0)
        sb = tl.load(srow + kb // (GROUP // 2) + groups, mask=groups < live, other=0)
        return packed, sb

    @triton.jit
    def _group_sums(packed, xe, xo, GROUP: tl.constexpr, USE_ASM: tl.constexpr):
        """Per scale block, sum of code * x over the block: [R, BK/G] (x: [BK/2] halves; the reduction stays
        inside each thread's registers, so the block scale costs one multiply per G weights)."""
        R: tl.constexpr = packed.shape[0]
        NB: tl.constexpr = 2 * packed.shape[1] // GROUP
        lo, hi = e2m1_halves(packed, USE_ASM)
        return tl.sum(tl.reshape(lo * xe[None, :] + hi * xo[None, :], (R, NB, GROUP // 2)), 2)

    @triton.jit
    def _x_quads(xq_row, kb, BK: tl.constexpr):
        """The x quads (i64 [1, BK/8] twice) that meet the code words of the chunk at byte kb."""
        i = (kb // 4 + tl.arange(0, BK // 8))[:, None] * 2 + tl.arange(0, 2)[None, :]
        xa, xb = tl.split(tl.load(xq_row + i))
        return xa[None, :], xb[None, :]

    @triton.jit
    def _block_sums(
        packed, xrow, kb, XS: tl.constexpr, ODD: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr,
        WORDS: tl.constexpr, USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """Per scale block, sum of code * x over the chunk at byte kb (from _chunk): [R, BK/G], before the
        global scale and 2^14. Bytes: fp32 products, byte j's low nibble meeting xrow[j * XS], its high one
        ODD further. WORDS: fp16 products on the x quads of xrow (i64, from _scaled_quads: still times 2^s)."""
        R: tl.constexpr = packed.shape[0]
        if WORDS:  # if/else, not an early return: the compiler would still build the code after it
            xa, xb = _x_quads(xrow, kb, BK)
            pieces = words_sums(packed, xa, xb, USE_ASM)  # [R, BK / 16]
            sums = tl.sum(tl.reshape(pieces, (R, BK // GROUP, GROUP // 16)), 2)
        else:
            j = (kb + tl.arange(0, BK // 2)) * XS
            xe = tl.load(xrow + j).to(tl.float32)
            xo = tl.load(xrow + j + ODD).to(tl.float32)
            sums = _group_sums(packed, xe, xo, GROUP, USE_ASM)
        return sums

    @triton.jit
    def _rows_dot(
        wrow, srow, xrow, XS: tl.constexpr, ODD: tl.constexpr, KDIM: tl.constexpr, GROUP: tl.constexpr,
        E8M0: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr, USE_ASM: tl.constexpr, HW_E4M3: tl.constexpr,
    ):  # fmt: skip
        """sum_k W[r, k] x[k] for FP4 rows (wrow, srow: [R, 1] row pointers to codes and scale bytes) and one
        activation row (xrow, read as _block_sums does), before the global scale and 2^14: [R]. The next chunk
        is loaded before this one is computed."""
        R: tl.constexpr = wrow.shape[0]
        acc = tl.zeros((R, BK // GROUP), dtype=tl.float32)  # reduced once at the end, not per chunk
        packed, sb = _chunk(wrow, srow, 0, GROUP, BK, True, WORDS)
        for kb in range(0, KDIM // 2, BK // 2):
            nxt, nsb = _chunk(wrow, srow, kb + BK // 2, GROUP, BK, kb + BK // 2 < KDIM // 2, WORDS)
            acc += _block_sums(packed, xrow, kb, XS, ODD, GROUP, BK, WORDS, USE_ASM) * block_scale(sb, E8M0, HW_E4M3)
            packed, sb = nxt, nsb
        return tl.sum(acc, 1)

    @triton.jit
    def _rows_dot_run(
        wrow, srow, src, stride, qs, lanes, n_run,
        ROW_DIV: tl.constexpr, XS: tl.constexpr, ODD: tl.constexpr, KDIM: tl.constexpr, GROUP: tl.constexpr,
        E8M0: tl.constexpr, BK: tl.constexpr, RUN_PAD: tl.constexpr, WORDS: tl.constexpr, USE_ASM: tl.constexpr,
        HW_E4M3: tl.constexpr,
    ):  # fmt: skip
        """_rows_dot for the n_run pairs qs of a run, each weight chunk loaded once for all of them: [RUN_PAD, R].
        Pair q reads row q // ROW_DIV of `src` (stride elements apart). Only the words load a chunk ahead (the
        bytes' fp32 run spends its registers: 128 a thread at 32 rows x 128 B, 167 with the chunk ahead)."""
        R: tl.constexpr = wrow.shape[0]
        acc = tl.zeros((RUN_PAD, R), dtype=tl.float32)
        AHEAD: tl.constexpr = BK // 2 if WORDS else 0  # bytes per row loaded ahead
        packed, sb = _chunk(wrow, srow, 0, GROUP, BK, True, WORDS)
        for kb in range(0, KDIM // 2, BK // 2):
            nxt, nsb = _chunk(wrow, srow, kb + AHEAD, GROUP, BK, kb + AHEAD < KDIM // 2, WORDS)
            if AHEAD == 0:
                packed, sb = nxt, nsb
            s = block_scale(sb, E8M0, HW_E4M3)
            for i in range(n_run):
                row = src + (_pick(qs, lanes, i) // ROW_DIV) * stride
                dot = tl.sum(_block_sums(packed, row, kb, XS, ODD, GROUP, BK, WORDS, USE_ASM) * s, 1)  # [R]
                acc += tl.where(lanes[:, None] == i, dot[None, :], 0.0)
            packed, sb = nxt, nsb
        return acc

    @triton.jit
    def _unscale(dot, inv_ptr, row, WORDS: tl.constexpr):
        """dot times row's 2^-s where the words read its x scaled by _scaled_quads."""
        if WORDS:
            dot = dot * tl.load(inv_ptr + row)
        return dot

    @triton.jit
    def _plan(ids_ptr, plan_ptr, n_pairs, P_PAD: tl.constexpr, RUN_PAD: tl.constexpr):
        """Every pair's run, found once for both launches: row p of plan [P, 1 + RUN_PAD] holds how many pairs chose
        p's expert if p is the first of them (its leader), else 0, then (leader rows) those pairs in order."""
        p = tl.arange(0, P_PAD)
        live = p < n_pairs
        e = tl.load(ids_ptr + p, mask=live, other=-1)
        match = (e[:, None] == e[None, :]) & live[:, None] & live[None, :]  # [P_PAD, P_PAD]: same expert
        rank = tl.sum((match & (p[None, :] < p[:, None])).to(tl.int32), 1)  # p's position in its run
        lead = tl.min(tl.where(match, p[None, :], P_PAD), 1)  # its run's first pair
        n_run = tl.sum(match.to(tl.int32), 1)
        tl.store(plan_ptr + p * (1 + RUN_PAD), tl.where(rank == 0, n_run, 0), mask=live)
        tl.store(plan_ptr + lead * (1 + RUN_PAD) + 1 + rank, p, mask=live & (rank < RUN_PAD))  # in its row, always

    @triton.jit
    def _scaled_quads(src, dst, inv_ptr, D: tl.constexpr, BD: tl.constexpr):
        """A row of D elements at src for words_sums at dst: times 2^s (largest |x| in [2^14, 2^15): no fp16 product
        overflows or loses much to subnormals), fp16, each 8 elements in the order 0 4 1 5 2 6 3 7; 2^-s at inv_ptr."""
        i = tl.arange(0, BD)
        x = tl.load(src + i, mask=i < D, other=0).to(tl.float32)
        s = tl.floor(-tl.log2(tl.maximum(tl.max(tl.abs(x), 0), 1e-30)) + _X16_TOP_EXP)
        dest = i - i % 8 + 2 * (i % 4) + (i % 8) // 4
        tl.store(dst + dest, (x * tl.exp2(s)).to(tl.float16), mask=i < D)
        tl.store(inv_ptr, tl.exp2(-s))

    @triton.jit
    def _prep_kernel(
        x_ptr, stride_xt, xq_ptr, inv_ptr, n_rows, ids_ptr, plan_ptr, n_pairs,
        D: tl.constexpr, BD: tl.constexpr, P_PAD: tl.constexpr, RUN_PAD: tl.constexpr,
    ):  # fmt: skip
        """Launch 0: programs below n_rows prepare row t of x (_scaled_quads); one program after them, when
        launched, writes the plan (_plan): in this launch, as a launch of its own it cost 2.5 us more."""
        t = tl.program_id(0)
        if t < n_rows:
            _scaled_quads(x_ptr + t * stride_xt, xq_ptr + t * D, inv_ptr + t, D, BD)
        else:
            _plan(ids_ptr, plan_ptr, n_pairs, P_PAD, RUN_PAD)

    @triton.jit
    def _act_prep_kernel(act_ptr, act_q_ptr, act_inv_ptr, INTER: tl.constexpr, BI: tl.constexpr):
        """Launch 1b: pair p's activation row for down's words (_scaled_quads)."""
        p = tl.program_id(0)
        _scaled_quads(act_ptr + p * INTER, act_q_ptr + p * INTER, act_inv_ptr + p, INTER, BI)

    @triton.jit
    def _run(ids_ptr, plan_ptr, p, RUN_PAD: tl.constexpr):
        """Expert e of pair p; whether p is the first pair to choose it; the pairs that chose it (its run,
        qs [RUN_PAD]) and how many (a token picks an expert once, so at most one pair per token)."""
        e = tl.load(ids_ptr + p).to(tl.int32)
        lanes = tl.arange(0, RUN_PAD)
        if RUN_PAD == 1:  # one token: every pair is its own run and leads it, no plan
            leader, qs, n_run = tl.full((), 1, tl.int1), lanes + p, tl.full((), 1, tl.int32)  # constants fold
        else:  # from _plan: thousands of programs each scanning every pair cost 5% of the time at 8 tokens, 12% at 16
            row = plan_ptr + p * (1 + RUN_PAD)
            n_run = tl.load(row)
            qs = tl.load(row + 1 + lanes)
            leader = n_run > 0
        return e, leader, qs, lanes, n_run

    @triton.jit
    def _emit(act_ptr, rw_ptr, q, dot, dest, g_gate, g_up, INTER: tl.constexpr, LIMIT: tl.constexpr):
        """Pair q's gate and up rows (dot: [2 BN], gate rows first) -> silu(gate) * up * its weight, at dest."""
        BN: tl.constexpr = dot.shape[0] // 2
        gate, up = tl.split(tl.permute(tl.reshape(dot, (2, BN)), (1, 0)))
        tl.store(act_ptr + q * INTER + dest, swiglu_tl(gate * g_gate, up * g_up, LIMIT) * tl.load(rw_ptr + q))

    @triton.jit
    def _gate_up_kernel(
        x_ptr, xq_ptr, inv_ptr, ids_ptr, plan_ptr, rw_ptr, rec_ptr, off_ptr, act_ptr, stride_xt,
        K: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr, W13: tl.constexpr, S13: tl.constexpr,
        G: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, RUN_PAD: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr, HW_E4M3: tl.constexpr, LIMIT: tl.constexpr,
        WORDS: tl.constexpr, HALVES: tl.constexpr,
    ):  # fmt: skip
        """Launch 1: BN gate rows and the matching up rows of one expert, for every token that chose it.
        WORDS: fp16 products on the code words, x from _prep_kernel (xq: i64 quads, inv: 2^-s per token).
        HALVES: activations even elements first (for down's fp32 products), else in order."""
        nb = INTER // BN
        e, leader, qs, lanes, n_run = _run(ids_ptr, plan_ptr, tl.program_id(0) // nb, RUN_PAD)
        off = tl.load(off_ptr + e)
        if leader & (off != _ABSENT):
            wbase = rec_ptr + tl.multiple_of(off, 16)  # offsets are multiples of 16 (record_offsets asserts it)
            r = tl.arange(0, 2 * BN)  # gate rows then the matching up rows
            n = (tl.program_id(0) % nb) * BN + r % BN
            rows = tl.where(r < BN, n, n + INTER)
            wrow = wbase + W13 + rows[:, None] * (D // 2)
            srow = wbase + S13 + rows[:, None] * (D // GROUP)
            g_gate, g_up = _UNBIAS, _UNBIAS
            if G >= 0:  # NVFP4 global scales of w1, w3
                gp = (wbase + G).to(tl.pointer_type(tl.float32))
                g_gate, g_up = tl.load(gp) * _UNBIAS, tl.load(gp + 1) * _UNBIAS
            n = (tl.program_id(0) % nb) * BN + tl.arange(0, BN)
            dest = (n % 2) * (INTER // 2) + n // 2 if HALVES else n
            src = xq_ptr if WORDS else x_ptr  # token t's x (WORDS: its quads) at src + t * stride
            stride = D // 4 if WORDS else stride_xt
            if n_run == 1:  # most runs at decode (all at one token): one token, a 2-D accumulator
                q = _pick(qs, lanes, 0)
                dot = _rows_dot(
                    wrow, srow, src + (q // K) * stride, 2, 1, D, GROUP, E8M0, BK, WORDS, USE_ASM, HW_E4M3
                )  # fmt: skip
                _emit(act_ptr, rw_ptr, q, _unscale(dot, inv_ptr, q // K, WORDS), dest, g_gate, g_up, INTER, LIMIT)
            else:
                acc = _rows_dot_run(
                    wrow, srow, src, stride, qs, lanes, n_run, K, 2, 1, D, GROUP, E8M0, BK, RUN_PAD, WORDS, USE_ASM,
                    HW_E4M3,
                )  # fmt: skip
                for i in range(n_run):
                    q = _pick(qs, lanes, i)
                    dot = _unscale(tl.sum(tl.where(lanes[:, None] == i, acc, 0.0), 0), inv_ptr, q // K, WORDS)
                    _emit(act_ptr, rw_ptr, q, dot, dest, g_gate, g_up, INTER, LIMIT)

    @triton.jit
    def _down_kernel(
        ids_ptr, plan_ptr, rec_ptr, off_ptr, act_ptr, inv_ptr, out_ptr,
        K: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr, W2: tl.constexpr, S2: tl.constexpr,
        G: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr, RUN_PAD: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr, HW_E4M3: tl.constexpr, WORDS: tl.constexpr,
    ):  # fmt: skip
        """Launch 2: BN rows of one expert's W2 times the activation of every pair that chose it; pairs of an
        absent expert get zeros (the sum over slots reads every pair's row) and their activations are not read.
        act: fp32 rows in halves, or (WORDS) i64 quads from _act_prep_kernel with inv: 2^-s per pair."""
        nb = D // BN
        p = tl.program_id(0) // nb
        e, leader, qs, lanes, n_run = _run(ids_ptr, plan_ptr, p, RUN_PAD)
        off = tl.load(off_ptr + e)
        rows = (tl.program_id(0) % nb) * BN + tl.arange(0, BN)
        if off == _ABSENT:
            tl.store(out_ptr + p * D + rows, tl.zeros((BN,), dtype=tl.float32))
        elif leader:
            wbase = rec_ptr + tl.multiple_of(off, 16)
            wrow = wbase + W2 + rows[:, None] * (INTER // 2)
            srow = wbase + S2 + rows[:, None] * (INTER // GROUP)
            g = _UNBIAS
            if G >= 0:  # NVFP4 global scale of w2
                g = tl.load((wbase + G).to(tl.pointer_type(tl.float32)) + 2) * _UNBIAS
            stride = INTER // 4 if WORDS else INTER  # pair q's activation row at act + q * stride
            if n_run == 1:
                dot = _rows_dot(
                    wrow, srow, act_ptr + p * stride, 1, INTER // 2, INTER, GROUP, E8M0, BK, WORDS, USE_ASM, HW_E4M3
                )  # fmt: skip
                tl.store(out_ptr + p * D + rows, _unscale(dot, inv_ptr, p, WORDS) * g)
            else:
                acc = _rows_dot_run(
                    wrow, srow, act_ptr, stride, qs, lanes, n_run, 1, 1, INTER // 2, INTER, GROUP, E8M0, BK, RUN_PAD,
                    WORDS, USE_ASM, HW_E4M3,
                )  # fmt: skip
                for i in range(n_run):
                    q = _pick(qs, lanes, i)
                    dot = _unscale(tl.sum(tl.where(lanes[:, None] == i, acc, 0.0), 0), inv_ptr, q, WORDS)
                    tl.store(out_ptr + q * D + rows, dot * g)

    @triton.jit
    def _combine_kernel(
        out_ptr, add_ptr, y_ptr, stride_add,
        K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, ADD: tl.constexpr, EMULATE_RNE: tl.constexpr,
    ):  # fmt: skip
        """Launch 3: BD columns of token t's y (combine_ref): its K pairs' fp32 rows from down summed in slot
        order, rounded to y's dtype; ADD: plus add's row in fp32, rounded again (torch's y.to(dtype) + add).
        EMULATE_RNE: the interpreter's bf16 rounding made the GPU's (fp4_decode.rounded)."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        rows = out_ptr + t * K * D + cols  # pair t * K + j's row at rows + j * D
        acc = tl.load(rows)
        for j in tl.static_range(1, K):  # unrolled: every pair's load in flight at once
            acc += tl.load(rows + j * D)
        y = rounded(acc, y_ptr.dtype.element_ty, EMULATE_RNE)
        if ADD:
            more = tl.load(add_ptr + t * stride_add + cols).to(tl.float32)
            y = rounded(y.to(tl.float32) + more, y_ptr.dtype.element_ty, EMULATE_RNE)
        tl.store(y_ptr + t * D + cols, y)


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes: BN1 rows of the expert width per gate+up program below wide_from tokens (BN1_WIDE from it on),
    BN2 rows of the model dim per down program, BK1 (BK1_WIDE)/BK2 input elements per step (a power of two, at
    least one scale block); warps per gate+up and per down program. gate_up(t) names the gate+up tile of a call.
    words1/words2: gate+up/down in fp16 products on the code words for bf16 and fp16 x (fp32 x keeps fp32
    products). BN3: columns of the model dim per combine program (a warp per 128)."""

    # the best of sweeps on the H100 (docs/BENCHMARKS.md): gate+up 16 rows x 256 B per step; down 8 rows, each
    # read whole in one step (2048 elements: V3's and V4's expert width; fit() shrinks it for narrower ones)
    bn1: int = 8
    bk1: int = 512
    bn2: int = 8
    bk2: int = 2048
    num_warps: int = 4
    num_warps2: int = 4
    words1: bool = True  # 6.7 SASS instructions per code byte on a straight loop, against fp32's 14.6
    words2: bool = True
    # combine at one token: V3's 7168 columns in 56 programs of one warp, one 16-byte load per thread and pair
    bn3: int = 128
    # from wide_from tokens on, gate+up reads 32 rows x 512 B per step (each tile serves more tokens): 84% of the
    # H100's ceiling at 3 and 4 tokens against 79-80% and 79% on the narrow tile; at 2 tokens, since the plan,
    # gate+up takes 99 us against the narrow tile's 107. 1 token keeps the narrow one (78% against 74%)
    wide_from: int = 2
    bn1_wide: int = 16
    bk1_wide: int = 1024

    def fit(self, layout: RecordLayout) -> DecodeConfig:
        """Shrink the tiles to a small model's shape (every size a power of two dividing it)."""

        def div(b: int, n: int) -> int:
            while n % b:
                b //= 2
            return b

        d, i = layout.dim, layout.inter_dim
        return dataclasses.replace(self, bn1=div(self.bn1, i), bk1=div(self.bk1, d), bn2=div(self.bn2, d),
                                   bk2=div(self.bk2, i), bn3=div(self.bn3, d), bn1_wide=div(self.bn1_wide, i),
                                   bk1_wide=div(self.bk1_wide, d))  # fmt: skip

    def gate_up(self, t: int) -> tuple[int, int]:
        """Gate+up's (rows, elements per step) for a call of t tokens."""
        return (self.bn1_wide, self.bk1_wide) if t >= self.wide_from else (self.bn1, self.bk1)


def combine_ref(out: torch.Tensor, t: int, k: int, dtype: torch.dtype, add: torch.Tensor | None = None) -> torch.Tensor:
    """_combine_kernel's result: out [>= T * K, D] fp32 pair rows, each token's K summed in slot order, in
    dtype, plus add [T, D] (in dtype, added in fp32 and rounded: torch's own bf16 and fp16 addition)."""
    rows = out[: t * k].view(t, k, -1)  # [T, K, D]
    acc = rows[:, 0]
    for j in range(1, k):  # one add at a time: the kernel's order, not torch.sum's
        acc = acc + rows[:, j]
    y = acc.to(dtype)  # [T, D]
    return y if add is None else y + add


def workspace_bytes(layout: RecordLayout, top_k: int) -> int:
    """Device memory a DecodeMoE holds: per pair an fp32 activation row, its fp16 copy and 2^-s for the down
    words, an fp32 output row and its run (i32); per token x in fp16 and its 2^-s."""
    pairs = MAX_TOKENS * top_k
    per_pair = layout.inter_dim * (4 + 2) + 4 + layout.dim * 4 + (1 + MAX_TOKENS) * 4
    return pairs * per_pair + MAX_TOKENS * (layout.dim * 2 + 4)


class DecodeMoE:
    """The decode kernels for one record layout on one device, with their workspaces (workspace_bytes) kept
    across calls, so that a captured graph replays on the same memory."""

    def __init__(
        self,
        layout: RecordLayout,
        top_k: int,
        device: torch.device,
        config: DecodeConfig | None = None,
        limit: float = 0.0,
    ):
        """limit: the SwiGLU clamp (kernels/swiglu.py), 0.0 for none."""
        group = get_format(layout.format).block[1]
        self.layout, self.top_k = layout, top_k
        self.config = c = (config or DecodeConfig()).fit(layout)
        assert min(c.bk1, c.bk1_wide, c.bk2) >= group, f"K steps must hold whole {group}-element scale blocks"
        pairs, d, i = MAX_TOKENS * top_k, layout.dim, layout.inter_dim
        self.words = d % 8 == 0 and i % 8 == 0  # x as quads that meet whole code words (bf16 and fp16 runs)

        # words_sums' PTX takes two adjacent words per thread (pack=2): a chunk must give every thread two, else
        # the GPU pairs words of different threads (a small model's tiles): fp32 products there
        def fits(rows: int, k: int, warps: int) -> bool:  # rows x k codes a chunk, 8 to a word
            return self.words and rows * k // 8 >= WORD_PAIR * WARP * warps

        tiles = (c.gate_up(1), c.gate_up(MAX_TOKENS))  # gate+up's narrow and wide tiles (gate and up: 2 x BN1 rows)
        self.words1 = {tile: c.words1 and fits(2 * tile[0], tile[1], c.num_warps) for tile in tiles}
        self.words2 = c.words2 and fits(c.bn2, c.bk2, c.num_warps2)
        self.xq = torch.empty(MAX_TOKENS, d, dtype=torch.float16, device=device)
        self.inv = torch.empty(MAX_TOKENS, dtype=torch.float32, device=device)
        self.quads = self.xq.view(torch.int64)  # [MAX_TOKENS, D / 4]: what gate+up reads of xq
        self.act = torch.empty(pairs, i, dtype=torch.float32, device=device)
        self.act_q = torch.empty(pairs, i, dtype=torch.float16, device=device)  # act as the down words read it
        self.act_inv = torch.empty(pairs, dtype=torch.float32, device=device)
        self.act_quads = self.act_q.view(torch.int64)
        self.out = torch.empty(pairs, d, dtype=torch.float32, device=device)
        self.plan = torch.empty(pairs, 1 + MAX_TOKENS, dtype=torch.int32, device=device)  # _plan's runs
        p = {part.name: part.offset for part in layout.parts}
        common = dict(
            K=top_k, D=d, INTER=i, G=p.get("scale_2", -1), GROUP=group, E8M0=layout.format == "mxfp4",
            USE_ASM=not interpreted(), HW_E4M3=hw_e4m3(device),
        )  # fmt: skip
        self.phase1 = dict(common, W13=p["w13"], S13=p["w13_scale"], LIMIT=float(limit), num_warps=c.num_warps)
        self.phase2 = dict(common, W2=p["w2"], S2=p["w2_scale"], BN=c.bn2, BK=c.bk2, num_warps=c.num_warps2)

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        records: torch.Tensor,
        offsets: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, D], ids: [T, K], weights: [T, K], records: [S, nbytes] u8, offsets: [E] i64, add: None or
        [T, D] in x's dtype -> y [T, D] in x's dtype (the routed sum rounded, then plus add rounded)."""
        t, k = x.shape[0], self.top_k
        assert 0 < t <= MAX_TOKENS and ids.shape == (t, k), f"decode takes 1..{MAX_TOKENS} tokens of top-{k} ids"
        assert x.shape[1] == self.layout.dim and x.stride(1) == 1 and records.shape[1] == self.layout.nbytes
        assert records.data_ptr() % 16 == 0, "records: a 16-byte aligned u8 slot pool"
        ids, weights, offsets = ids.contiguous(), weights.float().contiguous(), offsets.contiguous()
        run = dict(RUN_PAD=next_pow2(t))
        c, d, i = self.config, self.layout.dim, self.layout.inter_dim
        exact = x.dtype == torch.float32  # fp32 runs (the exact ones) keep fp32 products
        bn1, bk1 = c.gate_up(t)
        words1, words2 = self.words1[bn1, bk1] and not exact, self.words2 and not exact
        rows, plan = t if words1 else 0, t > 1  # one token needs no plan: every pair leads its own run
        if rows or plan:
            _prep_kernel[(rows + plan,)](
                x, x.stride(0), self.xq, self.inv, rows, ids, self.plan, t * k, D=d, BD=next_pow2(d),
                P_PAD=next_pow2(t * k), **run,
            )  # fmt: skip
        _gate_up_kernel[(t * k * (i // bn1),)](
            x, self.quads, self.inv, ids, self.plan, weights, records, offsets, self.act, x.stride(0), **run,
            **self.phase1, BN=bn1, BK=bk1, WORDS=words1, HALVES=not words2,
        )  # fmt: skip
        if words2:  # absent experts' pairs prepare whatever their rows hold: down never reads them
            _act_prep_kernel[(t * k,)](self.act, self.act_q, self.act_inv, INTER=i, BI=next_pow2(i))
        _down_kernel[(t * k * (d // c.bn2),)](
            ids, self.plan, records, offsets, self.act_quads if words2 else self.act, self.act_inv, self.out, **run,
            **self.phase2, WORDS=words2,
        )  # fmt: skip
        return self.combine(t, x.dtype, add)

    def combine(self, t: int, dtype: torch.dtype, add: torch.Tensor | None = None) -> torch.Tensor:
        """Launch 3 on the first t tokens' pair rows in `out` -> y [T, D] in dtype (combine_ref). y is allocated
        here, as torch ops do: a graph capture keeps its memory."""
        d = self.layout.dim
        if add is not None:
            assert add.shape == (t, d) and add.dtype == dtype and add.stride(1) == 1, "add: [T, D] in x's dtype"
        y = torch.empty(t, d, dtype=dtype, device=self.out.device)  # [T, D]
        bd = self.config.bn3
        _combine_kernel[(t, d // bd)](
            self.out, y if add is None else add, y, 0 if add is None else add.stride(0), K=self.top_k, D=d, BD=bd,
            ADD=add is not None, EMULATE_RNE=interpreted() and dtype == torch.bfloat16,
            num_warps=max(1, bd // (LOAD_FP32 * WARP)),
        )  # fmt: skip
        return y
