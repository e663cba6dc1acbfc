"""Rows rounded to e4m3 with one fp32 scale each, for the FP8 variant of MLA's decompressed prefill attention
(prefill.py): x ~ values * scale along the rounded dim, scale = the row's amax / E4M3_MAX (1 for an all-zero row), so
every row spends e4m3's whole range and its largest element lands on +-448 exactly. The values' rounded dim is their
innermost (unit stride): every product of the attention reduces over that dim (q_nope and k_nope over N, v over the
keys), and FP8 tensor cores read both operands K-major, so no tile needs transposing on the way in. On a GPU with
e4m3 in hardware the kernels round (e4m3_rows_jit.py: x in its own dtype, no fp32 copy), elsewhere the torch formula
beside them (_rows), with the same bytes for finite x (kernels.backend.hw_e4m3 decides).
Legend: D the rounded dim's length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsfp4.kernels.backend import hw_e4m3, triton
from dsfp4.layout.formats import next_pow2
from dsfp4.layout.fp4 import E4M3_MAX, exact_div

E4M3 = torch.float8_e4m3fn
# elements of x rounded at once: the fp32 copy a piece takes (a 32k-token prompt's q_nope at V3's 128 heads is 537M
# elements, 2 GB in fp32)
PIECE_ELEMENTS = 1 << 24
# the kernels' tiles: elements of rows a program rounds along their innermost dim; keys and channels a tile of the
# rounding along the keys
ROW_TILE, KEY_TILE, CHANNEL_TILE = 4096, 64, 32


class E4M3Rows(NamedTuple):
    """x rounded along one dim: values (e4m3, x's shape, that dim of unit stride) and scale (fp32, x's shape without
    that dim): x ~ values * scale broadcast along it."""

    values: torch.Tensor
    scale: torch.Tensor


def e4m3_rows(x: torch.Tensor, dim: int) -> E4M3Rows:
    """x [..., D, ...] -> its rows along `dim` rounded to e4m3 (to nearest, ties to even) with a scale per row. By a
    kernel where one takes x (kernel_takes; the same bytes); else by the torch formula, in pieces of x's first dim
    holding at most PIECE_ELEMENTS where the rounded dim is the innermost (the pieces' values then join with it still
    of unit stride)."""
    dim = dim % x.dim()
    if kernel_takes(x, dim) and hw_e4m3(x.device):
        return e4m3_rows_kernel(x, dim)
    step = max(1, PIECE_ELEMENTS // max(1, x[:1].numel()))
    if 0 < dim == x.dim() - 1 and x.shape[0] > step:
        pieces = [_rows(x[i : i + step], dim) for i in range(0, x.shape[0], step)]
        return E4M3Rows(torch.cat([p.values for p in pieces]), torch.cat([p.scale for p in pieces]))
    return _rows(x, dim)


def _rows(x: torch.Tensor, dim: int) -> E4M3Rows:
    # a private fp32 copy, D innermost: divided in place (one fp32 transient, not two)
    xt = x.movedim(dim, -1).to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [..., D]
    amax = xt.abs().amax(dim=-1)
    scale = torch.where(amax > 0, exact_div(amax, E4M3_MAX), torch.ones_like(amax))  # [...]
    # x / (amax / 448) may land a rounding past 448, where e4m3fn has no finite value
    values = xt.div_(scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)  # [..., D]
    return E4M3Rows(values.movedim(-1, dim), scale)


def as_e4m3(x: torch.Tensor | E4M3Rows, dim: int) -> E4M3Rows:
    """x rounded by e4m3_rows along `dim`, or x itself when it is rounded already (by its caller, once for many
    uses)."""
    return x if isinstance(x, E4M3Rows) else e4m3_rows(x, dim)


def dequantize(x: E4M3Rows, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values * scale in `dtype`: what the rounded rows stand for (`dim` as they were rounded along)."""
    return x.values.to(dtype) * x.scale.to(dtype).unsqueeze(dim % x.values.dim())


def kernel_takes(x: torch.Tensor, dim: int) -> bool:
    """Whether a rounding kernel takes x along `dim`: a 2- or 3-dim x of unit innermost stride, rounded along that
    dim, or a 3-dim one along its first (the attention's values along the keys)."""
    return x.dim() in (2, 3) and x.stride(-1) == 1 and (dim % x.dim() == x.dim() - 1 or (x.dim() == 3 and dim == 0))


def e4m3_rows_kernel(x: torch.Tensor, dim: int) -> E4M3Rows:
    """e4m3_rows by the Triton kernels (e4m3_rows_jit.py; x in its own dtype, no fp32 copy): the same values and
    scales, in the same layout, as the formula's."""
    from dsfp4.kernels.mla import e4m3_rows_jit as jit

    assert kernel_takes(x, dim % x.dim()), "e4m3_rows_kernel: a 2- or 3-dim x of unit innermost stride"
    qmax = E4M3_MAX
    if dim % x.dim() == x.dim() - 1:
        x3 = x if x.dim() == 3 else x.unsqueeze(0)
        r1, r2, d = x3.shape
        values = torch.empty(x.shape, dtype=E4M3, device=x.device)  # [..., D]
        scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        dp = next_pow2(d)
        block = max(1, ROW_TILE // dp)
        if r1 * r2:
            jit.inner_rows_kernel[(triton.cdiv(r1 * r2, block),)](
                x3, values, scale, r1 * r2, r2, x3.stride(0), x3.stride(1), D=d, DP=dp, BLOCK_R=block, QMAX=qmax
            )
        return E4M3Rows(values, scale)
    s, h, v = x.shape
    values = torch.empty(h, v, s, dtype=E4M3, device=x.device)  # [H, V, S]
    # no keys: every row all-zero, as the formula's scale for one
    scale = torch.ones(h, v, dtype=torch.float32, device=x.device)
    if s * h * v:
        grid = (h, triton.cdiv(v, CHANNEL_TILE))
        jit.key_rows_kernel[grid](
            x, values, scale, s, x.stride(0), x.stride(1), V=v, BLOCK_S=KEY_TILE, BLOCK_C=CHANNEL_TILE, QMAX=qmax
        )
    return E4M3Rows(values.movedim(-1, 0), scale)
