"""The mHC weights kernel (gates and Sinkhorn mixing) against its torch reference (CPU interpreter; -m gpu)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.mhc_weights import mhc_weights, mhc_weights_ref

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("n", "iters", "lead"), [(4, 20, (2, 3)), (3, 5, (7,)), (4, 1, (1, 1))])
def test_mhc_weights_match_the_reference(n, iters, lead):
    gen = torch.Generator().manual_seed(n * iters)
    mix = torch.randn(*lead, (2 + n) * n, generator=gen) * 2
    scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn((2 + n) * n, generator=gen)
    want = mhc_weights_ref(mix, scale, base, n, iters, 1e-6)
    got = mhc_weights(*(t.to(DEVICE) for t in (mix, scale, base)), n, iters, 1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.allclose(g.cpu(), w, rtol=1e-5, atol=1e-6)
    comb = got[2].cpu()
    if iters >= 20:  # Sinkhorn has converged: doubly stochastic
        assert torch.allclose(comb.sum(-1), torch.ones(*lead, n), atol=1e-4)
        assert torch.allclose(comb.sum(-2), torch.ones(*lead, n), atol=1e-4)
