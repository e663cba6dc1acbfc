"""Backbone matmuls on weights kept in their stored format (FP8 blocks, NVFP4, MXFP4, plain).

`linear` is the interface the model calls: on CUDA it is `linear_triton`, the Triton kernels on the stored parts
(kernels/fp8/linear.py for fp8_e4m3_b128, kernels/fp4/matmul.py for nvfp4 and mxfp4); on the CPU, FP8 blocks of up
to DECODE_TOKENS tokens go to the C kernel of kernels/cpu/fp8.py where it builds; elsewhere it is `linear_ref`, the
torch reference (dequantize, then one dense matmul, as DeepSeek's reference does with gemm_impl="bf16"). Plain
weights are one F.linear everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsfp4.kernels.backend import has_fp8_kernels, use_kernels
from dsfp4.kernels.cpu.fp8 import FP8_LINEAR, fp8_linear_host
from dsfp4.kernels.fp4.matmul import fp4_matmul
from dsfp4.kernels.fp8.dequant import fp8_dequantize
from dsfp4.kernels.fp8.linear import fp8_linear
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.fp8 import e8m0_scales
from dsfp4.layout.quant import dequantize


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] in `format` (a FORMATS key), its components in FORMATS order."""

    format: str
    parts: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]
    name: str = "weight"

    @property
    def fp8_on_gpu(self) -> bool:
        """FP8 blocks on a CUDA device whose FP8 path has kernels (kernels/backend.py fp8_path: natively or by
        bits): the kernels that read them as stored can run."""
        t = self.parts[0]
        return self.format == "fp8_e4m3_b128" and use_kernels(t) and has_fp8_kernels(t.device)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [N, K] in `dtype` (FP8 blocks in one Triton pass on CUDA)."""
        if self.fp8_on_gpu:
            return fp8_dequantize(*self.parts, dtype=dtype)
        return dequantize(self.format, self.parts, self.name, dtype=dtype)


def linear_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x: [..., K] -> [..., N], computed in x's dtype."""
    return F.linear(x, w.dequantize(x.dtype))


def _fp4(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x: [T, K] -> [T, N] in x's dtype."""
    packed, scale = w.parts[0], w.parts[1].view(torch.uint8)
    g = w.parts[2].float().reshape(1) if w.format == "nvfp4" else None
    # split = N: every row g[0]
    return fp4_matmul(x, packed, scale, g, packed.shape[0], w.format).to(x.dtype)


def _fp8(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return fp8_linear(x, *w.parts)


KERNELS = {"fp8_e4m3_b128": _fp8, "nvfp4": _fp4, "mxfp4": _fp4}


def linear_triton(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype from the Triton kernels on the weight's stored parts: linear_ref's
    result up to rounding (FP8 prefill in bf16/fp16 also rounds x to e4m3; fp8_linear says when, and where
    it takes the reference instead)."""
    if w.format not in KERNELS:
        return linear_ref(x, w)
    y = KERNELS[w.format](x.reshape(-1, x.shape[-1]), w)  # [T, N], T = all leading dims
    return y.reshape(*x.shape[:-1], y.shape[-1])


# e4m3 with a multiplier per 128 x 128 block: fp32 or e8m0
FP8_BLOCKS = ("fp8_e4m3_b128", "fp8_e4m3_e8m0_b128")


def linear_host(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype from the CPU kernel on FP8 blocks as stored: linear_ref's result up to
    rounding (summed in fp32)."""
    q, scale = w.parts
    if w.format == "fp8_e4m3_e8m0_b128":
        scale = e8m0_scales(scale, w.name)
    return fp8_linear_host(x, q, scale)


def linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype."""
    if use_kernels(x):
        return linear_triton(x, w)
    # above the decode kernels' count a BLAS matmul on the dequantized weight wins
    tokens = x.numel() // x.shape[-1]
    if w.format in FP8_BLOCKS and x.device.type == "cpu" and tokens <= DECODE_TOKENS and FP8_LINEAR.available():
        return linear_host(x, w)
    return linear_ref(x, w)
