"""The by-bits path's prefill GEMM the other way round (sm_80/86, kernels/backend.py FP8Path.BY_BITS): W's rows
widened to x's dtype by bit placement, a piece of at most WIDEN_PIECE_BYTES at a time (kernels/fp8/dequant.py, one
read of the e4m3 bytes and one write), and each piece multiplied by cuBLAS on the bf16/fp16 tensor cores.

The Triton W8A16 GEMM (kernels/fp8/gemm.py, by_bits) widens every weight tile inside its K loop, once per tile of
tokens, and ran at 21-23% of the H200's BF16 peak at 4,096 tokens; widening a piece costs the same whatever the
token count, and cuBLAS runs near its peak. From WIDEN_GEMM_TOKENS tokens a call takes this path (`gemm_route`).
The widened weight is the block's e4m3 value times its fp32 scale rounded once to x's dtype: 2^-9 relative in bf16,
where the Triton GEMM keeps the scale's product in fp32.
Legend: T tokens, N output rows, K input columns, P a piece's rows.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.fp8.dequant import fp8_dequantize
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.fp8 import FP8_BLOCK

# the widened piece's bytes at most (x's dtype): the transient copy the plan's workspace holds for it
WIDEN_PIECE_BYTES = 32 << 20
# from this many tokens a call of the by-bits path widens W and multiplies by cuBLAS; below, the Triton W8A16 GEMM
# (the GEMV up to DECODE_TOKENS). Widening reads 1 and writes 2 bytes a weight whatever the call's tokens, the
# cuBLAS product then runs about 3x the Triton GEMM's rate (docs/BENCHMARKS.md, 2026-12-02)
WIDEN_GEMM_TOKENS = 256
assert WIDEN_GEMM_TOKENS > DECODE_TOKENS, "the GEMV keeps decode"


def gemm_route(t: int, by_bits: bool) -> str:
    """Which GEMM a prefill call of t tokens (t > DECODE_TOKENS) takes: "widened" (this file) on the by-bits path
    from WIDEN_GEMM_TOKENS tokens, else "triton" (kernels/fp8/gemm.py)."""
    return "widened" if by_bits and t >= WIDEN_GEMM_TOKENS else "triton"


def piece_rows(n: int, k: int, elt: int, piece_bytes: int = WIDEN_PIECE_BYTES) -> int:
    """Rows P of a widened piece: the most whole scale blocks of rows whose k columns of `elt` bytes fit piece_bytes
    (one block at least), at most n."""
    return min(n, max(FP8_BLOCK, piece_bytes // (elt * k) // FP8_BLOCK * FP8_BLOCK))


def widened_bytes(shapes: list[tuple[int, int]], t: int, elt: int) -> int:
    """The most a widened GEMM of t tokens holds at once on any of these [N, K] matrices: its piece, and the piece's
    products should cuBLAS not write them in place (an upper estimate)."""
    return max(((k + t) * piece_rows(n, k, elt) * elt for n, k in shapes), default=0)


def fp8_widened_gemm(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, piece_bytes: int = WIDEN_PIECE_BYTES
) -> torch.Tensor:
    """x: [T, K] bf16/fp16, q: [N, K] e4m3, scale: [Nb, Kb] fp32 -> y [T, N] in x's dtype: y = x @ W^T with W widened
    by bits a piece of rows at a time into one reused buffer."""
    (t, k), n = x.shape, q.shape[0]
    rows = piece_rows(n, k, x.element_size(), piece_bytes)
    buf = torch.empty(rows, k, dtype=x.dtype, device=x.device)  # [P, K]
    if rows == n:
        return x @ fp8_dequantize(q, scale, x.dtype, by_bits=True, out=buf).t()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    for r in range(0, n, rows):
        p = min(rows, n - r)
        s = scale[r // FP8_BLOCK : (r + p + FP8_BLOCK - 1) // FP8_BLOCK]
        w = fp8_dequantize(q[r : r + p], s, x.dtype, by_bits=True, out=buf[:p])  # [P, K]
        torch.mm(x, w.t(), out=y[:, r : r + p])  # [T, P]: rows of y's stride
    return y
