"""MLA's decode attention kernel against a float64 evaluation of the torch formula and its bf16 reference (CPU
interpreter at small ragged shapes; -m gpu at DeepSeek-V3 size)."""

from __future__ import annotations

import pytest
import torch

import dsfp4.kernels.mla.decode as mla_decode_module
from dsfp4.kernels.backend import triton
from dsfp4.kernels.mla.decode import MAX_TOKENS, MLADecodeConfig, mla_decode, mla_decode_ref, split_plan

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = MLADecodeConfig(block_s=16)  # tiles of 16 positions: S = 37 and 100 split, S <= 16 writes lat directly
SLACK = 2e-3  # how much less accurate than the bf16 formula the kernel may come out: one output rounding
EXTRA_ROWS = 5  # cache rows past the span (NaN), as in the model's [max_batch, max_len, C] buffers


def _case(b: int, t: int, h: int, c: int, r: int, s: int, dtype: torch.dtype, seed: int, pos: int | None = None):
    """(qn, qp, kv, pe, scale, mask): the caches slices [:B, :S] of NaN-filled buffers with a spare sequence and
    EXTRA_ROWS rows past S; mask [T, S] causal for tokens at pos.. (default S - T), None when T = 1 and pos is."""
    gen = torch.Generator().manual_seed(seed)
    kv_buf = torch.full((b + 1, s + EXTRA_ROWS, c), float("nan"), dtype=dtype)
    pe_buf = torch.full((b + 1, s + EXTRA_ROWS, r), float("nan"), dtype=dtype)
    kv_buf[:b, :s] = torch.randn(b, s, c, generator=gen).to(dtype)
    pe_buf[:b, :s] = torch.randn(b, s, r, generator=gen).to(dtype)
    q = (2 * torch.randn(b, t, h, c + r, generator=gen)).to(dtype)  # scores of std ~2: a peaked softmax
    qn, qp = q[..., :c], q[..., c:]  # [B, T, H, C], [B, T, H, R]: strided heads, as attention.py splits q
    mask = None
    if t > 1 or pos is not None:
        first = s - t if pos is None else pos
        rows = first + torch.arange(t)  # [T] the tokens' positions
        mask = torch.zeros(t, s).masked_fill_(torch.arange(s)[None, :] > rows[:, None], float("-inf"))
    dev = [x.to(DEVICE) for x in (qn, qp, kv_buf, pe_buf)]
    return dev[0], dev[1], dev[2][:b, :s], dev[3][:b, :s], (c + r) ** -0.5, None if mask is None else mask.to(DEVICE)


def _f64(qn, qp, kv, pe, scale, mask) -> torch.Tensor:
    return mla_decode_ref(*(x.cpu().double() for x in (qn, qp, kv, pe)), scale, None if mask is None else mask.cpu())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.cpu().double() - want.double()).abs().max() / want.double().abs().max()).item()


CASES = [(b, t, h, s) for s in (1, 7, 37, 100) for t in ((1,) if s == 1 else (1, 2)) for b, h in ((1, 8), (2, 4))]


@pytest.mark.parametrize(("b", "t", "h", "s"), CASES)
@pytest.mark.slow
def test_mla_decode_matches_the_formula(b, t, h, s):
    args = _case(b, t, h, 32, 16, s, torch.bfloat16, seed=b * 1000 + t * 100 + s)
    want = _f64(*args)
    got = mla_decode(*args, cfg=SMALL)
    ref = mla_decode_ref(*args)  # the bf16 formula: rounded scores and probs
    assert got.shape == (b, t, h, 32) and got.dtype == torch.bfloat16
    assert not got.isnan().any(), "NaN cache rows past the span leaked in"
    # fp32 scores and probs: within the output's bf16 rounding of float64 (the interpreter truncates, the GPU
    # rounds to nearest and rounds the probs to bf16 for the tensor cores), and closer than the bf16 formula
    # (its scores rounded to bf16 before the exponential)
    err, ref_err = _rel(got, want), _rel(ref, want)
    assert err < 1e-2 and err <= ref_err + SLACK


SPLIT2 = MLADecodeConfig(block_s=16, splits=2)


@pytest.mark.parametrize(("t", "h", "s", "cfg"), [(3, 8, 100, SMALL), (2, 4, 37, SPLIT2)])
def test_mla_decode_fp32_is_exact(t, h, s, cfg):
    """fp32 caches: fp32 products (ieee), so only summation order differs. T = 3 at 8 heads: 24 query rows, two
    row blocks, the second half empty; a fixed split count of 2 over 3 tiles (2 and 1)."""
    args = _case(2, t, h, 32, 16, s, torch.float32, seed=t + s)
    assert _rel(mla_decode(*args, cfg=cfg), _f64(*args)) < 1e-5


def test_mla_decode_skips_masked_tiles():
    """A captured step's mask: one token at pos 20 of a span of 100, the rows past it -inf; tiles past it (and
    splits with nothing unmasked) weigh 0, and with skip_masked they are not read: NaN rows there stay out."""
    qn, qp, kv, pe, scale, mask = _case(2, 1, 8, 32, 16, 100, torch.float32, seed=3, pos=20)
    want = _f64(qn, qp, kv, pe, scale, mask)
    for skip in (True, False):
        got = mla_decode(qn, qp, kv, pe, scale, mask, cfg=MLADecodeConfig(block_s=16, skip_masked=skip))
        assert not got.isnan().any() and _rel(got, want) < 1e-5
    kv[:, 2 * SMALL.block_s :] = float("nan")  # the tiles past the one holding pos 20
    got = mla_decode(qn, qp, kv, pe, scale, mask, cfg=SMALL)
    assert not got.isnan().any() and _rel(got, want) < 1e-5


def test_mla_decode_rows_masked_but_one():
    """Each token sees only its own position (the rest -inf) in a span split three ways: the token's split holds
    all its weight, lat is exactly that cache row."""
    qn, qp, kv, pe, scale, _ = _case(1, 2, 4, 32, 16, 40, torch.float32, seed=5)
    mask = torch.full((2, 40), float("-inf"), device=qn.device)
    mask[0, 3], mask[1, 35] = 0.0, 0.0
    got, kv = mla_decode(qn, qp, kv, pe, scale, mask, cfg=SMALL).cpu(), kv.cpu()
    assert torch.equal(got[0, 0], kv[0, 3].expand(4, -1)) and torch.equal(got[0, 1], kv[0, 35].expand(4, -1))


def test_split_plan_covers_the_span_without_empty_splits():
    cfg = MLADecodeConfig()
    for s in (1, 63, 64, 65, 300, 1000, 2048, 4096, 5000):
        for row_blocks in (8, 32):
            splits, chunk = split_plan(s, row_blocks, 132, cfg)
            assert chunk % cfg.block_s == 0 and (splits - 1) * chunk < s <= splits * chunk
            assert splits * row_blocks <= 132 * cfg.waves + row_blocks or splits == triton.cdiv(s, cfg.block_s)
    assert split_plan(4096, 8, 132, MLADecodeConfig(waves=1)) == (16, 256)  # V3 at B T = 1: 8 x 16 heads, 128 programs
    assert split_plan(4096, 8, 132, MLADecodeConfig(waves=2)) == (32, 128)  # two programs per SM
    assert split_plan(300, 8, 132, MLADecodeConfig(splits=2)) == (2, 192)


def test_mla_decode_bounds_its_tokens():
    args = _case(MAX_TOKENS + 1, 1, 4, 32, 16, 7, torch.float32, seed=0)
    with pytest.raises(AssertionError, match="tokens"):
        mla_decode(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1, 300, 2048])
@pytest.mark.parametrize(("b", "t"), [(1, 1), (2, 2)])
def test_mla_decode_at_deepseek_v3_size(b, t, s):
    if s < t:
        pytest.skip("a span holds its tokens")
    args = _case(b, t, 128, 512, 64, s, torch.bfloat16, seed=s + t)
    got = mla_decode(*args)
    want = _f64(*args)
    err, ref_err = _rel(got, want), _rel(mla_decode_ref(*args), want)
    assert not got.isnan().any() and err < 1e-2 and err <= ref_err + SLACK, (err, ref_err)


@pytest.mark.parametrize(("smem", "block_s"), [(233472, 64), (167936, 64), (102400, 32), (40000, 16)])
def test_tiles_fit_the_gpus_shared_memory(monkeypatch, smem, block_s):
    """H100, A100, RTX 4090-class, and a GPU too small even for 32 positions (the floor is tl.dot's 16)."""
    props = type("Props", (), {"shared_memory_per_multiprocessor": smem})()
    monkeypatch.setattr(mla_decode_module, "cuda_props", lambda index: props)
    cfg = mla_decode_module.fitted(MLADecodeConfig(), torch.device("cuda", 0), 512, 64, 2)  # V3's latent, bf16
    assert cfg.block_s == block_s and cfg.stages == MLADecodeConfig().stages
    assert mla_decode_module.fitted(MLADecodeConfig(), torch.device("cpu"), 512, 64, 2) == MLADecodeConfig()


def test_mla_decode_each_sequence_its_own_mask():
    """A batch decode step: mask [B, 1, S], each sequence at its own position in a common span; the kernel gives
    what each sequence alone gives with its own [1, S] mask, and the reference too."""
    b, s, positions = 3, 40, [5, 39, 17]
    qn, qp, kv, pe, scale, _ = _case(b, 1, 4, 32, 16, s, torch.float32, seed=7)
    masks = [
        torch.zeros(1, s, device=qn.device).masked_fill_(torch.arange(s, device=qn.device) > p, float("-inf"))
        for p in positions
    ]
    mask = torch.stack(masks)  # [B, 1, S]
    got, ref = mla_decode(qn, qp, kv, pe, scale, mask, cfg=SMALL), mla_decode_ref(qn, qp, kv, pe, scale, mask)
    for i, m in enumerate(masks):
        one = (qn[i : i + 1], qp[i : i + 1], kv[i : i + 1], pe[i : i + 1], scale, m)
        assert _rel(got[i : i + 1], _f64(*one)) < 1e-5
        assert torch.allclose(ref[i : i + 1], mla_decode_ref(*one))
