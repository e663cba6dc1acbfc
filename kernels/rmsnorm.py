"""RMSNorm in one pass on the GPU: a decode step normalizes ~4 vectors per layer, and torch spends six
kernels on each (cast, square, mean, add, rsqrt, two products), more time than the bytes need.

`rmsnorm_ref` is the formula transformers computes: normalize in fp32, cast back to x's dtype, then
scale by the weight (V3); with an fp32 weight (V4 keeps its norms in fp32) scale in fp32 and cast once.
Legend: R rows, D the normalized dim.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import tl, triton
from dsfp4.layout.formats import next_pow2


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (weight * normed).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [..., D] -> (x + delta in x's dtype, rmsnorm_ref of it)."""
    total = x + delta
    return total, rmsnorm_ref(total, weight, eps)


if triton is not None:

    @triton.jit
    def rms_row(x, w_ptr, cols, ok, eps, dtype: tl.constexpr, D: tl.constexpr, W_FP32: tl.constexpr):
        """x: [BLOCK] fp32 (zero past D) -> rmsnorm_ref's row in `dtype`: the sum of squares in fp32, then its
        roundings."""
        # IEEE sqrt and divide, as torch's rsqrt
        normed = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        # the product rounded once, as torch's
        y = w * normed if W_FP32 else w * normed.to(dtype).to(tl.float32)
        return y.to(dtype)

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,
        d_ptr,
        w_ptr,
        sum_ptr,
        out_ptr,
        stride_x,
        stride_d,
        eps,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        W_FP32: tl.constexpr,
        ADD: tl.constexpr,
    ):
        """One row; with ADD, of x + delta rounded to x's dtype (torch's add), which is stored too."""
        row, cols = tl.program_id(0), tl.arange(0, BLOCK)
        ok = cols < D
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            x = (x + tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype)
            tl.store(sum_ptr + row * D + cols, x, mask=ok)
            x = x.to(tl.float32)
        tl.store(out_ptr + row * D + cols, rms_row(x, w_ptr, cols, ok, eps, dtype, D, W_FP32), mask=ok)


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., D] -> [R, D], a view for the contiguous activations the model passes."""
    rows = x.reshape(-1, x.shape[-1])
    assert rows.stride(1) == 1 and weight.shape == (x.shape[-1],), "rmsnorm takes rows of unit stride, a [D] weight"
    return rows


def _launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row -> (x + delta, its norm), each shaped as x; without a delta, (norm, norm)."""
    rows, d = _rows(x, weight), x.shape[-1]
    assert delta is None or (delta.shape, delta.dtype) == (x.shape, x.dtype), "add_rmsnorm: delta shaped as x"
    deltas = rows if delta is None else _rows(delta, weight)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = out if delta is None else torch.empty_like(out)
    block = next_pow2(d)
    _rmsnorm_kernel[(rows.shape[0],)](
        rows,
        deltas,
        weight,
        total,
        out,
        rows.stride(0),
        deltas.stride(0),
        eps,
        D=d,
        BLOCK=block,
        W_FP32=weight.dtype == torch.float32,
        ADD=delta is not None,
        num_warps=min(16, max(1, block // 512)),
    )
    return total.view(x.shape), out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm_ref's values, one program per row. x: [..., D] with unit stride in D, weight: [D] -> [..., D]."""
    return _launch(x, None, weight, eps)[1]


def add_rmsnorm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rmsnorm_ref's values in one launch (a residual add and the norm after it). x, delta: [..., D]."""
    return _launch(x, delta, weight, eps)
