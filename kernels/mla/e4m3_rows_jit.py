"""e4m3_rows' Triton programs (e4m3_rows.py launches them, its torch formula beside them): rows rounded to e4m3 with
one fp32 scale each, read in x's own dtype and strides with no fp32 copy (the keys' kernel reads x twice: the amax, then
the codes). The same arithmetic as the formula:
scale = amax / 448 (1 for an all-zero row) and x / scale, both IEEE divisions, clamped to +-448 and rounded to the
nearest e4m3 value (kernels/fp8/e4m3_bits.py's e4m3_scale and e4m3_codes, which the FP8 GEMM's activations take too;
the GPU's cast of a rounded value is exact), so the two give the same bytes for finite x (the max and the clamp here
drop a NaN, which the formula keeps).
Legend: R rows, D the rounded dim, S keys, H heads, V channels.
"""

from __future__ import annotations

from dsfp4.kernels.backend import tl, triton

if triton is not None:
    from dsfp4.kernels.fp8.e4m3_bits import e4m3_codes, e4m3_scale

    @triton.jit
    def inner_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        R,
        R2,
        stride_1,
        stride_2,
        D: tl.constexpr,
        DP: tl.constexpr,
        BLOCK_R: tl.constexpr,
        QMAX: tl.constexpr,
    ):
        """x [R1, R2, D] (strides stride_1, stride_2, 1; R = R1 R2 rows) -> q [R, D] e4m3 and s [R], contiguous:
        BLOCK_R rows a program, each of D (padded to DP) elements."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        cols = tl.arange(0, DP)
        ok = (r < R)[:, None] & (cols < D)[None, :]
        rows = (r // R2) * stride_1 + (r % R2) * stride_2
        x = tl.load(x_ptr + rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)  # [BR, DP]
        s = e4m3_scale(tl.max(tl.abs(x), 1), QMAX)  # [BR]
        q = e4m3_codes(x, s[:, None], QMAX)
        tl.store(q_ptr + r[:, None] * D + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + r, s, mask=r < R)

    @triton.jit
    def key_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        S,
        stride_s,
        stride_h,
        V: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_C: tl.constexpr,
        QMAX: tl.constexpr,
    ):
        """x [S, H, V] (strides stride_s, stride_h, 1), each (head, channel) rounded over the S keys -> q [H, V, S]
        e4m3 (keys contiguous) and s [H, V]: head pid 0, BLOCK_C channels pid 1, two passes over the keys (the
        channels' amax, then their codes)."""
        h = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
        c_ok = c < V
        base = x_ptr + h * stride_h + c[None, :]
        amax = tl.zeros([BLOCK_C], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            k = s0 + tl.arange(0, BLOCK_S)
            ok = (k < S)[:, None] & c_ok[None, :]
            x = tl.load(base + k[:, None].to(tl.int64) * stride_s, mask=ok, other=0.0).to(tl.float32)  # [BS, BC]
            amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
        s = e4m3_scale(amax, QMAX)  # [BC]
        out = q_ptr + (h * V + c[None, :]) * S
        for s0 in range(0, S, BLOCK_S):
            k = s0 + tl.arange(0, BLOCK_S)
            ok = (k < S)[:, None] & c_ok[None, :]
            x = tl.load(base + k[:, None].to(tl.int64) * stride_s, mask=ok, other=0.0).to(tl.float32)
            q = e4m3_codes(x, s[None, :], QMAX)
            tl.store(out + k[:, None], q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + h * V + c, s, mask=c_ok)
