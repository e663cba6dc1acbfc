"""MLA's cache-writing glue kernel against its torch reference (CPU interpreter; -m gpu at V3 sizes)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.mla.cache import mla_cache, mla_cache_ref
from dsfp4.runtime.models.rope import rotations

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b: int, t: int, h: int, n: int, r: int, c: int, rows: list[int], wdtype: torch.dtype, seed: int):
    """Inputs on the CPU: q [B, T, H, N + R], kv [B, T, C + R], freqs [T, R/2], NaN-poisoned caches of
    max batch B + 1 and 2 * max(rows) + 3 rows (a kernel that writes elsewhere, or reads them, shows)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, t, h, n + r, generator=gen) * 3).bfloat16()
    kv = (torch.randn(b, t, c + r, generator=gen) * 3 + 0.5).bfloat16()
    freqs = rotations(torch.rand(r // 2, generator=gen), 2 * max(rows) + 3)[torch.tensor(rows)]
    w = (torch.rand(c, generator=gen) + 0.5).to(wdtype)
    length = 2 * max(rows) + 3
    kv_cache = torch.full((b + 1, length, c), float("nan"), dtype=torch.bfloat16)
    pe_cache = torch.full((b + 1, length, r), float("nan"), dtype=torch.bfloat16)
    return q, kv, freqs, w, kv_cache, pe_cache, torch.tensor(rows)


def _run(fn, case, device: str):
    q, kv, freqs, w, kv_cache, pe_cache, rows = (x.to(device, copy=True) for x in case)  # q and the caches change
    fn(q, kv, freqs, w, 1e-6, kv_cache, pe_cache, rows)
    return q.cpu(), kv_cache.cpu(), pe_cache.cpu()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal NaN pattern (rows never written stay NaN), values within one bf16 rounding step (two under the CPU
    interpreter, whose casts truncate)."""
    ulp = 2**-7 if DEVICE == "cuda" else 2**-6
    nan = want.isnan()
    diff = (got.float() - want.float()).abs()[~nan]
    return bool((got.isnan() == nan).all() and (diff <= ulp * want.float().abs()[~nan] + 1e-6).all())


@pytest.mark.parametrize(
    ("b", "t", "h", "n", "r", "c", "rows", "wdtype"),
    [
        (1, 1, 4, 8, 8, 32, [5], torch.bfloat16),  # one decode token, in the middle of the cache
        (2, 3, 3, 16, 16, 48, [0, 1, 2], torch.bfloat16),  # a prompt chunk; heads and C not powers of two
        (1, 2, 5, 8, 12, 24, [7, 3], torch.float32),  # rows out of order, 6 pairs; an fp32 norm weight (V4-style)
    ],
)
def test_mla_cache_matches_the_reference(b, t, h, n, r, c, rows, wdtype):
    case = _case(b, t, h, n, r, c, rows, wdtype, b * 100 + t * 10 + h)
    want = _run(mla_cache_ref, case, "cpu")
    got = _run(mla_cache, case, DEVICE)
    for g, w in zip(got, want, strict=True):
        assert _close(g, w)
    assert torch.equal(got[0][..., :n], case[0][..., :n]), "the nope dims are left alone"


@pytest.mark.gpu
def test_mla_cache_at_deepseek_v3_sizes():
    case = _case(1, 1, 128, 128, 64, 512, [300], torch.bfloat16, 3)
    want = _run(mla_cache_ref, case, "cuda")
    got = _run(mla_cache, case, "cuda")
    for g, w in zip(got, want, strict=True):
        assert _close(g, w)


def test_mla_cache_each_sequence_at_its_own_position():
    """A batch decode step: rows [B, 1] and freqs [B, 1, R/2], each sequence its own position; kernel and reference
    write what each sequence alone at its position writes."""
    b, h, n, r, c, rows = 3, 4, 8, 8, 32, [4, 0, 9]
    q, kv, _, w, kv_cache, pe_cache, _ = _case(b, 1, h, n, r, c, [max(rows)], torch.bfloat16, 11)
    table = rotations(torch.rand(r // 2, generator=torch.Generator().manual_seed(2)), max(rows) + 1)
    per_row = torch.tensor(rows).view(b, 1)
    case = (q, kv, table[per_row], w, kv_cache, pe_cache, per_row)  # freqs: [B, 1, R/2]
    want = _run(mla_cache_ref, case, "cpu")
    for i, row in enumerate(rows):  # alone: batch 1 at its position
        alone = (q[i : i + 1], kv[i : i + 1], table[[row]], w, kv_cache[i : i + 1], pe_cache[i : i + 1], per_row[i])
        for got, whole in zip(_run(mla_cache_ref, alone, "cpu"), want, strict=True):
            assert _close(got[0], whole[i])
    for g, w_ in zip(_run(mla_cache, case, DEVICE), want, strict=True):
        assert _close(g, w_)
