"""RMSNorm in one pass on the GPU: a decode step normalizes ~4 vectors per layer, and torch spends six
kernels on each (cast, square, mean, add, rsqrt, two products), more time than the bytes need.

`rmsnorm_ref` is the formula transformers computes: normalize in fp32, cast back to x's dtype, then
scale by the weight (V3); with an fp32 weight (V4 keeps its norms in fp32) scale in fp32 and cast once.
Legend: R rows, D the normalized dim.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.fp4_decode import triton
from dsfp4.layout.formats import next_pow2


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (weight * normed).to(x.dtype)
    return weight * normed.to(x.dtype)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr, w_ptr, out_ptr, stride_x, eps,
        D: tl.constexpr, BLOCK: tl.constexpr, W_FP32: tl.constexpr,
    ):  # fmt: skip
        """One row: the sum of squares in fp32, then rmsnorm_ref's roundings."""
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(x_ptr + tl.program_id(0) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        normed = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))  # IEEE sqrt and divide, as torch's rsqrt
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        y = w * normed if W_FP32 else w * normed.to(dtype).to(tl.float32)  # the product rounded once, as torch's
        tl.store(out_ptr + tl.program_id(0) * D + cols, y.to(dtype), mask=ok)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm_ref's values, one program per row. x: [..., D] with unit stride in D, weight: [D] -> [..., D]."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)  # [R, D]: a view for the contiguous activations the model passes
    assert rows.stride(1) == 1 and weight.shape == (d,), "rmsnorm takes rows of unit stride and a [D] weight"
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = next_pow2(d)
    _rmsnorm_kernel[(rows.shape[0],)](
        rows, weight, out, rows.stride(0), eps,
        D=d, BLOCK=block, W_FP32=weight.dtype == torch.float32, num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return out.view(x.shape)
