"""The decompressed MLA prefill's Triton program (prefill.py plans the key blocks and launches it): flash attention's
forward over one key block, a program per (BM query rows, head), continuing the online softmax that earlier blocks left
in the output and its log-sum-exp. Scores are q_nope k_nope^T + q_pe k_pe^T in fp32 on tensor cores, k_pe one row
per key for every head; causality by position (query row i at q_start + i sees keys at k_start + j <= its own).
FP8 (prefill.py's fp8): q_nope, k_nope and v arrive rounded to e4m3 with fp32 scales (e4m3_rows.py), the nope scores
are an e4m3 product times both rows' scales, the probabilities go to the second product as p * 448 in e4m3, and the
output is kept in units of v_scale / 448 while this program runs; the rope product stays in q_pe's dtype.
Legend: BM query rows, BN keys per tile, N nope dim, R rope dim, V value dim (NP, RP, VP: padded to tl.dot's sizes).
"""

from __future__ import annotations

import math

from dsfp4.kernels.backend import tl, triton
from dsfp4.layout.fp4 import E4M3_MAX

# scores are kept in base-2 units: exp2 is the hardware's exponential
LOG2E = math.log2(math.e)

if triton is not None:
    from dsfp4.kernels.fp8.e4m3_bits import round_e4m3

    _LOG2E = tl.constexpr(LOG2E)
    _E4M3_MAX = tl.constexpr(E4M3_MAX)

    @triton.jit
    def _key_tile(
        ptr, s, S, stride, cols, stride_c, N: tl.constexpr, DOT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr
    ):
        """[BN, len(cols)] the block's key rows s (row stride `stride`, column stride `stride_c`, ptr at the head's
        columns) in the products' dtype; 0 past the block's S rows (ROWS: some may be) and at columns cols >= N
        (COLS: the tile is wider than N). A mask is taken only where needed: one along the keys, S unknown to the
        compiler, would load FP8's values (keys contiguous) a byte at a time."""
        ptrs = ptr + s[:, None] * stride + cols[None, :] * stride_c
        if ROWS and COLS:
            tile = tl.load(ptrs, mask=(s < S)[:, None] & (cols < N)[None, :], other=0.0)
        elif ROWS:
            tile = tl.load(ptrs, mask=(s < S)[:, None], other=0.0)
        elif COLS:
            tile = tl.load(ptrs, mask=(cols < N)[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
        return tile.to(DOT)

    @triton.jit
    def _row_scales(ptr, idx, ok, stride, h, FP8: tl.constexpr):
        """[len(idx)] the e4m3 rows' fp32 scales at rows idx of head h (0 where not ok) under FP8; else 1.0, unused."""
        scale = 1.0
        if FP8:
            scale = tl.load(ptr + idx * stride + h, mask=ok, other=0.0)
        return scale

    @triton.jit
    def _probs_e4m3(p, WIDE: tl.constexpr):
        """p [BM, BN] in [0, 1] -> p * 448 in e4m3, so that small probabilities keep e4m3's 3 mantissa bits (not its
        subnormals): fp8 for the tensor cores, or the same values in fp32 when WIDE (the interpreter, whose fp32 to
        fp8 cast drops a carry)."""
        p = p * _E4M3_MAX
        return round_e4m3(p) if WIDE else p.to(tl.float8e4nv)

    @triton.jit
    def _attend_tile(
        qn,
        qp,
        kn,
        kp,
        v,
        qs,
        ks,
        seen,
        qk_scale,
        m_i,
        l_i,
        acc,
        CAUSAL: tl.constexpr,
        DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        FP8: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        """A tile of keys kn [BN, NP], kp [BN, RP], v [BN, VP] folded into the rows' running max m_i [BM], sum l_i
        [BM] and unnormalized output acc [BM, VP] (base 2) -> the three updated. CAUSAL: the tile crosses the diagonal
        or the block's end, and only the pairs `seen` [BM, BN] count; else every row sees every key of the tile.
        FP8: qn, kn and v hold e4m3 values (in fp32 when WIDE), qs [BM] and ks [BN] the nope rows' scales, and acc
        is in units of v_scale / 448."""
        scores = tl.dot(qn, tl.trans(kn), input_precision=PRECISION)  # [BM, BN] fp32
        if FP8:
            scores = scores * (qs[:, None] * ks[None, :])
        scores = tl.dot(qp, tl.trans(kp), scores, input_precision=PRECISION) * qk_scale
        if CAUSAL:
            scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # rows with nothing seen yet keep m = -inf: subtract 0 there (not -inf - -inf = NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(scores - m_ref[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            # a fresh product added in fp32: sm_90 sums FP8 products in less than fp32 (Triton's default never
            # promotes), so the running output stays out of the tensor cores' accumulator
            acc = acc * alpha[:, None] + tl.dot(_probs_e4m3(p, WIDE), v, input_precision=PRECISION)
        else:
            # p rounds to the values' dtype for the tensor cores
            acc = tl.dot(p.to(DOT), v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _value_units(acc, vs_ptrs, v_ok, FP8: tl.constexpr):
        """acc [BM, VP] (the loaded normalized output) -> (acc, vf [VP]): under FP8 acc in units of vf = v_scale /
        448, what the e4m3 product dot(p * 448, v / v_scale) adds up in; else acc as it is and vf 1.0 (unused)."""
        vf = 1.0
        if FP8:
            vf = tl.load(vs_ptrs, mask=v_ok, other=1.0) / _E4M3_MAX
            # a zero scale (no finite factor to divide by) would only come with all-zero values: any factor serves
            vf = tl.where(vf > 0, vf, 1.0)
            acc = acc / vf[None, :]
        return acc, vf

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
        stride_vc,
        stride_ot,
        stride_oh,
        stride_lt,
        qs_ptr,
        ks_ptr,
        vs_ptr,
        stride_qst,
        stride_kst,
        stride_vsh,
        N: tl.constexpr,
        R: tl.constexpr,
        V: tl.constexpr,
        NP: tl.constexpr,
        RP: tl.constexpr,
        VP: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        DOT: tl.constexpr,
        NV_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        FP8: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        """Query rows of tile pid 0 (the last tile first: it has the most keys), head pid 1, against the block's S
        keys: the normalized output o [T, H, V] and its natural-log lse [T, H] read (what earlier blocks gave; lse
        -inf: none yet), extended by this block, and written back. NV_DOT: the nope and value tiles' dtype (DOT's,
        or under FP8 e4m3's: fp32 when WIDE); FP8: their scales qs [T, H], ks [S, H], vs [H, V]."""
        h = tl.program_id(1).to(tl.int64)
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        rows = tile * BM + tl.arange(0, BM)  # [BM]
        # int64 offsets: a long chunk's T rows of H heads pass 2^31 elements
        at = rows.to(tl.int64)
        row_ok = rows < T
        n, r, vc = tl.arange(0, NP), tl.arange(0, RP), tl.arange(0, VP)
        qn_ptrs = qn_ptr + h * stride_qnh + at[:, None] * stride_qnt + n[None, :]
        qn = tl.load(qn_ptrs, mask=row_ok[:, None] & (n < N)[None, :], other=0.0).to(NV_DOT)  # [BM, NP]
        qs = _row_scales(qs_ptr, rows, row_ok, stride_qst, h, FP8)  # [BM]
        qp_ptrs = qp_ptr + h * stride_qph + at[:, None] * stride_qpt + r[None, :]
        qp = tl.load(qp_ptrs, mask=row_ok[:, None] & (r < R)[None, :], other=0.0).to(DOT)  # [BM, RP]
        o_ptrs = o_ptr + h * stride_oh + at[:, None] * stride_ot + vc[None, :]
        o_ok = row_ok[:, None] & (vc < V)[None, :]
        # the earlier blocks' state as (m, l, acc) = (lse, 1, o) in base 2; l = 0 where nothing was seen
        acc = tl.load(o_ptrs, mask=o_ok, other=0.0)  # [BM, VP] fp32
        m_i = tl.load(lse_ptr + at * stride_lt + h, mask=row_ok, other=float("-inf")) * _LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc, vf = _value_units(acc, vs_ptr + h * stride_vsh + vc, vc < V, FP8)
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
                # stage 0's tiles end at or before `full` <= S: no key past the block's end
                kn = _key_tile(kn_ptr, s, S, stride_knt, n, 1, N, NV_DOT, stage == 1, N < NP)  # [BN, NP]
                kp = _key_tile(kp_ptr, s, S, stride_kpt, r, 1, R, DOT, stage == 1, R < RP)  # [BN, RP]
                v = _key_tile(v_ptr, s, S, stride_vt, vc, stride_vc, V, NV_DOT, stage == 1, V < VP)  # [BN, VP]
                ks = _row_scales(ks_ptr, s, s < S, stride_kst, h, FP8)  # [BN]
                seen = (s < S)[None, :] & ((k_start + s)[None, :] <= q_pos[:, None])  # [BM, BN]
                m_i, l_i, acc = _attend_tile(
                    qn, qp, kn, kp, v, qs, ks, seen, qk_scale, m_i, l_i, acc, stage == 1, DOT, PRECISION, FP8, WIDE
                )
        any_seen = l_i > 0
        l_safe = tl.where(any_seen, l_i, 1.0)
        lse = tl.where(any_seen, (m_i + tl.math.log2(l_safe)) / _LOG2E, float("-inf"))
        # a row that sees none of the block's keys keeps its state as it was
        touched = row_ok & (q_pos >= k_start)  # [BM]
        if FP8:
            acc = acc * vf[None, :]
        tl.store(o_ptrs, acc / l_safe[:, None], mask=o_ok & touched[:, None])
        tl.store(lse_ptr + at * stride_lt + h, lse, mask=touched)
