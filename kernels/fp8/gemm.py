"""The prefill GEMM of fp8_linear (kernels/fp8/linear.py): y = x @ W^T for x of more than GEMV_MAX_TOKENS tokens and
W in DeepSeek's FP8 format (e4m3, one fp32 scale per 128x128 block), in two forms by the device's FP8 path
(kernels/backend.py):
  - NATIVE (sm_89 on): W8A8 on FP8 tensor cores, as DeepSeek's gemm_impl="fp8" and as the model was trained:
    act_quant rounds x to e4m3 per token and 128-wide K group, then every K step adds
    tl.dot(x_q, w_q) * x_scale * w_scale. Rounding x to 3 mantissa bits costs about 2.6% relative error against
    unrounded x on random data (fp8_gemm_ref is its reference).
  - BY_BITS (sm_80, sm_86: no FP8 tensor cores, no e4m3 conversion): W8A16. Each K step widens W's e4m3 tile by
    bit placement to x's dtype (kernels/fp8/e4m3_bits.py: the values times 2^-8, exact) and adds
    tl.dot(x, w) * (w_scale * 2^8) on bf16/fp16 tensor cores with fp32 sums. x is not rounded, so this path's
    result is fp8_linear_ref's up to fp32 summation, and differs from the NATIVE path's by act_quant's rounding.
Tiles follow rules of (T, N, SM count, shared memory), not an autotuner, so a launch can be graph-captured: 128x128
output tiles once they fill every SM, else 64x128 for twice the programs; GEMM_STAGES K steps in flight where the
card's shared memory holds them, fewer (then the smaller tile) where it does not.
Legend: T tokens, N output rows, K input columns, Nb x Kb the scale grid (ceil of N/128, K/128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsfp4.kernels.backend import REFERENCE_CARD, Card, card, interpreted, tl, triton
from dsfp4.kernels.fp8.e4m3_bits import E4M3_F16_UNSCALE
from dsfp4.layout.formats import ceil_div
from dsfp4.layout.fp4 import E4M3_MAX, exact_div
from dsfp4.layout.fp8 import FP8_BLOCK, fp8_block_dequantize

GEMM_BLOCK_N = 128
# token rows per GEMM tile: the large one once the tiles fill every SM
GEMM_BLOCK_M = (64, 128)
# K steps in flight where shared memory holds them: NATIVE at 128x128 takes 3 x 32 KiB
GEMM_STAGES = 3
# fewer stages than this: the smaller row tile instead
GEMM_MIN_STAGES = 2
# sm_90's major version: wgmma's pipeline allots shared memory its own way
HOPPER = 9
# row tiles that take turns on one weight column tile while it sits in L2
GEMM_GROUP_M = 8
# 128-wide groups per act_quant program
ACT_GROUPS = 8


@dataclass(frozen=True)
class GemmPlan:
    """block_m x block_n: the output tile of one program, 128 deep in K (one scale block)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def gemm_smem(block_m: int, stages: int, by_bits: bool, x_elt: int, capability: tuple[int, int]) -> int:
    """Shared memory of the GEMM at block_m x GEMM_BLOCK_N with `stages`, as Triton 3.9 allots it (read from the
    compiled kernels, tests/kernels/test_fp8_tiles.py): a K step holds x's and W's tiles (NATIVE both e4m3, BY_BITS
    x in its dtype and W's bytes); on sm_90 `stages` of them and for BY_BITS W's bytes once more (wgmma reads the
    widened tile), elsewhere (cp.async, mma.sync) stages - 1 of them."""
    step = FP8_BLOCK * (block_m * (x_elt if by_bits else 1) + GEMM_BLOCK_N)
    if capability[0] == HOPPER:
        return stages * step + (FP8_BLOCK * GEMM_BLOCK_N if by_bits else 0)
    return max(1, stages - 1) * step


def gemm_plan(t: int, n: int, card: Card = REFERENCE_CARD, by_bits: bool = False, x_elt: int = 2) -> GemmPlan:
    """128x128 tiles (8 warps) once they fill every SM, else 64x128 (4 warps) for twice the programs; GEMM_STAGES
    K steps in flight, fewer where the card's shared memory does not hold them, and the 64-row tile where it holds
    fewer than GEMM_MIN_STAGES of 128 rows."""
    small, large = GEMM_BLOCK_M
    block_m = large if ceil_div(t, large) * ceil_div(n, GEMM_BLOCK_N) >= card.sms else small
    while True:
        stages = GEMM_STAGES
        while stages > 1 and gemm_smem(block_m, stages, by_bits, x_elt, card.capability) > card.smem:
            stages -= 1
        if stages >= GEMM_MIN_STAGES or block_m == small:
            return GemmPlan(block_m, GEMM_BLOCK_N, 8 if block_m == large else 4, stages)
        block_m = small


# ---- torch references ----------------------------------------------------------------------------------


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [T, K], q: [N, K] e4m3, scale: [Nb, Kb] -> [T, N] in x's dtype, computed in fp32 from W in fp32."""
    return F.linear(x.float(), fp8_block_dequantize(q, scale, dtype=torch.float32)).to(x.dtype)


def act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] -> (x_q [T, K] e4m3, x_scale [T, Kb] fp32): x ~ x_q * x_scale per 128-wide group,
    x_scale = group amax / 448 (1 for an all-zero group)."""
    t, k = x.shape
    kb = ceil_div(k, FP8_BLOCK)
    groups = F.pad(x.float(), (0, kb * FP8_BLOCK - k)).reshape(t, kb, FP8_BLOCK)  # [T, Kb, 128]
    amax = groups.abs().amax(dim=-1)
    s = torch.where(amax > 0, exact_div(amax, E4M3_MAX), torch.ones_like(amax))
    q = (groups / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(t, -1)[:, :k].contiguous(), s


def fp8_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The NATIVE fp8_gemm's result: x rounded by act_quant_ref, then fp8_linear_ref -> [T, N] in x's dtype."""
    x_q, x_s = act_quant_ref(x)
    x_d = x_q.float() * x_s.repeat_interleave(FP8_BLOCK, dim=1)[:, : x.shape[1]]
    return fp8_linear_ref(x_d, q, scale).to(x.dtype)


# ---- Triton kernels ------------------------------------------------------------------------------------

if triton is not None:
    from dsfp4.kernels.fp8.e4m3_bits import e4m3_codes, e4m3_scale, e4m3_tile

    _UNSCALE = tl.constexpr(E4M3_F16_UNSCALE)

    @triton.jit
    def act_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        K,
        stride_xt,
        stride_qt,
        stride_st,
        GROUPS: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        QMAX: tl.constexpr,
    ):
        """One token's GROUPS 128-wide groups: q = round(x / s), s = amax / 448 (1 when amax is 0)."""
        # int64: T * K may pass 2^31
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [G] group indices
        cols = g[:, None] * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)[None, :]  # [G, 128]
        x = tl.load(x_ptr + t * stride_xt + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        s = e4m3_scale(amax, QMAX)  # [G]
        # IEEE division, as the reference's
        q = e4m3_codes(x, s[:, None], QMAX)
        tl.store(q_ptr + t * stride_qt + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
        tl.store(s_ptr + t * stride_st + g, s, mask=g * SCALE_BLOCK < K)

    @triton.jit
    def _tile(T, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of this program: GROUP_M row tiles take turns on a column tile while it sits in L2."""
        pid = tl.program_id(0)
        n_m, n_n = tl.cdiv(T, BLOCK_M), tl.cdiv(N, BLOCK_N)
        first_m = (pid // (GROUP_M * n_n)) * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        return first_m + (pid % (GROUP_M * n_n)) % size_m, (pid % (GROUP_M * n_n)) // size_m

    @triton.jit
    def fp8_gemm_kernel(
        a_ptr,
        sa_ptr,
        b_ptr,
        sb_ptr,
        y_ptr,
        T,
        N,
        K,
        stride_at,
        stride_sat,
        stride_bn,
        stride_sbn,
        stride_yt,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """NATIVE: y = sum over 128-wide K steps of (a_q . b_q) * sa[t] * sb[n / 128]: a [T, K] e4m3 with sa [T, Kb],
        b [N, K] e4m3 with sb [Nb, Kb]."""
        pid_m, pid_n = _tile(T, N, BLOCK_M, BLOCK_N, GROUP_M)
        # wrapped rows and columns read valid memory; their results are dropped at the store
        # int64: T * K may pass 2^31
        rows = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % T).to(tl.int64)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # one K step = one scale block
        for kb in range(0, tl.cdiv(K, SCALE_BLOCK)):
            ks = kb * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
            a = tl.load(a_ptr + rows[:, None] * stride_at + ks[None, :], mask=(ks < K)[None, :], other=0.0)
            b = tl.load(b_ptr + cols[:, None] * stride_bn + ks[None, :], mask=(ks < K)[None, :], other=0.0)
            sa = tl.load(sa_ptr + rows * stride_sat + kb)  # [BM]
            sb = tl.load(sb_ptr + (cols // SCALE_BLOCK) * stride_sbn + kb)  # [BN]
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        out_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (out_m < T)[:, None] & (out_n < N)[None, :]
        tl.store(y_ptr + out_m[:, None] * stride_yt + out_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def fp8_gemm_bits_kernel(
        x_ptr,
        b_ptr,
        sb_ptr,
        y_ptr,
        T,
        N,
        K,
        stride_xt,
        stride_bn,
        stride_sbn,
        stride_yt,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        GROUP_M: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        """BY_BITS: y = sum over 128-wide K steps of (x . w) * sb[n / 128] * 2^8: x [T, K] bf16/fp16, b [N, K] W's
        e4m3 bytes (uint8) widened to w = W * 2^-8 in x's dtype (WIDE: fp32, for the interpreter), sb [Nb, Kb]."""
        DOT: tl.constexpr = tl.float32 if WIDE else x_ptr.dtype.element_ty
        PRECISION: tl.constexpr = "ieee" if WIDE else "tf32"
        pid_m, pid_n = _tile(T, N, BLOCK_M, BLOCK_N, GROUP_M)
        # wrapped rows and columns read valid memory; their results are dropped at the store
        rows = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % T).to(tl.int64)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, SCALE_BLOCK)):
            ks = kb * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
            x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=(ks < K)[None, :], other=0.0)
            b = tl.load(b_ptr + cols[:, None] * stride_bn + ks[None, :], mask=(ks < K)[None, :], other=0)
            w = e4m3_tile(b, DOT)  # [BN, 128], exact
            sb = tl.load(sb_ptr + (cols // SCALE_BLOCK) * stride_sbn + kb) * _UNSCALE  # [BN]
            # exact products either way (the interpreter cannot multiply bf16 tiles; fp32 ones it gets right)
            acc += tl.dot(x.to(DOT), tl.trans(w), input_precision=PRECISION) * sb[None, :]
        out_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        out_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (out_m < T)[:, None] & (out_n < N)[None, :]
        tl.store(y_ptr + out_m[:, None] * stride_yt + out_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- wrappers ------------------------------------------------------------------------------------------


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant_ref in Triton: x [T, K] -> (x_q [T, K] e4m3, x_scale [T, Kb] fp32), the same bits."""
    x = x if x.stride(1) == 1 else x.contiguous()
    t, k = x.shape
    kb = ceil_div(k, FP8_BLOCK)
    x_q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    x_s = torch.empty(t, kb, dtype=torch.float32, device=x.device)
    act_quant_kernel[(t, triton.cdiv(kb, ACT_GROUPS))](
        x,
        x_q,
        x_s,
        k,
        x.stride(0),
        x_q.stride(0),
        x_s.stride(0),
        GROUPS=ACT_GROUPS,
        SCALE_BLOCK=FP8_BLOCK,
        QMAX=E4M3_MAX,
    )
    return x_q, x_s


def fp8_gemm(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, by_bits: bool = False, plan: GemmPlan | None = None
) -> torch.Tensor:
    """x: [T, K] bf16/f16 (rows of unit stride), q: [N, K] e4m3, scale: [Nb, Kb] fp32 (both contiguous) -> y [T, N]
    in x's dtype. NATIVE (by_bits False): x rounded to e4m3 per token and 128-wide group on the way (W8A8;
    fp8_gemm_ref is its reference). by_bits: W8A16, x as it is (fp8_linear_ref's result). plan: gemm_plan's
    tiles for this device unless given (a benchmark pins a card's)."""
    (t, k), n = x.shape, q.shape[0]
    p = plan or gemm_plan(t, n, card(x.device), by_bits, x.element_size())
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(t, p.block_m) * triton.cdiv(n, p.block_n),)
    tiles = dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, SCALE_BLOCK=FP8_BLOCK, GROUP_M=GEMM_GROUP_M)
    launch = dict(num_warps=p.num_warps, num_stages=p.num_stages)
    if by_bits:
        b = q.view(torch.uint8)
        fp8_gemm_bits_kernel[grid](
            x,
            b,
            scale,
            y,
            t,
            n,
            k,
            x.stride(0),
            b.stride(0),
            scale.stride(0),
            y.stride(0),
            WIDE=interpreted(),
            **tiles,
            **launch,
        )
        return y
    x_q, x_s = act_quant(x)
    fp8_gemm_kernel[grid](
        x_q,
        x_s,
        q,
        scale,
        y,
        t,
        n,
        k,
        x_q.stride(0),
        x_s.stride(0),
        q.stride(0),
        scale.stride(0),
        y.stride(0),
        **tiles,
        **launch,
    )
    return y
