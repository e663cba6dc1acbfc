"""The absorbed attention's two products with wkv_b, on its FP8 blocks directly, for decode.

MLA in the absorbed form (runtime/models/v3/attention.py) multiplies each head's query by that head's key
up-projection W_UK (so scores are taken against the cached latent c_kv) and the attention's latent output
by its value up-projection W_UV. wkv_b holds both, head by head: rows h*(N+V) .. +N are head h's W_UK
[N, C], the next V rows its W_UV [V, C]. Torch needs wkv_b dense (a dequantization pass that writes
and reads 2x its FP8 bytes every step); these kernels read the e4m3 bytes and block scales once, for up to
16 tokens. `absorb_keys_ref` / `absorb_values_ref` are the formulas on the dequantized matrix.
Legend: M tokens, H heads, N nope dim, V value dim, C kv_lora_rank.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import hw_e4m3, tl, triton
from dsfp4.kernels.fp4.codes import block_scale
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.formats import next_pow2
from dsfp4.layout.fp8 import FP8_BLOCK, fp8_block_dequantize

# beyond this, dequantize once and multiply on tensor cores
MAX_TOKENS = DECODE_TOKENS
# a program's tiles: [32, FP8_BLOCK] of W_UK per step, [16, C] of W_UV
KEY_ROWS, VALUE_ROWS = 32, 16
# tokens a values program takes with its tile: a batch's tokens spread over programs, each tile read from L2 by a
# quarter as many programs as tokens
VALUE_TOKENS = 4


def _heads(q8: torch.Tensor, scale: torch.Tensor, heads: int) -> torch.Tensor:
    """wkv_b [H (N + V), C] e4m3 -> [H, N + V, C] fp32."""
    return fp8_block_dequantize(q8, scale, "wkv_b", torch.float32).view(heads, -1, q8.shape[1])


def absorb_keys_ref(q: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, nope: int) -> torch.Tensor:
    """q: [M, H, N] -> [M, H, C] in q's dtype: q_h W_UK_h, in fp32."""
    w = _heads(q8, scale, q.shape[1])[:, :nope]  # [H, N, C]
    return torch.einsum("mhn,hnc->mhc", q.float(), w).to(q.dtype)


def absorb_values_ref(o: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, nope: int) -> torch.Tensor:
    """o: [M, H, C] -> [M, H, V] in o's dtype: o_h W_UV_h^T, in fp32."""
    w = _heads(q8, scale, o.shape[1])[:, nope:]  # [H, V, C]
    return torch.einsum("mhc,hvc->mhv", o.float(), w).to(o.dtype)


if triton is not None:

    @triton.jit
    def _fp8_tile(w_ptr, rows, cols, ok, stride_w, HW_E4M3: tl.constexpr):
        """[R, K] rows x cols of the FP8 matrix in fp32, before the block scales (each caller applies them where
        it measured cheapest)."""
        b = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=ok, other=0)
        return block_scale(b, E8M0=False, HW_E4M3=HW_E4M3)

    @triton.jit
    def _keys_kernel(
        q_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        stride_qm,
        stride_qh,
        stride_om,
        stride_oh,
        stride_w,
        stride_s,
        N: tl.constexpr,
        HD: tl.constexpr,
        C: tl.constexpr,
        RN: tl.constexpr,
        SB: tl.constexpr,
        HW_E4M3: tl.constexpr,
    ):
        """Head pid 0, columns pid 1 * SB .., token pid 2: out[m, h, c] = sum_n q[m, h, n] W[h HD + n, c], RN rows at
        a time (rows of SB contiguous bytes, one scale block wide). A program per token: the batch's tokens read the
        tiles from L2 in parallel, where one program looping over them ran them one after another (a large share of a
        batch step of 16 sequences: docs/BENCHMARKS.md, run 62)."""
        h, m = tl.program_id(0), tl.program_id(2)
        c = tl.program_id(1) * SB + tl.arange(0, SB)
        acc = tl.zeros((SB,), dtype=tl.float32)
        for n0 in tl.static_range(0, N, RN):
            n = n0 + tl.arange(0, RN)
            ok = (n < N)[:, None] & (c < C)[None, :]
            w = _fp8_tile(w_ptr, h * HD + n, c, ok, stride_w, HW_E4M3)  # [RN, SB]
            # a scale per weight: faster here than folding a per-row one into q (docs/BENCHMARKS.md), unlike the
            # values' tile below
            w *= tl.load(s_ptr + ((h * HD + n) // SB)[:, None] * stride_s + (c // SB)[None, :], mask=ok, other=0.0)
            qv = tl.load(q_ptr + m * stride_qm + h * stride_qh + n, mask=n < N, other=0.0).to(tl.float32)
            acc += tl.sum(w * qv[:, None], axis=0)
        tl.store(out_ptr + m * stride_om + h * stride_oh + c, acc.to(out_ptr.dtype.element_ty), mask=c < C)

    @triton.jit
    def _values_kernel(
        o_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        M,
        stride_om,
        stride_oh,
        stride_ym,
        stride_yh,
        stride_w,
        stride_s,
        N: tl.constexpr,
        V: tl.constexpr,
        HD: tl.constexpr,
        C: tl.constexpr,
        CP: tl.constexpr,
        BV: tl.constexpr,
        SB: tl.constexpr,
        HW_E4M3: tl.constexpr,
        ONE_ROW_BLOCK: tl.constexpr,
        MT: tl.constexpr,
    ):
        """Head pid 0, value rows pid 1 * BV .., tokens pid 2 * MT ..: out[m, h, v] = sum_c o[m, h, c] W[h HD + N + v,
        c]. With ONE_ROW_BLOCK (the BV rows sit in one 128-row block) the scales multiply o's elements, else W's."""
        h, m0 = tl.program_id(0), tl.program_id(2) * MT
        v = tl.program_id(1) * BV + tl.arange(0, BV)
        c = tl.arange(0, CP)
        ok = (v < V)[:, None] & (c < C)[None, :]
        rows = h * HD + N + v
        w = _fp8_tile(w_ptr, rows, c, ok, stride_w, HW_E4M3)  # [BV, CP]
        # one scale per column block: it multiplies o's elements, not every weight
        if ONE_ROW_BLOCK:
            s = tl.load(s_ptr + (tl.min(rows, 0) // SB) * stride_s + c // SB, mask=c < C, other=0.0)  # [CP]
        else:
            w *= tl.load(s_ptr + (rows // SB)[:, None] * stride_s + (c // SB)[None, :], mask=ok, other=0.0)
        for m in range(m0, tl.minimum(m0 + MT, M)):
            lat = tl.load(o_ptr + m * stride_om + h * stride_oh + c, mask=c < C, other=0.0).to(tl.float32)
            if ONE_ROW_BLOCK:
                lat *= s
            y = tl.sum(w * lat[None, :], axis=1)  # [BV]
            tl.store(out_ptr + m * stride_ym + h * stride_yh + v, y.to(out_ptr.dtype.element_ty), mask=v < V)


def absorb_keys(q: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, nope: int) -> torch.Tensor:
    """absorb_keys_ref's result from one read of W_UK's FP8 blocks. q: [M, H, N], M <= MAX_TOKENS."""
    m, heads, n = q.shape
    c = q8.shape[1]
    assert m <= MAX_TOKENS and n == nope and q.stride(2) == 1, f"absorb_keys takes up to {MAX_TOKENS} [H, N] rows"
    out = torch.empty(m, heads, c, dtype=q.dtype, device=q.device)
    _keys_kernel[(heads, triton.cdiv(c, FP8_BLOCK), m)](
        q,
        q8.view(torch.uint8),
        scale,
        out,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        q8.stride(0),
        scale.stride(0),
        N=n,
        HD=q8.shape[0] // heads,
        C=c,
        RN=KEY_ROWS,
        SB=FP8_BLOCK,
        HW_E4M3=hw_e4m3(q.device),
    )
    return out


def absorb_values(o: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, nope: int) -> torch.Tensor:
    """absorb_values_ref's result from one read of W_UV's FP8 blocks. o: [M, H, C], M <= MAX_TOKENS."""
    m, heads, c = o.shape
    hd = q8.shape[0] // heads
    assert m <= MAX_TOKENS and c == q8.shape[1] and o.stride(2) == 1, f"absorb_values takes up to {MAX_TOKENS} tokens"
    out = torch.empty(m, heads, hd - nope, dtype=o.dtype, device=o.device)
    _values_kernel[(heads, triton.cdiv(hd - nope, VALUE_ROWS), triton.cdiv(m, VALUE_TOKENS))](
        o,
        q8.view(torch.uint8),
        scale,
        out,
        m,
        o.stride(0),
        o.stride(1),
        out.stride(0),
        out.stride(1),
        q8.stride(0),
        scale.stride(0),
        N=nope,
        V=hd - nope,
        HD=hd,
        C=c,
        CP=next_pow2(c),
        BV=VALUE_ROWS,
        SB=FP8_BLOCK,
        HW_E4M3=hw_e4m3(o.device),
        # tiles then start on multiples of BV
        ONE_ROW_BLOCK=hd % VALUE_ROWS == 0 and nope % VALUE_ROWS == 0,
        MT=VALUE_TOKENS,
    )
    return out
