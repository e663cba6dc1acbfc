"""The absorbed attention's FP8 wkv_b products against their references (CPU interpreter; -m gpu at V3
size)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.mla.absorb import absorb_keys, absorb_keys_ref, absorb_values, absorb_values_ref
from dsfp4.layout.fp8 import fp8_block_quantize

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _wkv_b(heads: int, nope: int, v: int, c: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(heads * (nope + v), c, generator=gen) / c**0.5
    return fp8_block_quantize(w)  # (e4m3 [H (N + V), C], fp32 scales)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


# heads whose rows straddle 128-row scale blocks (N + V = 96), a C that is not a multiple of the tile; value
# tiles that straddle them too (N = 24: the scales multiply each weight, not the latent)
@pytest.mark.parametrize(
    ("heads", "nope", "v", "c", "m"), [(3, 64, 32, 160, 1), (2, 128, 128, 512, 5), (5, 24, 40, 160, 2)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_absorb_kernels_match_their_references(heads, nope, v, c, m, dtype):
    q8, scale = _wkv_b(heads, nope, v, c, heads + c)
    gen = torch.Generator().manual_seed(m)
    q, o = torch.randn(m, heads, nope, generator=gen).to(dtype), torch.randn(m, heads, c, generator=gen).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    d = [t.to(DEVICE) for t in (q8, scale)]
    keys = absorb_keys(q.to(DEVICE), *d, nope).cpu()
    assert keys.dtype == dtype and _rel(keys, absorb_keys_ref(q.double(), q8, scale, nope)) < tol
    values = absorb_values(o.to(DEVICE), *d, nope).cpu()
    assert values.shape == (m, heads, v) and _rel(values, absorb_values_ref(o.double(), q8, scale, nope)) < tol


def test_absorb_keys_reads_strided_heads():
    """q as attention.py slices it: the nope part of [M, H, N + R] rows."""
    q8, scale = _wkv_b(2, 64, 32, 128, 0)
    full = torch.randn(3, 2, 64 + 16, generator=torch.Generator().manual_seed(1))
    got = absorb_keys(full.to(DEVICE)[..., :64], q8.to(DEVICE), scale.to(DEVICE), 64).cpu()
    assert _rel(got, absorb_keys_ref(full[..., :64].double(), q8, scale, 64)) < 1e-5


@pytest.mark.gpu
def test_absorb_kernels_at_deepseek_v3_size():
    q8, scale = _wkv_b(128, 128, 128, 512, 7)
    q, o = torch.randn(2, 128, 128).bfloat16(), torch.randn(2, 128, 512).bfloat16()
    keys = absorb_keys(q.cuda(), q8.cuda(), scale.cuda(), 128).cpu()
    values = absorb_values(o.cuda(), q8.cuda(), scale.cuda(), 128).cpu()
    assert _rel(keys, absorb_keys_ref(q.double(), q8, scale, 128)) < 1e-2
    assert _rel(values, absorb_values_ref(o.double(), q8, scale, 128)) < 1e-2
