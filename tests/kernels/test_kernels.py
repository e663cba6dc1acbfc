"""Triton kernels against their torch references (on the CPU through TRITON_INTERPRET=1, on a GPU for
real with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.backend import triton, use_kernels
from dsfp4.kernels.fp4.matmul import fp4_matmul, fp4_matmul_ref
from dsfp4.layout import fp4

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(fmt: str, n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, k)[None, :]  # scales across regimes
    if fmt == "nvfp4":
        packed, scale, g = fp4.nvfp4_quantize(w)
        return packed, scale.view(torch.uint8), torch.stack([g, g * 2])
    packed, scale = fp4.mxfp4_quantize(w)
    return packed, scale, torch.ones(2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("t", "n", "k"), [(1, 96, 256), (5, 200, 96), (33, 64, 128)])
def test_fp4_matmul_matches_its_reference(fmt, t, n, k):
    gen = torch.Generator().manual_seed(t * n + k)
    packed, scale, g = _weights(fmt, n, k, gen)
    x = torch.randn(t, k, generator=gen)
    split = n // 3  # rows below it use g[0], the rest g[1]
    want = fp4_matmul_ref(x, packed, scale, g, split, fmt)
    got = fp4_matmul(*(a.to(DEVICE) for a in (x, packed, scale, g)), split, fmt).cpu()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_one_rule_picks_kernel_or_reference():
    """backend.use_kernels: Triton kernels for CUDA tensors when Triton is installed, the references elsewhere (the
    tests call the kernels themselves on the CPU, under Triton's interpreter)."""
    assert not use_kernels(torch.zeros(1)) and not use_kernels(torch.device("cpu"))
    if torch.cuda.is_available():
        assert use_kernels(torch.zeros(1, device="cuda")) == (triton is not None)
