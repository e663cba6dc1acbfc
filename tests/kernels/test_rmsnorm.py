"""The RMSNorm kernel against its torch reference (CPU interpreter; -m gpu at V3 sizes)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(shape: tuple[int, ...], dtype: torch.dtype, wdtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 4 + 1).to(dtype)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(wdtype)
    return x, w


@pytest.mark.parametrize(
    ("shape", "dtype", "wdtype"),
    [
        ((3, 96), torch.float32, torch.float32),  # a dim that is not a power of two
        ((2, 5, 64), torch.bfloat16, torch.bfloat16),  # V3: bf16 weight, two roundings
        ((4, 200), torch.bfloat16, torch.float32),  # V4: fp32 weight, one rounding
    ],
)
def test_rmsnorm_matches_the_reference(shape, dtype, wdtype):
    x, w = _case(shape, dtype, wdtype, sum(shape))
    want = rmsnorm_ref(x, w, 1e-6)
    got = rmsnorm(x.to(DEVICE), w.to(DEVICE), 1e-6).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    # bf16: one rounding step, relative; two where the CPU interpreter truncates its casts instead of rounding
    ulp = 1e-6 if dtype == torch.float32 else 2**-7 if DEVICE == "cuda" else 2**-6
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()


def test_rmsnorm_reads_rows_of_a_wider_tensor():
    x, w = _case((3, 160), torch.float32, torch.float32, 1)
    got = rmsnorm(x[:, :128].to(DEVICE), w[:128].to(DEVICE), 1e-6).cpu()  # row stride 160, dim 128
    assert torch.allclose(got, rmsnorm_ref(x[:, :128], w[:128], 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, 1536, 7168])
def test_rmsnorm_at_deepseek_v3_sizes(d):
    x, w = _case((1, 4, d), torch.bfloat16, torch.bfloat16, d)
    got = rmsnorm(x.cuda(), w.cuda(), 1e-6).cpu()
    want = rmsnorm_ref(x.cuda(), w.cuda(), 1e-6).cpu()
    assert ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs() + 1e-6).all()


@pytest.mark.parametrize(("shape", "wdtype"), [((2, 3, 96), torch.bfloat16), ((1, 200), torch.float32)])
def test_add_rmsnorm_matches_the_reference(shape, wdtype):
    x, w = _case(shape, torch.bfloat16, wdtype, 7)
    delta = _case(shape, torch.bfloat16, wdtype, 8)[0]
    want_sum = add_rmsnorm_ref(x, delta, w, 1e-6)[0]
    got_sum, got = (y.cpu() for y in add_rmsnorm(x.to(DEVICE), delta.to(DEVICE), w.to(DEVICE), 1e-6))
    ulp = 2**-7 if DEVICE == "cuda" else 2**-6  # the CPU interpreter truncates its casts
    if DEVICE == "cuda":
        assert torch.equal(got_sum, want_sum), "the sum rounds once to bf16, as torch's add"
    assert ((got_sum.float() - want_sum.float()).abs() <= ulp * want_sum.float().abs()).all()
    want = rmsnorm_ref(got_sum, w, 1e-6)  # the norm of the sum the kernel stored
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()
