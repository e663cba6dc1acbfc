"""The FP8 variant of MLA's decompressed prefill attention (kernels/mla/prefill.py, fp8=True): e4m3_rows' rounding
and its round trip."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.mla.e4m3_rows import E4M3, E4M3_MAX, as_e4m3, dequantize, e4m3_rows

# e4m3 has 3 mantissa bits: rounding to nearest moves a normal value by at most half a step, 2^-4 of it
E4M3_HALF_STEP = 2.0**-4
# the subnormals' step (2^-9): below the normal range a value moves by at most half of it, in the row's scale
E4M3_SUBNORMAL_STEP = 2.0**-9


def _finite_e4m3() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(E4M3).float()
    return codes[codes.isfinite()].unique()


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_e4m3_rows_round_to_the_nearest_code_and_back_within_half_a_step(dim):
    """Rows of magnitudes 1e-3 to 1e3 and an all-zero one: scale amax / 448 (1 for the zero row), each value the
    nearest e4m3 code of x / scale (the row's amax on +-448), values * scale within half a step of x, the rounded
    dim of unit stride; as_e4m3 passes rounded rows through."""
    gen = torch.Generator().manual_seed(dim % 3)
    x = torch.randn(6, 5, 40, generator=gen) * torch.logspace(-3, 3, 6)[:, None, None]
    x = x.to(torch.bfloat16)
    x[2, 3] = 0
    x[:, 1, 7] = 0
    rows = e4m3_rows(x, dim)
    xd = x.float().movedim(dim, -1)  # [..., D]
    assert rows.values.dtype == E4M3 and rows.values.shape == x.shape and rows.values.stride(dim) == 1
    assert rows.scale.dtype == torch.float32 and rows.scale.shape == xd.shape[:-1]
    amax = xd.abs().amax(-1)
    assert torch.equal(rows.scale, torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)))
    y = xd / rows.scale.unsqueeze(-1)
    got = rows.values.float().movedim(dim, -1)
    nearest = (y.unsqueeze(-1) - _finite_e4m3()).abs().amin(-1)
    assert torch.equal((got - y).abs(), nearest)
    assert torch.equal(got.abs().amax(-1), torch.where(amax > 0, E4M3_MAX, 0.0))
    err = (dequantize(rows, dim) - x.float()).abs()
    scale = rows.scale.unsqueeze(dim % x.dim())
    assert (err <= E4M3_HALF_STEP * x.float().abs() + E4M3_SUBNORMAL_STEP / 2 * scale).all()
    assert as_e4m3(rows, dim) is rows
