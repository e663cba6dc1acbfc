"""The router's selection kernel against its torch reference (CPU interpreter; -m gpu at V3 size)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.router.route import can_route, route, route_ref

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _scores(t: int, e: int, seed: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=gen)  # sigmoid-like scores in (0, 1)
    return scores, (torch.randn(e, generator=gen) * 0.1 if bias else None)


@pytest.mark.parametrize(
    ("e", "groups", "limited", "k", "bias", "norm", "scale"),
    [
        (64, 8, 4, 6, True, True, 2.5),  # V3's kind: groups scored by their top 2 with the bias
        (32, 4, 2, 3, False, False, 1.0),  # V2's kind: groups scored by their max, no renormalization
        (256, 1, 1, 6, True, True, 1.5),  # V4's kind: no groups
        (16, 1, 1, 2, False, True, 1.0),
    ],
)
def test_route_matches_the_reference(e, groups, limited, k, bias, norm, scale):
    scores, b = _scores(5, e, e + k, bias)
    want_w, want_ids = route_ref(scores, b, groups, limited, k, norm, scale)
    assert can_route(e, groups)
    w, ids = route(scores.to(DEVICE), None if b is None else b.to(DEVICE), groups, limited, k, norm, scale)
    assert torch.equal(ids.cpu(), want_ids)
    assert torch.allclose(w.cpu(), want_w, rtol=1e-6, atol=0)


def test_route_keeps_only_the_best_groups():
    """A token whose best single experts sit in a weak group: the group limit changes its choice."""
    scores = torch.tensor([[0.9, 0, 0, 0, 0.5, 0.49, 0.3, 0.2, 0.48, 0.47, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]])
    w, ids = route(scores.to(DEVICE), torch.zeros(16, device=DEVICE), 4, 2, 2, False, 1.0)  # groups 1, 2 stay
    assert ids[0].tolist() == [4, 5] and route_ref(scores, None, 1, 1, 2, False, 1.0)[1][0].tolist() == [0, 4]
    assert torch.equal(ids.cpu(), route_ref(scores, torch.zeros(16), 4, 2, 2, False, 1.0)[1])


def test_can_route_needs_power_of_two_sizes():
    assert can_route(256, 8) and can_route(64, 1)
    assert not can_route(160, 1) and not can_route(96, 3)


@pytest.mark.gpu
def test_route_at_deepseek_v3_size():
    scores, b = _scores(16, 256, 3, True)
    want_w, want_ids = route_ref(scores, b, 8, 4, 8, True, 2.5)
    w, ids = route(scores.cuda(), b.cuda(), 8, 4, 8, True, 2.5)
    assert torch.equal(ids.cpu(), want_ids) and torch.allclose(w.cpu(), want_w, rtol=1e-6, atol=0)
