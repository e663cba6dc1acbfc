"""The FP4 tensor-core prefill's Triton programs (prefill_mma.py plans and launches them): prefill_jit.py's grouped
GEMMs with the block's products taken by tl.dot_scaled straight from the MXFP4 record (e2m1 codes and their e8m0
scales, never decoded in software) against MXFP8 activations (act_mxfp8.py). Blackwell runs them on its
block-scaled FP4 MMA; elsewhere Triton upcasts both operands to bf16 first (the GPU test's path on an H200).
Legend: BM main rows, BT tail rows, BN columns, BK the K step, G = 32 (one e8m0 scale), R weight rows per program.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton
from dsfp4.layout.record_offsets import ABSENT

if triton is not None:
    from dsfp4.kernels.fp4.codes import rounded
    from dsfp4.kernels.moe.act_mxfp8 import GROUP
    from dsfp4.kernels.moe.prefill_jit import _block_rows, _gate_up_store

    _ABSENT = tl.constexpr(ABSENT)
    _G = tl.constexpr(GROUP)

    @triton.jit
    def _scaled_step(acc, a_ptrs, s_ptrs, w, ws, kb, BK: tl.constexpr):
        """acc [R, M] += W a^T over columns kb..kb+BK: w [R, BK/2] e2m1 pairs, ws [R, BK/G] e8m0, the activations'
        codes a_ptrs [M, BK] and scales s_ptrs [M, BK/G] at column 0, every row readable (no mask)."""
        a = tl.load(a_ptrs + kb)  # [M, BK] e4m3 codes
        s = tl.load(s_ptrs + kb // _G)  # [M, BK/G]
        return tl.dot_scaled(w, ws, "e2m1", tl.trans(a), s, "e4m3", acc)

    @triton.jit
    def _block_mma_scaled(
        a_ptrs,
        s_ptrs,
        a_ptrs_t,
        s_ptrs_t,
        has_tail,
        w_ptr,
        ws_ptr,
        wrows,
        K: tl.constexpr,
        BK: tl.constexpr,
    ):
        """W[wrows] a^T over K for a block's main rows and tail rows (prefill_jit._block_mma's contract) from an
        MXFP4 matrix [N, K] (codes [N, K/2], e8m0 scales [N, K/G]) -> (acc [R, BM], acc_t [R, BT]) fp32."""
        R: tl.constexpr = wrows.shape[0]
        r = wrows.to(tl.int64)[:, None]
        acc = tl.zeros((R, a_ptrs.shape[0]), dtype=tl.float32)
        acc_t = tl.zeros((R, a_ptrs_t.shape[0]), dtype=tl.float32)
        w_ptrs = w_ptr + r * (K // 2) + tl.arange(0, BK // 2)[None, :]  # [R, BK/2] e2m1 pairs
        ws_ptrs = ws_ptr + r * (K // _G) + tl.arange(0, BK // _G)[None, :]  # [R, BK/G] e8m0
        # the tail's products in a loop of their own, the weight tiles read again (from L2): one tile shared by the
        # main rows' and the tail's dot_scaled of two widths summed wrongly on an H200 (docs/kernels.md)
        for kb in range(0, K, BK):
            w, ws = tl.load(w_ptrs + kb // 2), tl.load(ws_ptrs + kb // _G)
            acc = _scaled_step(acc, a_ptrs, s_ptrs, w, ws, kb, BK)
        if has_tail:
            for kb in range(0, K, BK):
                w, ws = tl.load(w_ptrs + kb // 2), tl.load(ws_ptrs + kb // _G)
                acc_t = _scaled_step(acc_t, a_ptrs_t, s_ptrs_t, w, ws, kb, BK)
        return acc, acc_t

    @triton.jit
    def _rows_at(codes_ptr, scales_ptr, rows, K: tl.constexpr, BK: tl.constexpr):
        """Pointers to the first K step of `rows` of MXFP8 activations [., K] (codes) and [., K/G] (scales)."""
        r = rows.to(tl.int64)[:, None]
        return codes_ptr + r * K + tl.arange(0, BK)[None, :], scales_ptr + r * (K // _G) + tl.arange(0, BK // _G)[
            None, :
        ]

    @triton.jit
    def gate_up_mma_kernel(
        xq_ptr,
        xs_ptr,
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
        BM: tl.constexpr,
        BT: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        EMULATE_RNE: tl.constexpr,
        LIMIT: tl.constexpr,
    ):
        """act[row] = swiglu(x W1^T, x W3^T) * routing weight (prefill_jit.gate_up_kernel's contract) from x's MXFP8
        codes xq [T, D] and scales xs [T, D/G]."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        e = tl.load(experts_ptr + pid_m)
        if e < 0:
            return
        off = tl.load(off_ptr + e)
        # the down kernel writes these pairs' zeros
        if off == _ABSENT:
            return
        wbase = rec_ptr + tl.multiple_of(off, 16)
        rows, rows_t, pairs, pairs_t, valid, valid_t, has_tail = _block_rows(pairs_ptr, pid_m, n_pairs, BM, BT)
        # weight row c: 8 gate rows, then the same 8 up rows, as prefill_jit's (its _gate_up_store splits them)
        c = tl.arange(0, 2 * BN)
        wrows = pid_n * BN + (c // 16) * 8 + c % 8 + ((c // 8) % 2) * INTER
        # padding rows read token 0, so that no load is masked; their routing weight 0 makes their rows 0
        xp, sp = _rows_at(xq_ptr, xs_ptr, tl.where(valid, pairs // TOP_K, 0), D, BK)
        xp_t, sp_t = _rows_at(xq_ptr, xs_ptr, tl.where(valid_t, pairs_t // TOP_K, 0), D, BK)
        acc, acc_t = _block_mma_scaled(xp, sp, xp_t, sp_t, has_tail, wbase + W13, wbase + S13, wrows, K=D, BK=BK)
        _gate_up_store(acc, rows, pairs, valid, rw_ptr, act_ptr, 1.0, 1.0, pid_n * BN, INTER, LIMIT, EMULATE_RNE)
        _gate_up_store(
            acc_t, rows_t, pairs_t, valid_t, rw_ptr, act_ptr, 1.0, 1.0, pid_n * BN, INTER, LIMIT, EMULATE_RNE
        )

    @triton.jit
    def down_mma_kernel(
        aq_ptr,
        as_ptr,
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
        BM: tl.constexpr,
        BT: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        EMULATE_RNE: tl.constexpr,
    ):
        """out[pair] = act[row] W2^T (prefill_jit.down_kernel's contract) from act's MXFP8 codes aq [L, I] and
        scales as [L, I/G]; zeros for the pairs of a left-out expert."""
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
        ap, sp = _rows_at(aq_ptr, as_ptr, rows, INTER, BK)
        ap_t, sp_t = _rows_at(aq_ptr, as_ptr, rows_t, INTER, BK)
        # gate_up wrote every row of the block (padding: zeros)
        acc, acc_t = _block_mma_scaled(ap, sp, ap_t, sp_t, has_tail, wbase + W2, wbase + S2, cols, K=INTER, BK=BK)
        tl.store(out, rounded(acc, DTYPE, EMULATE_RNE), mask=valid[None, :])
        tl.store(out_t, rounded(acc_t, DTYPE, EMULATE_RNE), mask=valid_t[None, :])
