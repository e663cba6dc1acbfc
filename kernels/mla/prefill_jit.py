"""The decompressed MLA prefill's Triton program (prefill.py plans the key blocks and launches it): flash attention's
forward over one key block, a program per (BM query rows, head), continuing the online softmax that earlier blocks left
in the output and its log-sum-exp. Scores are q_nope k_nope^T + q_pe k_pe^T in fp32 on tensor cores, k_pe one row
per key for every head; causality by position (query row i at q_start + i sees keys at k_start + j <= its own).
Legend: BM query rows, BN keys per tile, N nope dim, R rope dim, V value dim (NP, RP, VP: padded to tl.dot's sizes).
"""

from __future__ import annotations

import math

from dsfp4.kernels.backend import tl, triton

# scores are kept in base-2 units: exp2 is the hardware's exponential
LOG2E = math.log2(math.e)

if triton is not None:
    _LOG2E = tl.constexpr(LOG2E)

    @triton.jit
    def _key_tile(ptr, s, S, stride, cols, N: tl.constexpr, DOT: tl.constexpr):
        """[BN, len(cols)] the block's key rows s (row stride `stride`, ptr at the head's columns) in the products'
        dtype; 0 past the block's S rows and at columns cols >= N."""
        mask = (s < S)[:, None] & (cols < N)[None, :]
        return tl.load(ptr + s[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(DOT)

    @triton.jit
    def _attend_tile(
        qn,
        qp,
        kn,
        kp,
        v,
        seen,
        qk_scale,
        m_i,
        l_i,
        acc,
        CAUSAL: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """A tile of keys kn [BN, NP], kp [BN, RP], v [BN, VP] folded into the rows' running max m_i [BM], sum l_i
        [BM] and unnormalized output acc [BM, VP] (base 2) -> the three updated. CAUSAL: the tile crosses the diagonal
        or the block's end, and only the pairs `seen` [BM, BN] count; else every row sees every key of the tile."""
        scores = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)  # [BM, BN] fp32
        scores = tl.dot(qp, tl.trans(kp), scores, input_precision=PRECISION) * qk_scale
        if CAUSAL:
            scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # rows with nothing seen yet keep m = -inf: subtract 0 there (not -inf - -inf = NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(scores - m_ref[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p rounds to the values' dtype for the tensor cores
        acc = tl.dot(p.to(DOT), v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc

    # the chunk's length, the block's and both positions change from call to call: one compiled variant for all
    @triton.jit(do_not_specialize=["T", "S", "q_start", "k_start"])
    def block_kernel(
        qn_ptr,
        qp_ptr,
        kn_ptr,
        kp_ptr,
        v_ptr,
        o_ptr,
        lse_ptr,
        qk_scale,
        T,
        S,
        q_start,
        k_start,
        stride_qnt,
        stride_qnh,
        stride_qpt,
        stride_qph,
        stride_knt,
        stride_knh,
        stride_kpt,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_lt,
        N: tl.constexpr,
        R: tl.constexpr,
        V: tl.constexpr,
        NP: tl.constexpr,
        RP: tl.constexpr,
        VP: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Query rows of tile pid 0 (the last tile first: it has the most keys), head pid 1, against the block's S
        keys: the normalized output o [T, H, V] and its natural-log lse [T, H] read (what earlier blocks gave; lse
        -inf: none yet), extended by this block, and written back."""
        h = tl.program_id(1).to(tl.int64)
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        rows = tile * BM + tl.arange(0, BM)  # [BM]
        row_ok = rows < T
        n, r, vc = tl.arange(0, NP), tl.arange(0, RP), tl.arange(0, VP)
        qn_ptrs = qn_ptr + h * stride_qnh + rows[:, None] * stride_qnt + n[None, :]
        qn = tl.load(qn_ptrs, mask=row_ok[:, None] & (n < N)[None, :], other=0.0).to(DOT)  # [BM, NP]
        qp_ptrs = qp_ptr + h * stride_qph + rows[:, None] * stride_qpt + r[None, :]
        qp = tl.load(qp_ptrs, mask=row_ok[:, None] & (r < R)[None, :], other=0.0).to(DOT)  # [BM, RP]
        o_ptrs = o_ptr + h * stride_oh + rows[:, None] * stride_ot + vc[None, :]
        o_ok = row_ok[:, None] & (vc < V)[None, :]
        # the earlier blocks' state as (m, l, acc) = (lse, 1, o) in base 2; l = 0 where nothing was seen
        acc = tl.load(o_ptrs, mask=o_ok, other=0.0)  # [BM, VP] fp32
        m_i = tl.load(lse_ptr + rows * stride_lt + h, mask=row_ok, other=float("-inf")) * _LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        # keys every row of the tile sees, in whole tiles (no mask), then those up to the tile's last row
        first_pos = q_start + tile * BM
        last_pos = q_start + tl.minimum(tile * BM + BM, T) - 1
        full = tl.minimum(tl.maximum(first_pos - k_start + 1, 0), S) // BN * BN
        hi = tl.minimum(tl.maximum(last_pos - k_start + 1, 0), S)
        kn_ptr += h * stride_knh
        v_ptr += h * stride_vh
        q_pos = q_start + rows
        for stage in tl.static_range(2):
            # stage 0: the whole tiles every row sees; stage 1: the rest, masked by position
            for s0 in range(full * stage, full + (hi - full) * stage, BN):
                s = s0 + tl.arange(0, BN)
                kn = _key_tile(kn_ptr, s, S, stride_knt, n, N, DOT)  # [BN, NP]
                kp = _key_tile(kp_ptr, s, S, stride_kpt, r, R, DOT)  # [BN, RP]
                v = _key_tile(v_ptr, s, S, stride_vt, vc, V, DOT)  # [BN, VP]
                seen = (s < S)[None, :] & ((k_start + s)[None, :] <= q_pos[:, None])  # [BM, BN]
                m_i, l_i, acc = _attend_tile(
                    qn, qp, kn, kp, v, seen, qk_scale, m_i, l_i, acc, stage == 1, DOT, PRECISION
                )
        any_seen = l_i > 0
        l_safe = tl.where(any_seen, l_i, 1.0)
        lse = tl.where(any_seen, (m_i + tl.math.log2(l_safe)) / _LOG2E, float("-inf"))
        # a row that sees none of the block's keys keeps its state as it was
        touched = row_ok & (q_pos >= k_start)  # [BM]
        tl.store(o_ptrs, acc / l_safe[:, None], mask=o_ok & touched[:, None])
        tl.store(lse_ptr + rows * stride_lt + h, lse, mask=touched)
