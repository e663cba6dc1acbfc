"""Rows rounded to e4m3 with one fp32 scale each, for the FP8 variant of MLA's decompressed prefill attention
(prefill.py): x ~ values * scale along the rounded dim, scale = the row's amax / E4M3_MAX (1 for an all-zero row), so
every row spends e4m3's whole range and its largest element lands on +-448 exactly. The values' rounded dim is their
innermost (unit stride): every product of the attention reduces over that dim (q_nope and k_nope over N, v over the
keys), and FP8 tensor cores read both operands K-major, so no tile needs transposing on the way in.
Legend: D the rounded dim's length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsfp4.layout.fp4 import E4M3_MAX, exact_div

E4M3 = torch.float8_e4m3fn
# elements of x rounded at once: the fp32 copy a piece takes (a 32k-token prompt's q_nope at V3's 128 heads is 537M
# elements, 2 GB in fp32)
PIECE_ELEMENTS = 1 << 24


class E4M3Rows(NamedTuple):
    """x rounded along one dim: values (e4m3, x's shape, that dim of unit stride) and scale (fp32, x's shape without
    that dim): x ~ values * scale broadcast along it."""

    values: torch.Tensor
    scale: torch.Tensor


def e4m3_rows(x: torch.Tensor, dim: int) -> E4M3Rows:
    """x [..., D, ...] -> its rows along `dim` rounded to e4m3 (to nearest, ties to even) with a scale per row; in
    pieces of x's first dim holding at most PIECE_ELEMENTS where the rounded dim is the innermost (the pieces' values
    then join with it still of unit stride)."""
    dim = dim % x.dim()
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
