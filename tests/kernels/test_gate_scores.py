"""The router's score kernel against its torch reference (CPU interpreter at small ragged shapes; -m gpu at V3 and
V4 size)."""

from __future__ import annotations

import math

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.router.gate_scores import MAX_TOKENS, GateTiles, can_score, gate_scores, gate_scores_ref

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = torch.finfo(torch.float32).eps
SUM_SLACK = 4  # fp32 sums of D terms in another order: errors grow like sqrt(D) ulps of sum |x w| (random rounding)
FUNC_RTOL = 1e-5  # exp, log and the division of the score functions on the GPU (a few ulps each)


def _inputs(t: int, e: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, D] in dtype, weight: [E, D] fp32 whose rows' scales spread the logits over about +-30."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=gen).to(dtype)
    w = torch.randn(e, d, generator=gen) * torch.linspace(0.05, 10.0, e)[:, None] / math.sqrt(d)
    return x, w


def assert_scores_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, score_func: str) -> None:
    """got: [T, E] against the reference on the CPU; both score functions have slopes below 1, so the logits'
    summation-order error bounds the scores' too."""
    x, w = x.cpu(), w.cpu()
    want = gate_scores_ref(x, w, score_func)
    magnitude = x.float().abs() @ w.abs().T  # [T, E]: sum |x w|
    tol = SUM_SLACK * math.sqrt(x.shape[1]) * EPS32 * magnitude + FUNC_RTOL * want.abs()
    err = (got.cpu() - want).abs()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all() and (err <= tol).all(), f"worst excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize(
    ("t", "e", "d", "dtype", "score_func", "tiles"),
    [
        (1, 16, 96, torch.bfloat16, "sigmoid", None),  # one chunk wider than D
        (3, 32, 200, torch.float32, "sqrtsoftplus", GateTiles(block_e=4, block_d=64)),  # 4 chunks, a ragged last
        (16, 32, 200, torch.bfloat16, "sqrtsoftplus", None),
        (3, 20, 96, torch.bfloat16, "sigmoid", GateTiles(block_e=8, block_d=32)),  # E not a multiple of BLOCK_E
        (16, 16, 96, torch.float32, "sigmoid", GateTiles(block_e=2, block_d=32, num_warps=1)),
        (1, 20, 200, torch.float32, "sqrtsoftplus", GateTiles(block_e=1, block_d=128, num_warps=4)),
    ],
)
@pytest.mark.slow
def test_gate_scores_match_the_reference(t, e, d, dtype, score_func, tiles):
    x, w = _inputs(t, e, d, dtype, seed=t + e + d)
    x, w = x.to(DEVICE), w.to(DEVICE)
    assert can_score(x, w, score_func) is None
    assert_scores_close(gate_scores(x, w, score_func, tiles), x, w, score_func)


@pytest.mark.parametrize("score_func", ["sigmoid", "sqrtsoftplus"])
def test_large_logits_and_the_softplus_threshold(score_func):
    """Logits around softplus's threshold (20) and past where exp overflows fp32 (88): softplus(z) = z there."""
    targets = torch.tensor([-100.0, -40.0, -20.5, -1.0, 0.0, 19.9, 20.0, 20.1, 30.0, 89.0, 100.0, 200.0])
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 96, generator=gen).to(torch.bfloat16)
    first = x[0].float()
    w = targets[:, None] * first / first.dot(first) + torch.randn(len(targets), 96, generator=gen) * 1e-4
    got = gate_scores(x.to(DEVICE), w.to(DEVICE), score_func, GateTiles(block_e=4, block_d=64))
    assert_scores_close(got, x, w, score_func)
    if score_func == "sqrtsoftplus":
        assert torch.allclose(got[0, -3:].cpu(), targets[-3:].sqrt(), rtol=1e-5)


def test_a_tokens_scores_do_not_depend_on_the_others():
    """Deterministic: the same call twice is bitwise equal, and a token alone scores as in a batch."""
    x, w = _inputs(5, 16, 96, torch.bfloat16, seed=3)
    x, w = x.to(DEVICE), w.to(DEVICE)
    batch = gate_scores(x, w, "sigmoid")
    assert torch.equal(batch, gate_scores(x, w, "sigmoid"))
    assert torch.equal(batch[2:3], gate_scores(x[2:3], w, "sigmoid"))


def test_the_reference_takes_what_the_kernel_does_not():
    x, w = (t.to(DEVICE) for t in _inputs(MAX_TOKENS + 1, 16, 96, torch.bfloat16, seed=4))
    assert "softmax" in can_score(x[:2], w, "softmax")
    assert "T <= 16" in can_score(x, w, "sigmoid")
    assert "unit stride" in can_score(x[:2, ::2], w[:, ::2], "sigmoid")
    assert "fp32 weight" in can_score(x[:2], w.half(), "sigmoid")
    for args in ((x[:2], w, "softmax"), (x, w, "sigmoid")):
        assert torch.equal(gate_scores(*args), gate_scores_ref(*args))


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "score_func"), [(7168, "sigmoid"), (4096, "sqrtsoftplus")])  # V3, V4-Flash
@pytest.mark.parametrize("t", [1, 4])
def test_gate_scores_at_deepseek_size(d, score_func, t):
    x, w = _inputs(t, 256, d, torch.bfloat16, seed=d + t)
    x, w = x.cuda(), w.cuda()
    assert can_score(x, w, score_func) is None
    assert_scores_close(gate_scores(x, w, score_func), x, w, score_func)
