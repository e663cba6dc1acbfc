"""Backbone matmuls on weights kept in their stored format (FP8 blocks, NVFP4, plain).

`linear` is the interface the model calls; `linear_ref` is the torch reference (dequantize, then one
dense matmul, as DeepSeek's reference does with gemm_impl="bf16"). The kernels issue adds the Triton
FP8/FP4 GEMV and GEMM behind the same call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsfp4.layout.quant import dequantize


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] in `format` (a FORMATS key), its components in FORMATS order."""

    format: str
    parts: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]
    name: str = "weight"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.format, self.parts, self.name, dtype=dtype)


def linear_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x: [..., K] -> [..., N], computed in x's dtype."""
    return F.linear(x, w.dequantize(x.dtype))


def linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return linear_ref(x, w)
