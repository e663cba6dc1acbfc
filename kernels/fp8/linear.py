"""y = x @ W^T with W in DeepSeek's FP8 format (e4m3, one fp32 scale per 128x128 block), never dequantized
into memory.

`fp8_linear` picks a Triton kernel by token count:
  - fp8_gemv (T <= GEMV_MAX_TOKENS, decode): W8A16 on CUDA cores, two kernels. bf16/fp16 x takes the piece
    kernel (kernels/fp8/gemv.py: rows read in 8-byte pieces, one thread per piece and row, fp16x2 products on x
    scaled per piece, or fp32 products; GEMV_MATH picks); fp32 x (the exact runs) takes fp8_gemv_kernel, which
    converts BLOCK_N rows to fp32 once per K step and multiplies each 128-wide partial sum by its block scale.
    From GEMV_MMA_TOKENS tokens (16 where K is long) bf16/fp16 x takes the tensor cores instead
    (kernels/fp8/gemv_mma.py: W widened exactly to x's dtype, fp32 products and sums), where the piece kernel's
    per-token instructions would bind.
    When the rows give too few programs, K is split and the fp32 partials of the splits are summed in a fixed
    order by a second small kernel: no atomics, the same bits on every run.
  - fp8_gemm (larger T, prefill; kernels/fp8/gemm.py): W8A8 on FP8 tensor cores (x rounded to e4m3 per token and
    128-wide group, as DeepSeek's gemm_impl="fp8"), or W8A16 on bf16/fp16 tensor cores where the device's FP8 path
    is BY_BITS; there, from WIDEN_GEMM_TOKENS tokens, W widened a piece at a time and multiplied by cuBLAS instead
    (kernels/fp8/widened_gemm.py, `gemm_route`). fp32 activations (the exact runs) take the reference instead.
The device's FP8 path (kernels/backend.py fp8_path) decides: NATIVE (sm_89 on) the kernels above as they are; BY_BITS
(sm_80, sm_86, or forced by DSFP4_FP8_BY_BITS=1) the same kernels converting e4m3 by bit placement
(kernels/fp8/e4m3_bits.py) and the W8A16 GEMM; REFERENCE (no Triton, CPU, older GPUs) fp8_linear_ref for every T.
Block sizes follow small rules of (T, N, K, SM count, shared memory), not an autotuner, so a launch can be
graph-captured.
Legend: T tokens, N output rows, K input columns, Nb x Kb the scale grid (ceil of N/128, K/128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsfp4.kernels.backend import WARP, FP8Path, fp8_path, has_fp8_kernels, interpreted, n_sms, tl, triton
from dsfp4.kernels.fp8.gemm import act_quant, act_quant_ref, fp8_gemm, fp8_gemm_ref, fp8_linear_ref
from dsfp4.kernels.fp8.gemv import PIECE
from dsfp4.kernels.fp8.widened_gemm import fp8_widened_gemm, gemm_route
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.formats import ceil_div, next_pow2
from dsfp4.layout.fp8 import FP8_BLOCK, scale_grid

# the GEMM's names, where fp8_linear's callers and tests have found them
__all__ = ["act_quant", "act_quant_ref", "fp8_gemm", "fp8_gemm_ref", "fp8_linear", "fp8_linear_ref", "fp8_gemv"]

# decode and speculative verify batches; above it tensor cores pay
GEMV_MAX_TOKENS = DECODE_TOKENS
# bf16/fp16 x: "f16x2" or "f32" (the piece kernel's maths), "legacy" (fp8_gemv_kernel)
GEMV_MATH = "f16x2"
# bf16/fp16 x of this many tokens and more: the tensor-core GEMV ("mma", gemv_mma.py) ...
GEMV_MMA_TOKENS = 8
# ... but above this K only at GEMV_MAX_TOKENS: its long K loop lost to the piece kernel at 8 tokens on V3's o, q_a,
# kv_a, shared w13 and won on q_b and shared w2 (docs/BENCHMARKS.md, run 67)
GEMV_MMA_LONG_K = 2048
# its token tile: the smallest tensor-core product's rows
GEMV_MMA_TOKEN_ROWS = 16
# its rows per program, halved from the first to the second while the SMs lack programs
GEMV_MMA_ROWS = (64, 16)
# piece kernel: (up to T tokens, rows per program); a thread keeps T x rows fp32
GEMV_ROWS = ((8, 8), (16, 4))
# accumulators and 8 bytes of every row per step in registers (16 rows: slower at T = 1, spills at T = 4 on sm_90)
# the piece kernel halves its rows down to this while fewer than PROGRAMS_PER_SM row blocks per SM
GEMV_MIN_ROWS = 4
GEMV_WARPS = 4
# pieces per thread and row in one step: BLOCK_K = PIECE * 32 lanes * warps * pieces
GEMV_PIECES = 1
# fp8_gemv_kernel's rows per program: small tiles keep many programs reading (kernels-limits 4.1)
GEMV_BLOCK_N = 16
# fp8_gemv_kernel's columns per step: 8 KiB of weights in flight per program
GEMV_MAX_BLOCK_K = 512
# the GEMV splits K until its grid reaches this many programs per SM
PROGRAMS_PER_SM = 2
# outputs per program of the split-sum kernel
SUM_BLOCK = 1024


@dataclass(frozen=True)
class GemvPlan:
    """math: "legacy" (fp8_gemv_kernel), "f16x2" or "f32" (the piece kernel), "mma" (gemv_mma.py); block_t:
    the token lanes (legacy: T rounded up to a power of two; mma: 16); block_n x block_k: the weight tile of one
    step; split: programs along K, each covering k_split columns."""

    block_t: int
    block_n: int
    block_k: int
    split: int
    k_split: int
    math: str = "legacy"
    num_warps: int = 4


def _split(n: int, k: int, rows: int, block_k: int, n_sms: int) -> tuple[int, int]:
    """(split, k_split): K split in whole steps until the grid reaches PROGRAMS_PER_SM programs per SM."""
    k_tiles = ceil_div(k, block_k)
    per_split = ceil_div(k_tiles, min(k_tiles, ceil_div(PROGRAMS_PER_SM * n_sms, ceil_div(n, rows))))
    return ceil_div(k_tiles, per_split), per_split * block_k


def gemv_plan(
    t: int,
    n: int,
    k: int,
    n_sms: int,
    math: str | None = None,
    rows: int | None = None,
    block_k: int | None = None,
    warps: int = GEMV_WARPS,
) -> GemvPlan:
    """The GEMV's tiles for `math` (GEMV_MATH when None). legacy: 16 rows per program, up to 512 columns per step,
    K split when the row blocks leave SMs idle (q_a 1536x7168 3 ways, kv_a 576x7168 7 ways, o not at all). Piece
    kernel: GEMV_ROWS's rows for T, halved (to GEMV_MIN_ROWS) while the row blocks number fewer than two per SM, K
    split only when they number fewer than the SMs (none of DeepSeek's shapes: q_a, kv_a and the shared expert's
    w1/w3 take 4 rows); `rows` and `block_k` pin a tile (the FP8 probes in docs/BENCHMARKS.md measured the rules)."""
    math = GEMV_MATH if math is None else math
    if math == "mma":
        rows, least = GEMV_MMA_ROWS
        while rows > least and ceil_div(n, rows) < PROGRAMS_PER_SM * n_sms:
            rows //= 2
        whole = (1, ceil_div(k, FP8_BLOCK) * FP8_BLOCK)
        split, k_split = _split(n, k, rows, FP8_BLOCK, n_sms) if ceil_div(n, rows) < n_sms else whole
        return GemvPlan(GEMV_MMA_TOKEN_ROWS, rows, FP8_BLOCK, split, k_split, math, warps)
    if math == "legacy":
        block_k = min(GEMV_MAX_BLOCK_K, max(FP8_BLOCK, next_pow2(k)))
        return GemvPlan(next_pow2(t), GEMV_BLOCK_N, block_k, *_split(n, k, GEMV_BLOCK_N, block_k, n_sms))
    assert math in ("f16x2", "f32"), f"unknown GEMV math {math!r}"
    # small K: fewer idle
    block_k = block_k or min(PIECE * WARP * warps * GEMV_PIECES, max(PIECE * WARP, next_pow2(k)))
    if rows is None:
        rows = next(r for most, r in GEMV_ROWS if t <= most)
        while rows > GEMV_MIN_ROWS and ceil_div(n, rows) < PROGRAMS_PER_SM * n_sms:
            rows //= 2
    assert FP8_BLOCK % rows == 0 and block_k % PIECE == 0, "a program's rows share one row of block scales"
    whole = (1, ceil_div(k, block_k) * block_k)
    split, k_split = _split(n, k, rows, block_k, n_sms) if ceil_div(n, rows) < n_sms else whole
    return GemvPlan(next_pow2(t), rows, block_k, split, k_split, math, warps)


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    assert x.dim() == 2 and q.dim() == 2 and x.shape[1] == q.shape[1], "x: [T, K] against q: [N, K]"
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, "q: e4m3, scale: fp32"
    assert tuple(scale.shape) == scale_grid(tuple(q.shape)), "scale grid does not fit q"
    # rows may be strided, elements must not
    x = x if x.stride(1) == 1 else x.contiguous()
    return x, q.contiguous(), scale.contiguous()


# ---- Triton kernels ------------------------------------------------------------------------------------

if triton is not None:
    from dsfp4.kernels.fp4.codes import block_scale
    from dsfp4.kernels.fp8.gemv import fp8_gemv_pieces_kernel
    from dsfp4.kernels.fp8.gemv_mma import fp8_gemv_mma_kernel

    @triton.jit
    def fp8_gemv_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        out_ptr,
        T,
        N,
        K,
        stride_xt,
        stride_qn,
        stride_sn,
        stride_ot,
        stride_os,
        k_split,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALE_BLOCK: tl.constexpr,
        BY_BITS: tl.constexpr,
    ):
        """out[split, t, rows] = the split's K range of x[t] . W[rows] (out: y itself when there is one split).
        BY_BITS: q_ptr points at W's bytes (uint8), widened to fp32 from their bits."""
        GROUPS: tl.constexpr = BLOCK_K // SCALE_BLOCK
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        # token lanes of the accumulator
        lanes = tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        k_start = pid_s * k_split
        for k0 in range(k_start, tl.minimum(k_start + k_split, K), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(
                q_ptr + (rows % N)[:, None] * stride_qn + cols[None, :], mask=(cols < K)[None, :], other=0.0
            )  # [BN, BK]: rows past N read row r % N, dropped at the store
            w = block_scale(w, E8M0=False) if BY_BITS else w.to(tl.float32)
            kb = k0 // SCALE_BLOCK + tl.arange(0, GROUPS)
            s = tl.load(
                s_ptr + ((rows % N) // SCALE_BLOCK)[:, None] * stride_sn + kb[None, :],
                mask=(kb * SCALE_BLOCK < K)[None, :],
                other=0.0,
            )  # [BN, GROUPS]
            # the weights stay in registers for every token
            for t in range(T):
                xv = tl.load(x_ptr + t * stride_xt + cols, mask=cols < K, other=0.0).to(tl.float32)  # [BK]
                part = tl.sum(tl.reshape(w * xv[None, :], (BLOCK_N, GROUPS, SCALE_BLOCK)), 2)  # [BN, GROUPS]
                acc += tl.where(lanes[:, None] == t, tl.sum(part * s, 1)[None, :], 0.0)
        out = out_ptr + pid_s * stride_os + lanes[:, None] * stride_ot + rows[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(lanes < T)[:, None] & (rows < N)[None, :])

    @triton.jit
    def sum_splits_kernel(ws_ptr, y_ptr, M, split, BLOCK: tl.constexpr):
        """y[m] = sum over s of ws[s, m], s ascending (ws: [split, M] fp32)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M
        acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
        for s in range(1, split):
            acc += tl.load(ws_ptr + s * M + offs, mask=mask, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

# ---- wrappers ------------------------------------------------------------------------------------------


def gemv_math(x: torch.Tensor, k: int, math: str | None = None) -> str:
    """The GEMV kernel x [T, K] takes: fp32 x and K off the piece grid the legacy one, else `math`, else the
    tensor cores from GEMV_MMA_TOKENS tokens (from GEMV_MAX_TOKENS above GEMV_MMA_LONG_K), else GEMV_MATH."""
    if x.dtype == torch.float32 or k % PIECE:
        return "legacy"
    t = x.shape[0]
    mma = t >= (GEMV_MMA_TOKENS if k <= GEMV_MMA_LONG_K else GEMV_MAX_TOKENS)
    return math or ("mma" if mma else GEMV_MATH)


def fp8_gemv(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, math: str | None = None, by_bits: bool = False
) -> torch.Tensor:
    """x: [T, K] (T <= 16) bf16/f16/f32, q: [N, K] e4m3, scale: [Nb, Kb] fp32 -> y [T, N] in x's dtype.
    math overrides GEMV_MATH for bf16/fp16 x (gemv_math); by_bits: e4m3 widened by bit placement (the BY_BITS path)."""
    x, q, scale = _check(x, q, scale)
    (t, k), n = x.shape, q.shape[0]
    assert 0 < t <= GEMV_MAX_TOKENS, f"the GEMV takes 1..{GEMV_MAX_TOKENS} tokens"
    return gemv_launch(x, q, scale, gemv_plan(t, n, k, n_sms(x.device), gemv_math(x, k, math)), by_bits)


def gemv_launch(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, p: GemvPlan, by_bits: bool = False
) -> torch.Tensor:
    """fp8_gemv with a given plan (a benchmark may pin a tile through it): x, q, scale as _check leaves them."""
    (t, k), n = x.shape, q.shape[0]
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    out = y if p.split == 1 else torch.empty(p.split, t, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, p.block_n), p.split)
    # by bits, the kernels read W's bytes: no fp8 type in them
    w = q.view(torch.uint8) if by_bits else q
    # the three kernels share the pointers, the row strides of x, W and scales, out's token and split strides, K a split
    head, strides = (x, w, scale, out), (x.stride(0), q.stride(0), scale.stride(0), n, t * n, p.k_split)
    tiles = dict(BLOCK_N=p.block_n, SCALE_BLOCK=FP8_BLOCK, BY_BITS=by_bits)
    if p.math == "mma":
        fp8_gemv_mma_kernel[grid](
            *head, t, n, k, *strides, BLOCK_T=p.block_t, WIDE=interpreted(), num_warps=p.num_warps, **tiles
        )
    elif p.math == "legacy":
        fp8_gemv_kernel[grid](*head, t, n, k, *strides, BLOCK_T=p.block_t, BLOCK_K=p.block_k, **tiles)
    else:
        fp8_gemv_pieces_kernel[grid](
            *head,
            n,
            k,
            *strides,
            T=t,
            BLOCK_K=p.block_k,
            F16X2=p.math == "f16x2",
            USE_ASM=not interpreted(),
            num_warps=p.num_warps,
            **tiles,
        )
    if p.split > 1:
        sum_splits_kernel[(triton.cdiv(t * n, SUM_BLOCK),)](out, y, t * n, p.split, BLOCK=SUM_BLOCK)
    return y


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [T, K] -> [T, N] in x's dtype by the device's FP8 path: the GEMV for up to 16 tokens, the GEMM above (W8A8
    where NATIVE, W8A16 where BY_BITS); the reference for fp32 prefill (exact runs stay exact) and where no FP8
    kernel runs."""
    if x.shape[0] == 0 or not has_fp8_kernels(x.device):
        return fp8_linear_ref(x, q, scale)
    by_bits = fp8_path(x.device) is FP8Path.BY_BITS
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return fp8_gemv(x, q, scale, by_bits=by_bits)
    if x.dtype == torch.float32:
        return fp8_linear_ref(x, q, scale)
    if gemm_route(x.shape[0], by_bits) == "widened":
        return fp8_widened_gemm(*_check(x, q, scale))
    return fp8_gemm(*_check(x, q, scale), by_bits=by_bits)
