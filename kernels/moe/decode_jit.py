"""The decode MoE's Triton programs (decode.py launches them and says what each launch does): FP4 rows read in
chunks, decoded in registers and multiplied by one token's x (_rows_dot) or by every token of an expert's run at
once (_rows_dot_run), in fp32 products on the bytes or fp16 products on the code words (words_sums); the plan of
each expert's run; the launches' programs. Legend: T tokens, K experts per token, D dim, I expert width, G scale
block, R rows per program, P = T * K pairs.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton
from dsfp4.kernels.fp4.codes import E2M1_UNBIAS, X16_TOP_EXP, block_scale, e2m1_halves, rounded, words_sums
from dsfp4.layout.record_offsets import ABSENT

if triton is not None:
    from dsfp4.kernels.swiglu import swiglu_tl

    # kernels read globals only as constexpr
    _ABSENT = tl.constexpr(ABSENT)
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
        # bytes per element loaded
        E: tl.constexpr = 4 if WORDS else 1
        cols = tl.arange(0, BK // (2 * E))[None, :]
        groups = tl.arange(0, BK // GROUP)[None, :]
        # masks built by comparison: the interpreter rejects a broadcast scalar one
        live = tl.where(MASK, BK, 0)
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
        packed,
        xrow,
        kb,
        XS: tl.constexpr,
        ODD: tl.constexpr,
        GROUP: tl.constexpr,
        BK: tl.constexpr,
        WORDS: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """Per scale block, sum of code * x over the chunk at byte kb (from _chunk): [R, BK/G], before the
        global scale and 2^14. Bytes: fp32 products, byte j's low nibble meeting xrow[j * XS], its high one
        ODD further. WORDS: fp16 products on the x quads of xrow (i64, from _scaled_quads: still times 2^s)."""
        R: tl.constexpr = packed.shape[0]
        # if/else, not an early return: the compiler would still build the code after it
        if WORDS:
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
        wrow,
        srow,
        xrow,
        XS: tl.constexpr,
        ODD: tl.constexpr,
        KDIM: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        BK: tl.constexpr,
        WORDS: tl.constexpr,
        USE_ASM: tl.constexpr,
        HW_E4M3: tl.constexpr,
    ):
        """sum_k W[r, k] x[k] for FP4 rows (wrow, srow: [R, 1] row pointers to codes and scale bytes) and one
        activation row (xrow, read as _block_sums does), before the global scale and 2^14: [R]. The next chunk
        is loaded before this one is computed."""
        R: tl.constexpr = wrow.shape[0]
        # reduced once at the end, not per chunk
        acc = tl.zeros((R, BK // GROUP), dtype=tl.float32)
        packed, sb = _chunk(wrow, srow, 0, GROUP, BK, MASK=True, WORDS=WORDS)
        for kb in range(0, KDIM // 2, BK // 2):
            nxt, nsb = _chunk(wrow, srow, kb + BK // 2, GROUP, BK, MASK=kb + BK // 2 < KDIM // 2, WORDS=WORDS)
            acc += _block_sums(packed, xrow, kb, XS, ODD, GROUP, BK, WORDS, USE_ASM) * block_scale(sb, E8M0, HW_E4M3)
            packed, sb = nxt, nsb
        return tl.sum(acc, 1)

    @triton.jit
    def _rows_dot_run(
        wrow,
        srow,
        src,
        stride,
        qs,
        lanes,
        n_run,
        ROW_DIV: tl.constexpr,
        XS: tl.constexpr,
        ODD: tl.constexpr,
        KDIM: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        BK: tl.constexpr,
        RUN_PAD: tl.constexpr,
        WORDS: tl.constexpr,
        USE_ASM: tl.constexpr,
        HW_E4M3: tl.constexpr,
    ):
        """_rows_dot for the n_run pairs qs of a run, each weight chunk loaded once for all of them: [RUN_PAD, R].
        Pair q reads row q // ROW_DIV of `src` (stride elements apart). Only the words load a chunk ahead (the
        bytes' fp32 run spends its registers: 128 a thread at 32 rows x 128 B, 167 with the chunk ahead)."""
        R: tl.constexpr = wrow.shape[0]
        acc = tl.zeros((RUN_PAD, R), dtype=tl.float32)
        # bytes per row loaded ahead
        AHEAD: tl.constexpr = BK // 2 if WORDS else 0
        packed, sb = _chunk(wrow, srow, 0, GROUP, BK, MASK=True, WORDS=WORDS)
        for kb in range(0, KDIM // 2, BK // 2):
            nxt, nsb = _chunk(wrow, srow, kb + AHEAD, GROUP, BK, MASK=kb + AHEAD < KDIM // 2, WORDS=WORDS)
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
    def _plan(ids_ptr, plan_ptr, p, n_pairs, P_PAD: tl.constexpr, RUN_PAD: tl.constexpr):
        """Pair p's part of every pair's run, found once for both launches: row p of plan [P, 1 + RUN_PAD] holds how
        many pairs chose p's expert if p is the first of them (its leader), else 0, then (leader rows) those pairs in
        order; p writes its count and its place in its leader's row. A program a pair: one program scanning every
        pair against every other was slow at 16 tokens (docs/BENCHMARKS.md, run 62)."""
        q = tl.arange(0, P_PAD)
        live = q < n_pairs
        e = tl.load(ids_ptr + q, mask=live, other=-1)
        match = (e == tl.load(ids_ptr + p)) & live  # [P_PAD]: the pairs of p's expert
        # p's position in its run
        rank = tl.sum((match & (q < p)).to(tl.int32), 0)
        # its run's first pair
        lead = tl.min(tl.where(match, q, P_PAD), 0)
        n_run = tl.sum(match.to(tl.int32), 0)
        tl.store(plan_ptr + p * (1 + RUN_PAD), tl.where(rank == 0, n_run, 0))
        # in its row, always
        tl.store(plan_ptr + lead * (1 + RUN_PAD) + 1 + rank, p, mask=rank < RUN_PAD)

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
    def prep_kernel(
        x_ptr,
        stride_xt,
        xq_ptr,
        inv_ptr,
        n_rows,
        ids_ptr,
        plan_ptr,
        n_pairs,
        D: tl.constexpr,
        BD: tl.constexpr,
        P_PAD: tl.constexpr,
        RUN_PAD: tl.constexpr,
    ):
        """Launch 0: programs below n_rows prepare row t of x (_scaled_quads); the programs after them, when
        launched, one per pair, write the plan (_plan): in this launch, which costs less than a launch of its own."""
        t = tl.program_id(0)
        if t < n_rows:
            _scaled_quads(x_ptr + t * stride_xt, xq_ptr + t * D, inv_ptr + t, D, BD)
        else:
            _plan(ids_ptr, plan_ptr, t - n_rows, n_pairs, P_PAD, RUN_PAD)

    @triton.jit
    def act_prep_kernel(act_ptr, act_q_ptr, act_inv_ptr, INTER: tl.constexpr, BI: tl.constexpr):
        """Launch 1b: pair p's activation row for down's words (_scaled_quads)."""
        p = tl.program_id(0)
        _scaled_quads(act_ptr + p * INTER, act_q_ptr + p * INTER, act_inv_ptr + p, INTER, BI)

    @triton.jit
    def _run(ids_ptr, plan_ptr, p, RUN_PAD: tl.constexpr):
        """Expert e of pair p; whether p is the first pair to choose it; the pairs that chose it (its run,
        qs [RUN_PAD]) and how many (a token picks an expert once, so at most one pair per token)."""
        e = tl.load(ids_ptr + p).to(tl.int32)
        lanes = tl.arange(0, RUN_PAD)
        # one token: every pair is its own run and leads it, no plan
        if RUN_PAD == 1:
            # constants fold
            leader, qs, n_run = tl.full((), 1, tl.int1), lanes + p, tl.full((), 1, tl.int32)
        else:
            # from _plan: thousands of programs each scanning every pair cost time (docs/BENCHMARKS.md, 2026-11-23)
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
    def gate_up_kernel(
        x_ptr,
        xq_ptr,
        inv_ptr,
        ids_ptr,
        plan_ptr,
        rw_ptr,
        rec_ptr,
        off_ptr,
        act_ptr,
        stride_xt,
        K: tl.constexpr,
        D: tl.constexpr,
        INTER: tl.constexpr,
        W13: tl.constexpr,
        S13: tl.constexpr,
        G: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        RUN_PAD: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        USE_ASM: tl.constexpr,
        HW_E4M3: tl.constexpr,
        LIMIT: tl.constexpr,
        WORDS: tl.constexpr,
        HALVES: tl.constexpr,
    ):
        """Launch 1: BN gate rows and the matching up rows of one expert, for every token that chose it.
        WORDS: fp16 products on the code words, x from prep_kernel (xq: i64 quads, inv: 2^-s per token).
        HALVES: activations even elements first (for down's fp32 products), else in order."""
        nb = INTER // BN
        e, leader, qs, lanes, n_run = _run(ids_ptr, plan_ptr, tl.program_id(0) // nb, RUN_PAD)
        off = tl.load(off_ptr + e)
        if leader & (off != _ABSENT):
            # offsets are multiples of 16 (record_offsets asserts it)
            wbase = rec_ptr + tl.multiple_of(off, 16)
            # gate rows then the matching up rows
            r = tl.arange(0, 2 * BN)
            n = (tl.program_id(0) % nb) * BN + r % BN
            rows = tl.where(r < BN, n, n + INTER)
            wrow = wbase + W13 + rows[:, None] * (D // 2)
            srow = wbase + S13 + rows[:, None] * (D // GROUP)
            g_gate, g_up = _UNBIAS, _UNBIAS
            # NVFP4 global scales of w1, w3
            if G >= 0:
                gp = (wbase + G).to(tl.pointer_type(tl.float32))
                g_gate, g_up = tl.load(gp) * _UNBIAS, tl.load(gp + 1) * _UNBIAS
            n = (tl.program_id(0) % nb) * BN + tl.arange(0, BN)
            dest = (n % 2) * (INTER // 2) + n // 2 if HALVES else n
            # token t's x (WORDS: its quads) at src + t * stride
            src = xq_ptr if WORDS else x_ptr
            stride = D // 4 if WORDS else stride_xt
            # most runs at decode (all at one token): one token, a 2-D accumulator
            if n_run == 1:
                q = _pick(qs, lanes, 0)
                x_row = src + (q // K) * stride
                dot = _rows_dot(
                    wrow,
                    srow,
                    x_row,
                    XS=2,
                    ODD=1,
                    KDIM=D,
                    GROUP=GROUP,
                    E8M0=E8M0,
                    BK=BK,
                    WORDS=WORDS,
                    USE_ASM=USE_ASM,
                    HW_E4M3=HW_E4M3,
                )
                _emit(act_ptr, rw_ptr, q, _unscale(dot, inv_ptr, q // K, WORDS), dest, g_gate, g_up, INTER, LIMIT)
            else:
                acc = _rows_dot_run(
                    wrow,
                    srow,
                    src,
                    stride,
                    qs,
                    lanes,
                    n_run,
                    ROW_DIV=K,
                    XS=2,
                    ODD=1,
                    KDIM=D,
                    RUN_PAD=RUN_PAD,
                    GROUP=GROUP,
                    E8M0=E8M0,
                    BK=BK,
                    WORDS=WORDS,
                    USE_ASM=USE_ASM,
                    HW_E4M3=HW_E4M3,
                )
                for i in range(n_run):
                    q = _pick(qs, lanes, i)
                    dot = _unscale(tl.sum(tl.where(lanes[:, None] == i, acc, 0.0), 0), inv_ptr, q // K, WORDS)
                    _emit(act_ptr, rw_ptr, q, dot, dest, g_gate, g_up, INTER, LIMIT)

    @triton.jit
    def down_kernel(
        ids_ptr,
        plan_ptr,
        rec_ptr,
        off_ptr,
        act_ptr,
        inv_ptr,
        out_ptr,
        K: tl.constexpr,
        D: tl.constexpr,
        INTER: tl.constexpr,
        W2: tl.constexpr,
        S2: tl.constexpr,
        G: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        RUN_PAD: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        USE_ASM: tl.constexpr,
        HW_E4M3: tl.constexpr,
        WORDS: tl.constexpr,
    ):
        """Launch 2: BN rows of one expert's W2 times the activation of every pair that chose it; pairs of an
        absent expert get zeros (the sum over slots reads every pair's row) and their activations are not read.
        act: fp32 rows in halves, or (WORDS) i64 quads from act_prep_kernel with inv: 2^-s per pair."""
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
            # NVFP4 global scale of w2
            if G >= 0:
                g = tl.load((wbase + G).to(tl.pointer_type(tl.float32)) + 2) * _UNBIAS
            # pair q's activation row at act + q * stride
            stride = INTER // 4 if WORDS else INTER
            if n_run == 1:
                act_row = act_ptr + p * stride
                dot = _rows_dot(
                    wrow,
                    srow,
                    act_row,
                    XS=1,
                    ODD=INTER // 2,
                    KDIM=INTER,
                    GROUP=GROUP,
                    E8M0=E8M0,
                    BK=BK,
                    WORDS=WORDS,
                    USE_ASM=USE_ASM,
                    HW_E4M3=HW_E4M3,
                )
                tl.store(out_ptr + p * D + rows, _unscale(dot, inv_ptr, p, WORDS) * g)
            else:
                acc = _rows_dot_run(
                    wrow,
                    srow,
                    act_ptr,
                    stride,
                    qs,
                    lanes,
                    n_run,
                    ROW_DIV=1,
                    XS=1,
                    ODD=INTER // 2,
                    KDIM=INTER,
                    RUN_PAD=RUN_PAD,
                    GROUP=GROUP,
                    E8M0=E8M0,
                    BK=BK,
                    WORDS=WORDS,
                    USE_ASM=USE_ASM,
                    HW_E4M3=HW_E4M3,
                )
                for i in range(n_run):
                    q = _pick(qs, lanes, i)
                    dot = _unscale(tl.sum(tl.where(lanes[:, None] == i, acc, 0.0), 0), inv_ptr, q, WORDS)
                    tl.store(out_ptr + q * D + rows, dot * g)

    @triton.jit
    def combine_kernel(
        out_ptr,
        add_ptr,
        y_ptr,
        stride_add,
        K: tl.constexpr,
        D: tl.constexpr,
        BD: tl.constexpr,
        ADD: tl.constexpr,
        EMULATE_RNE: tl.constexpr,
    ):
        """Launch 3: BD columns of token t's y (combine_ref): its K pairs' fp32 rows from down summed in slot
        order, rounded to y's dtype; ADD: plus add's row in fp32, rounded again (torch's y.to(dtype) + add).
        EMULATE_RNE: the interpreter's bf16 rounding made the GPU's (fp4/codes.rounded)."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        # pair t * K + j's row at rows + j * D
        rows = out_ptr + t * K * D + cols
        acc = tl.load(rows)
        # unrolled: every pair's load in flight at once
        for j in tl.static_range(1, K):
            acc += tl.load(rows + j * D)
        y = rounded(acc, y_ptr.dtype.element_ty, EMULATE_RNE)
        if ADD:
            more = tl.load(add_ptr + t * stride_add + cols).to(tl.float32)
            y = rounded(y.to(tl.float32) + more, y_ptr.dtype.element_ty, EMULATE_RNE)
        tl.store(y_ptr + t * D + cols, y)
