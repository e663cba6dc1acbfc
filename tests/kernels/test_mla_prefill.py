"""MLA's decompressed prefill attention (kernels/mla/prefill.py): the block kernel against its torch formula (CPU
interpreter at small ragged shapes; -m gpu at DeepSeek-V3 size), the decompressed form against the absorbed one
(mla_decode_ref's) over several key blocks at start_pos > 0, a chunk against the rows of one whole-prompt pass,
and the model's chunks through the decompressed form giving the logits and greedy tokens of the absorbed one."""

from __future__ import annotations

import pytest
import torch

import dsfp4.kernels.mla.prefill as prefill_module
import dsfp4.runtime.models.v3.attention as v3_attention
from dsfp4.kernels.backend import triton
from dsfp4.kernels.mla.prefill import MLAPrefillConfig, mla_prefill, mla_prefill_block, mla_prefill_block_ref
from dsfp4.kernels.token_bounds import DECODE_TOKENS, DECOMPRESS_TOKENS
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.v3.attention import absorbed_attention, decompressed_attention
from dsfp4.runtime.plan.limits import SCORE_ELEMENTS
from dsfp4.runtime.plan.workspace import activation_bytes
from dsfp4.synthetic.bench_model import model_args

needs_triton = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 16 query rows and 16 keys a tile: the small shapes below span several tiles, some partly
SMALL = MLAPrefillConfig(rows=16, keys=16)
V3 = dict(h=128, n=128, r=64, v=128, c=512)


def _inputs(b, t, h, n, r, v, c, start, dtype, seed=0):
    """(q_nope, q_pe, kv, pe, wkv_b, scale) on DEVICE for a chunk of t tokens at start, the cache through it; q
    split from one [.., N + R] tensor (strided, as attention.py splits it)."""
    gen = torch.Generator().manual_seed(seed)
    s = start + t
    q = torch.randn(b, t, h, n + r, generator=gen)
    kv, pe = torch.randn(b, s, c, generator=gen), torch.randn(b, s, r, generator=gen)
    wkv_b = torch.randn(h, n + v, c, generator=gen) * c**-0.5
    q, kv, pe, wkv_b = (x.to(dtype).to(DEVICE) for x in (q, kv, pe, wkv_b))
    # scores of std ~2: a peaked softmax
    return q[..., :n], q[..., n:], kv, pe, wkv_b, 2 * (n + r) ** -0.5


def _causal(t: int, start: int) -> torch.Tensor:
    return torch.full((t, start + t), float("-inf"), device=DEVICE).triu_(start + 1)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want.double().cpu()).abs().max() / want.double().abs().max()).item()


def _block(t, h, n, r, v, s, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(t, h, n), (t, h, r), (s, h, n), (s, r), (s, h, v)]
    return [torch.randn(*x, generator=gen).to(dtype).to(DEVICE) for x in shapes]


@needs_triton
@pytest.mark.parametrize(("n", "r", "v"), [(32, 16, 32), (24, 8, 20)])
def test_the_block_kernel_continues_the_state_of_earlier_blocks_as_the_formula_does(n, r, v):
    """Two key blocks in turn (positions 0..39 and 40..76) for 37 queries at 30..66: the first block's keys past
    some queries, the second block's past all the first tile's (whose rows keep their state). Ragged dims pad."""
    t, h = 37, 3
    q_nope, q_pe, *_ = _block(t, h, n, r, v, 1, seed=1)
    state = {}
    for attend in (mla_prefill_block_ref, mla_prefill_block):
        o = torch.zeros(t, h, v, device=DEVICE)
        lse = torch.full((t, h), float("-inf"), device=DEVICE)
        for k_start, s, seed in ((0, 40, 2), (40, 37, 3)):
            _, _, k_nope, k_pe, vals = _block(t, h, n, r, v, s, seed)
            extra = {} if attend is mla_prefill_block_ref else {"cfg": SMALL}
            attend(q_nope, q_pe, k_nope, k_pe, vals, 30, k_start, 0.3, o, lse, **extra)
        state[attend] = o, lse
    (o_ref, lse_ref), (o, lse) = state.values()
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert _rel(o, o_ref) < 1e-5 and _rel(lse, lse_ref) < 1e-5


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize(("b", "t", "h", "start", "rows"), [(1, 20, 3, 13, 7), (2, 9, 2, 30, 16), (1, 33, 4, 0, 8)])
def test_the_decompressed_form_is_the_absorbed_one_within_bf16_rounding(kernel, b, t, h, start, rows):
    """Several key blocks of `rows` cached rows, a chunk at start (0: the prompt's first): both forms in bf16 against
    a float64 evaluation of the absorbed form; the decompressed one rounds no scores to bf16, so it comes out closer."""
    q_nope, q_pe, kv, pe, wkv_b, scale = _inputs(b, t, h, 32, 16, 32, 64, start, torch.bfloat16)
    mask = _causal(t, start)
    want = absorbed_attention(*(x.double() for x in (q_nope, q_pe, kv, pe, wkv_b)), scale, mask.double(), False)
    absorbed = absorbed_attention(q_nope, q_pe, kv, pe, wkv_b, scale, mask, False)
    got = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, rows, kernel, SMALL)
    assert got.shape == (b, t, h, 32) and got.dtype == torch.bfloat16
    assert _rel(got, want) < 1e-2 and _rel(got, want) <= _rel(absorbed, want)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)])
def test_a_chunk_sees_every_earlier_chunks_rows(kernel):
    """A prompt of 40 tokens attended at once, and its tokens 25..39 as a chunk at start_pos 25 against the cache
    through them: the chunk's outputs are the whole pass's rows 25..39 (missing the earlier rows would change them),
    and the whole pass's first rows do not see the keys after them."""
    q_nope, q_pe, kv, pe, wkv_b, scale = _inputs(1, 40, 2, 32, 16, 32, 64, 0, torch.float32)
    whole = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, 0, scale, 16, kernel, SMALL)
    chunk = mla_prefill(q_nope[:, 25:], q_pe[:, 25:], kv, pe, wkv_b, 25, scale, 16, kernel, SMALL)
    assert _rel(chunk, whole[:, 25:]) < 1e-5
    first = mla_prefill(q_nope[:, :10], q_pe[:, :10], kv[:, :10], pe[:, :10], wkv_b, 0, scale, 16, kernel, SMALL)
    assert _rel(first, whole[:, :10]) < 1e-5
    blind = mla_prefill(q_nope[:, 25:], q_pe[:, 25:], kv[:, 25:], pe[:, 25:], wkv_b, 0, scale, 16, kernel, SMALL)
    assert _rel(blind, whole[:, 25:]) > 1e-2


@pytest.mark.parametrize(("smem", "keys"), [(232448, 64), (166912, 32), (101376, 16), (40000, 16)])
def test_tiles_fit_the_gpus_shared_memory(monkeypatch, smem, keys):
    """H100/H200, A100, RTX 4090-class, and a GPU too small even for 16 keys (the floor is tl.dot's 16), at V3's
    widths in bf16: the default's 172 KB as Triton allots it (queries 128 x 192, 3 stages of keys 64 x 320)."""
    props = type("Props", (), {"shared_memory_per_block_optin": smem})()
    monkeypatch.setattr(prefill_module, "cuda_props", lambda index: props)
    cfg = prefill_module.fitted(MLAPrefillConfig(), torch.device("cuda", 0), 192, 320, 2)
    assert cfg.keys == keys and cfg.stages == MLAPrefillConfig().stages
    assert prefill_module.fitted(MLAPrefillConfig(), torch.device("cpu"), 192, 320, 2) == MLAPrefillConfig()


def test_the_crossover_keeps_decode_and_short_steps_absorbed():
    assert DECOMPRESS_TOKENS >= DECODE_TOKENS


def test_a_prompt_chunked_through_the_decompressed_form_gives_the_tokens_of_one_absorbed_chunk(converted, monkeypatch):
    """Chunks of 4 tokens above a crossover of 2 attend decompressed, each at its start_pos against the rows of the
    chunks before it; one whole-prompt chunk under a crossover past it attends absorbed: the same logits and greedy
    tokens. A chunk that missed its earlier chunks' rows would give other logits."""
    prompt = "Explain the tiers of the expert store, layer by layer"
    monkeypatch.setattr(v3_attention, "DECOMPRESS_TOKENS", 1 << 20)
    with Engine(converted, device=DEVICE, max_context=64, dtype="fp32") as absorbed:
        ids = absorbed.encode(prompt)
        want = absorbed.logits(ids)
        tokens = absorbed.generate(ids, max_tokens=6, temperature=0).token_ids
    monkeypatch.setattr(v3_attention, "DECOMPRESS_TOKENS", 2)
    with Engine(converted, device=DEVICE, max_context=64, dtype="fp32", prefill_chunk=4) as chunked:
        assert len(ids) > 3 * 4
        torch.testing.assert_close(chunked.logits(ids), want, rtol=1e-4, atol=1e-4)
        assert chunked.generate(ids, max_tokens=6, temperature=0).token_ids == tokens


def test_the_plan_counts_a_key_block_and_the_chunks_outputs():
    """V3 at a 512-token chunk: the decompressed form's transients beside the absorbed form's grow the forward's
    bytes by wkv_b dense, a key block (k_nope and v of at most SCORE_ELEMENTS, the whole cache when smaller; k_pe)
    and the outputs."""
    a = model_args(61, 3)[1]
    h, width, t, elt = 128, 256, 512, 2
    wkv_b, outputs = h * width * 512 * elt, t * h * (129 * 4 + 128 * elt)
    for context, rows in ((32768, SCORE_ELEMENTS // (h * width)), (64, 64)):
        absorbed = (
            t * elt * (12 * a.dim + 3 * h * 576 + 6 * a.moe_inter_dim) + 2 * min(SCORE_ELEMENTS, t * h * context) * 4
        )
        block = rows * (h * width + 64) * elt
        assert activation_bytes(a, t, context, elt) == absorbed + wkv_b + block + outputs


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "start"), [(300, 0), (200, 1500)])
def test_the_decompressed_form_at_deepseek_v3_size(t, start):
    """bf16 at V3's heads and widths, blocks of 512 keys: the kernel within bf16 rounding of a float64 evaluation of
    the absorbed form, closer than the absorbed form's bf16, and the torch formula's equal."""
    q_nope, q_pe, kv, pe, wkv_b, scale = _inputs(
        1, t, V3["h"], V3["n"], V3["r"], V3["v"], V3["c"], start, torch.bfloat16
    )
    mask = _causal(t, start)
    want = absorbed_attention(*(x.double() for x in (q_nope, q_pe, kv, pe, wkv_b)), scale, mask.double(), False)
    absorbed = absorbed_attention(q_nope, q_pe, kv, pe, wkv_b, scale, mask, False)
    got = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, 512, True)
    ref = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, 512, False)
    err = _rel(got, want)
    assert not got.isnan().any() and err < 1e-2 and err <= _rel(absorbed, want), (err, _rel(absorbed, want))
    assert _rel(got, ref) < 1e-2


@pytest.mark.gpu
def test_the_decompressed_form_holds_what_the_plan_counts():
    """V3's widths, a 512-token chunk at 7,680 cached tokens: the device's peak during the attention, past its inputs,
    within what the plan adds for it (wkv_b dense is an input here: the plan counts it beside the block)."""
    t, start = 512, 7680
    q_nope, q_pe, kv, pe, wkv_b, scale = _inputs(
        1, t, V3["h"], V3["n"], V3["r"], V3["v"], V3["c"], start, torch.bfloat16
    )
    # a first call compiles the kernel and takes cuBLAS's workspace
    decompressed_attention(q_nope, q_pe, kv, pe, wkv_b, start, scale, True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = decompressed_attention(q_nope, q_pe, kv, pe, wkv_b, start, scale, True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    h, width = V3["h"], V3["n"] + V3["v"]
    rows = min(start + t, SCORE_ELEMENTS // (h * width))
    block = rows * (h * width + V3["r"]) * 2
    outputs = t * h * ((V3["v"] + 1) * 4 + V3["v"] * 2)
    assert o.shape == (1, t, h, V3["v"]) and peak <= block + outputs
