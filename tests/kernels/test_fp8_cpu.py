"""The CPU's FP8 block-scaled linear (kernels/cpu/fp8.c) against the torch reference, each of its paths, and the
interface taking it for CPU tensors."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.cpu import build
from dsfp4.kernels.cpu.fp8 import FP8_LINEAR, fp8_linear_host
from dsfp4.kernels.linear import QuantizedWeight, linear, linear_ref
from dsfp4.layout import fp8

pytestmark = pytest.mark.skipif(not FP8_LINEAR.available(), reason="no C compiler builds kernels/cpu/fp8.c here")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("path", list(build.PATHS))
@pytest.mark.parametrize("n,k", [(300, 200), (130, 257), (256, 128)])  # ragged blocks, a K with a scalar tail
@pytest.mark.parametrize("t", [1, 3, 11])  # 11: a row serves 8 tokens, then the rest
def test_the_cpu_kernel_matches_the_reference(n, k, t, path):
    gen = torch.Generator().manual_seed(n + k + t)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, k)[None, :]  # blocks of different scales
    q, scale = fp8.fp8_block_quantize(w, "w")
    x = torch.randn(t, k, generator=gen)
    want = torch.nn.functional.linear(x.double(), fp8.fp8_block_dequantize(q, scale, "w", dtype=torch.float64))
    assert _rel(fp8_linear_host(x, q, scale, path), want) < 1e-5
    subnormal = torch.tensor([[1, 0x81, 7, 0x87] * (k // 4) + [0] * (k % 4)], dtype=torch.uint8)  # e4m3 subnormals
    qs = subnormal.view(torch.float8_e4m3fn)
    ones = torch.ones(1, -(-k // 128))
    want = torch.nn.functional.linear(x.double(), fp8.fp8_block_dequantize(qs, ones, "w", dtype=torch.float64))
    assert _rel(fp8_linear_host(x, qs, ones, path), want) < 1e-5


def test_the_rows_split_over_threads_give_one_threads_bits(cpu_threads):
    """As the MoE kernel's: torch's thread count is the kernel's, and its rows split without changing a bit."""
    gen = torch.Generator().manual_seed(5)
    q, scale = fp8.fp8_block_quantize(torch.randn(300, 257, generator=gen), "w")
    x = torch.randn(11, 257, generator=gen)
    got = []
    for n in (1, 3):
        cpu_threads(n)
        got.append(fp8_linear_host(x, q, scale, next(iter(build.PATHS))))
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("fmt", ["fp8_e4m3_b128", "fp8_e4m3_e8m0_b128"])
def test_linear_takes_it_on_the_cpu_for_both_scale_kinds(fmt):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen)
    q, scale = fp8.fp8_block_quantize(w, "w")
    if fmt == "fp8_e4m3_e8m0_b128":  # powers of two, as V4's backbone stores them
        scale = (torch.log2(scale).ceil() + 127).to(torch.uint8)
    weight = QuantizedWeight(fmt, (q, scale), (200, 300))
    x = torch.randn(2, 5, 300, generator=gen).bfloat16()
    got, want = linear(x, weight), linear_ref(x.float(), weight)
    assert got.shape == (2, 5, 200) and got.dtype == torch.bfloat16 and _rel(got.float(), want.double()) < 1e-2
