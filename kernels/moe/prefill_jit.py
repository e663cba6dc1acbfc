"""The prefill MoE's Triton programs (prefill.py plans the blocks and launches them): a block's FP4 weight tiles
decoded to bf16 in registers and fed to tensor-core MMAs for the block's main and tail rows (_block_mma), then
gate+up's activation and down's output rows stored. Legend: BM main rows, BT tail rows, BN columns, BK the K step,
G scale block, R weight rows per program.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton
from dsfp4.kernels.fp4.codes import E4M3_LIFT, E8M0_LIFT
from dsfp4.layout.record_offsets import ABSENT

if triton is not None:
    from dsfp4.kernels.fp4.codes import block_scale, e2m1_bf16, rounded
    from dsfp4.kernels.swiglu import swiglu_tl

    _ABSENT = tl.constexpr(ABSENT)
    _E4M3_LIFT = tl.constexpr(E4M3_LIFT)
    _E8M0_LIFT = tl.constexpr(E8M0_LIFT)

    @triton.jit
    def _fp4_rows(
        w_ptr,
        s_ptr,
        rows,
        kb,
        K: tl.constexpr,
        BK: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        HW_E4M3: tl.constexpr,
        USE_ASM: tl.constexpr,
        DOT: tl.constexpr,
    ):
        """Columns kb..kb+BK of `rows` of an FP4 matrix [N, K] (codes [N, K/2], scale bytes [N, K/G]) -> [R, BK]
        in DOT: e2m1 * block scale * 2^-7 (NVFP4) or e2m1 * block scale (MXFP4), exact (fp4/codes.E4M3_LIFT)."""
        R: tl.constexpr = rows.shape[0]
        r = rows.to(tl.int64)[:, None]
        packed = tl.load(w_ptr + r * (K // 2) + (kb // 2 + tl.arange(0, BK // 2))[None, :])  # [R, BK/2]
        sb = tl.load(s_ptr + r * (K // GROUP) + (kb // GROUP + tl.arange(0, BK // GROUP))[None, :])  # [R, BK/G]
        scale = block_scale(sb, E8M0, HW_E4M3)
        # byte j: columns 2j (low nibble) and 2j + 1
        lo, hi = e2m1_bf16(packed, USE_ASM)
        w = tl.reshape(tl.join(lo, hi), (R, BK))
        if E8M0:
            w = w * _E8M0_LIFT
            scale = scale.to(w.dtype)
        else:
            scale = (scale * _E4M3_LIFT).to(w.dtype)
        return tl.reshape(tl.reshape(w, (R, BK // GROUP, GROUP)) * scale[:, :, None], (R, BK)).to(DOT)

    @triton.jit
    def _block_rows(pairs_ptr, pid_m, n_pairs, BM: tl.constexpr, BT: tl.constexpr):
        """Block pid_m's main and tail rows of the padded order, their pairs, which pairs are real, and whether the
        tail holds one (a run fills its rows in order)."""
        first = pid_m * (BM + BT)
        rows, rows_t = first + tl.arange(0, BM), first + BM + tl.arange(0, BT)
        pairs, pairs_t = tl.load(pairs_ptr + rows), tl.load(pairs_ptr + rows_t)  # [BM], [BT]
        has_tail = tl.load(pairs_ptr + first + BM) < n_pairs
        return rows, rows_t, pairs, pairs_t, pairs < n_pairs, pairs_t < n_pairs, has_tail

    @triton.jit
    def _block_mma(
        a_ptrs,
        a_ptrs_t,
        valid,
        valid_t,
        has_tail,
        w_ptr,
        s_ptr,
        wrows,
        K: tl.constexpr,
        BK: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        HW_E4M3: tl.constexpr,
        USE_ASM: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """W[wrows] a^T over K for a block's main rows (a_ptrs [BM, BK] at column 0) and tail rows (a_ptrs_t
        [BT, BK]) -> (acc [R, BM], acc_t [R, BT]) fp32: each decoded weight tile feeds both MMAs, and a loop
        without the tail's runs when it is empty (acc_t stays 0). Rows that are not real are not read."""
        R: tl.constexpr = wrows.shape[0]
        acc = tl.zeros((R, a_ptrs.shape[0]), dtype=tl.float32)
        acc_t = tl.zeros((R, a_ptrs_t.shape[0]), dtype=tl.float32)
        if has_tail:
            for kb in range(0, K, BK):
                a = tl.load(a_ptrs + kb, mask=valid[:, None], other=0.0).to(DOT)  # [BM, BK]
                a_t = tl.load(a_ptrs_t + kb, mask=valid_t[:, None], other=0.0).to(DOT)  # [BT, BK]
                w = _fp4_rows(w_ptr, s_ptr, wrows, kb, K, BK, GROUP, E8M0, HW_E4M3, USE_ASM, DOT)  # [R, BK]
                acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
                acc_t = tl.dot(w, tl.trans(a_t), acc_t, input_precision=PRECISION)
        else:
            for kb in range(0, K, BK):
                a = tl.load(a_ptrs + kb, mask=valid[:, None], other=0.0).to(DOT)  # [BM, BK]
                w = _fp4_rows(w_ptr, s_ptr, wrows, kb, K, BK, GROUP, E8M0, HW_E4M3, USE_ASM, DOT)
                acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
        return acc, acc_t

    @triton.jit
    def _gate_up_store(
        acc,
        rows,
        pairs,
        valid,
        rw_ptr,
        act_ptr,
        g_gate,
        g_up,
        col0,
        INTER: tl.constexpr,
        LIMIT: tl.constexpr,
        EMULATE_RNE: tl.constexpr,
    ):
        """acc [2 BN, R] (gate and up rows alternating by 8) -> act[rows, col0 : col0 + BN]."""
        BN: tl.constexpr = acc.shape[0] // 2
        R: tl.constexpr = acc.shape[1]
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BN // 8, 2, 8, R)), (0, 2, 3, 1)))  # [BN/8, 8, R] each
        gate, up = tl.reshape(gate, (BN, R)) * g_gate, tl.reshape(up, (BN, R)) * g_up
        # padding rows come out 0
        rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        h = swiglu_tl(gate, up, LIMIT) * rw[None, :]  # [BN, R]
        dest = rows.to(tl.int64)[None, :] * INTER + (col0 + tl.arange(0, BN))[:, None]
        tl.store(act_ptr + dest, rounded(h, act_ptr.dtype.element_ty, EMULATE_RNE))

    @triton.jit
    def gate_up_kernel(
        x_ptr,
        rw_ptr,
        pairs_ptr,
        experts_ptr,
        rec_ptr,
        off_ptr,
        act_ptr,
        n_pairs,
        TOP_K: tl.constexpr,
        D: tl.constexpr,
        INTER: tl.constexpr,
        W13: tl.constexpr,
        S13: tl.constexpr,
        G: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        BM: tl.constexpr,
        BT: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        HW_E4M3: tl.constexpr,
        USE_ASM: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        EMULATE_RNE: tl.constexpr,
        UNBIAS: tl.constexpr,
        LIMIT: tl.constexpr,
    ):
        """act[row] = swiglu(x W1^T, x W3^T) * routing weight for BN columns (pid 0) of one block of BM + BT
        rows (pid 1): x [T, D], act [L, INTER]. The BT tail rows reuse each decoded weight tile in a second MMA,
        run only when the tail holds a pair."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        e = tl.load(experts_ptr + pid_m)
        # past the used rows
        if e < 0:
            return
        off = tl.load(off_ptr + e)
        # the down kernel writes these pairs' zeros
        if off == _ABSENT:
            return
        wbase = rec_ptr + tl.multiple_of(off, 16)
        rows, rows_t, pairs, pairs_t, valid, valid_t, has_tail = _block_rows(pairs_ptr, pid_m, n_pairs, BM, BT)
        # weight row c: 8 gate rows, then the same 8 up rows (a thread of the MMA holds rows r and r + 8)
        c = tl.arange(0, 2 * BN)
        wrows = pid_n * BN + (c // 16) * 8 + c % 8 + ((c // 8) % 2) * INTER
        xp = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * D + tl.arange(0, BK)[None, :]
        xp_t = x_ptr + (pairs_t // TOP_K).to(tl.int64)[:, None] * D + tl.arange(0, BK)[None, :]
        w, s = wbase + W13, wbase + S13
        acc, acc_t = _block_mma(
            xp,
            xp_t,
            valid,
            valid_t,
            has_tail,
            w,
            s,
            wrows,
            K=D,
            BK=BK,
            GROUP=GROUP,
            E8M0=E8M0,
            HW_E4M3=HW_E4M3,
            USE_ASM=USE_ASM,
            DOT=DOT,
            PRECISION=PRECISION,
        )
        g_gate, g_up = UNBIAS, UNBIAS
        # NVFP4 global scales of w1 and w3
        if G >= 0:
            gp = (wbase + G).to(tl.pointer_type(tl.float32))
            g_gate, g_up = tl.load(gp) * UNBIAS, tl.load(gp + 1) * UNBIAS
        _gate_up_store(acc, rows, pairs, valid, rw_ptr, act_ptr, g_gate, g_up, pid_n * BN, INTER, LIMIT, EMULATE_RNE)
        _gate_up_store(
            acc_t, rows_t, pairs_t, valid_t, rw_ptr, act_ptr, g_gate, g_up, pid_n * BN, INTER, LIMIT, EMULATE_RNE
        )

    @triton.jit
    def down_kernel(
        act_ptr,
        pairs_ptr,
        experts_ptr,
        rec_ptr,
        off_ptr,
        out_ptr,
        n_pairs,
        D: tl.constexpr,
        INTER: tl.constexpr,
        W2: tl.constexpr,
        S2: tl.constexpr,
        G: tl.constexpr,
        GROUP: tl.constexpr,
        E8M0: tl.constexpr,
        BM: tl.constexpr,
        BT: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        HW_E4M3: tl.constexpr,
        USE_ASM: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        EMULATE_RNE: tl.constexpr,
        UNBIAS: tl.constexpr,
    ):
        """out[pair] = act[row] W2^T for BN columns (pid 0) of one block of BM + BT rows (pid 1); zeros for the
        pairs of a left-out expert, so every pair's row is written. The tail as in gate_up_kernel."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        e = tl.load(experts_ptr + pid_m)
        if e < 0:
            return
        rows, rows_t, pairs, pairs_t, valid, valid_t, has_tail = _block_rows(pairs_ptr, pid_m, n_pairs, BM, BT)
        cols = pid_n * BN + tl.arange(0, BN)
        out = out_ptr + pairs.to(tl.int64)[None, :] * D + cols[:, None]  # [BN, BM]
        out_t = out_ptr + pairs_t.to(tl.int64)[None, :] * D + cols[:, None]  # [BN, BT]
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        off = tl.load(off_ptr + e)
        if off == _ABSENT:
            tl.store(out, tl.zeros((BN, BM), dtype=DTYPE), mask=valid[None, :])
            tl.store(out_t, tl.zeros((BN, BT), dtype=DTYPE), mask=valid_t[None, :])
            return
        wbase = rec_ptr + tl.multiple_of(off, 16)
        ap = act_ptr + rows.to(tl.int64)[:, None] * INTER + tl.arange(0, BK)[None, :]
        ap_t = act_ptr + rows_t.to(tl.int64)[:, None] * INTER + tl.arange(0, BK)[None, :]
        # gate_up wrote every row of the block (padding: zeros), so all load unmasked: faster (docs/BENCHMARKS.md)
        every, every_t = tl.full((BM,), True, tl.int1), tl.full((BT,), True, tl.int1)
        w, s = wbase + W2, wbase + S2
        acc, acc_t = _block_mma(
            ap,
            ap_t,
            every,
            every_t,
            has_tail,
            w,
            s,
            cols,
            K=INTER,
            BK=BK,
            GROUP=GROUP,
            E8M0=E8M0,
            HW_E4M3=HW_E4M3,
            USE_ASM=USE_ASM,
            DOT=DOT,
            PRECISION=PRECISION,
        )
        scale = UNBIAS
        # NVFP4 global scale of w2
        if G >= 0:
            scale = tl.load((wbase + G).to(tl.pointer_type(tl.float32)) + 2) * UNBIAS
        tl.store(out, rounded(acc * scale, DTYPE, EMULATE_RNE), mask=valid[None, :])
        tl.store(out_t, rounded(acc_t * scale, DTYPE, EMULATE_RNE), mask=valid_t[None, :])
