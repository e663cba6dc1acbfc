"""The FP8 variant of MLA's decompressed prefill attention (kernels/mla/prefill.py, fp8=True): e4m3_rows' rounding
and its round trip; the block kernel (CPU interpreter) against its torch formula, to fp32 rounding where both round
the probabilities at the same max and within e4m3's steps where they do not; the variant against the exact attention
(close, and not equal: it rounds); the rope part left unrounded; a chunk against a whole-prompt pass; the tiles'
shared memory (by the rule and, slow, as Triton compiles them for Ada and Hopper); -m gpu at DeepSeek-V3 size."""

from __future__ import annotations

import pytest
import torch

import dsfp4.kernels.mla.prefill as prefill_module
from dsfp4.kernels.backend import card_of, triton
from dsfp4.kernels.mla.e4m3_rows import E4M3, E4M3_MAX, as_e4m3, dequantize, e4m3_rows
from dsfp4.kernels.mla.prefill import (
    FP8_MIN_K,
    MLAPrefillConfig,
    block_plan,
    default_config,
    fp8_kernel_runs,
    mla_prefill,
    mla_prefill_block,
    mla_prefill_block_ref,
)
from tests.fixtures.cards import CARDS
from tests.kernels.ptx_targets import Build, shared_bytes
from tests.kernels.test_mla_prefill import DEVICE, V3, _block, _inputs, _rel

needs_triton = pytest.mark.skipif(triton is None, reason="Triton is not installed")
# 16 query rows a tile, 32 keys (fp8's smallest K): the small shapes below span several tiles, some partly
SMALL = MLAPrefillConfig(rows=16, keys=FP8_MIN_K)
# e4m3 has 3 mantissa bits: rounding to nearest moves a normal value by at most half a step, 2^-4 of it
E4M3_HALF_STEP = 2.0**-4
# the subnormals' step (2^-9): below the normal range a value moves by at most half of it, in the row's scale
E4M3_SUBNORMAL_STEP = 2.0**-9
# what the first key of a block scores above the rest in the same-max test: far past the rounding's effect on scores
MARGIN = 1.0
# the block test's two blocks: (k_start, keys, seed) for 37 queries at 30..66
BLOCKS = ((0, 40, 2), (40, 37, 3))
KERNEL = "dsfp4.kernels.mla.prefill_jit:block_kernel"
# fp8 against the exact attention, relative to the output's largest magnitude: twice the 9% the small shapes showed
FP8_ERROR = 0.2
# bf16's relative step: an output rounded to it from two fp32 values a rounding apart may land a step apart
BF16_STEP = 2.0**-8


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


def _attend(attend, q_nope, q_pe, blocks, fp8, t, h, v) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) after `attend` takes the key blocks [(k_start, k_nope, k_pe, v)] in turn, queries at 30.."""
    o = torch.zeros(t, h, v, device=DEVICE)
    lse = torch.full((t, h), float("-inf"), device=DEVICE)
    q = e4m3_rows(q_nope, -1) if fp8 else q_nope
    for k_start, k_nope, k_pe, vals in blocks:
        extra = {"cfg": SMALL} if attend is mla_prefill_block else {}
        if fp8:
            k_nope, vals = e4m3_rows(k_nope, -1), e4m3_rows(vals, 0)
        attend(q, q_pe, k_nope, k_pe, vals, 30, k_start, 0.3, o, lse, fp8=fp8, **extra)
    return o, lse


def _two_blocks(n, r, v, first_key_max=False):
    """37 queries at 30..66, 3 heads, and two key blocks at 0..39 and 40..76 (the second past the first query tile):
    q_nope, q_pe, [(k_start, k_nope, k_pe, v)]. first_key_max: each block's first key scores MARGIN above the
    block's others for every query and head (through q_pe's first dim against a k_pe that only that key has)."""
    t, h = 37, 3
    q_nope, q_pe, *_ = _block(t, h, n, r, v, 1, seed=1)
    blocks = [(k_start, *_block(t, h, n, r, v, s, seed)[2:]) for k_start, s, seed in BLOCKS]
    if first_key_max:
        need = torch.zeros(t, h)
        for _, k_nope, k_pe, _ in blocks:
            k_pe[:, 0] = 0
            scores = torch.einsum("thn,shn->ths", q_nope, k_nope) + torch.einsum("thr,sr->ths", q_pe, k_pe)
            need = torch.maximum(need, scores[..., 1:].amax(-1) - scores[..., 0])
            k_pe[0, 0] = 1
        q_pe[..., 0] = need + MARGIN / 0.3
    return q_nope, q_pe, blocks


@needs_triton
@pytest.mark.parametrize(("n", "r", "v"), [(32, 16, 32), (24, 8, 20)])
def test_the_fp8_kernel_is_the_fp8_formula_where_both_round_at_the_same_max(n, r, v):
    """Each block's first key holds its max, so the kernel's running max is the block's from the first tile on and
    it rounds every probability where the formula does: the two agree to fp32 rounding (exp2 against exp moves a
    probability across an e4m3 midpoint about once in 10^5), o and lse, over two blocks and ragged dims."""
    q_nope, q_pe, blocks = _two_blocks(n, r, v, first_key_max=True)
    o_ref, lse_ref = _attend(mla_prefill_block_ref, q_nope, q_pe, blocks, True, 37, 3, v)
    o, lse = _attend(mla_prefill_block, q_nope, q_pe, blocks, True, 37, 3, v)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert _rel(o, o_ref) < 1e-5 and _rel(lse, lse_ref) < 1e-5, (_rel(o, o_ref), _rel(lse, lse_ref))


@needs_triton
@pytest.mark.parametrize(("n", "r", "v"), [(32, 16, 32), (24, 8, 20)])
def test_the_fp8_kernel_continues_earlier_blocks_within_e4m3_steps_of_the_formula(n, r, v):
    """Random keys: the kernel rounds p * 448 at each tile's running max, the formula at the block's. Each keeps
    every probability within half an e4m3 step (2^-4) of the unrounded one, and the sums (l) are of the unrounded
    ones, so each o is within 2^-4 max|v| of what unrounded probabilities give and the two within 2^-3 max|v|;
    lse takes no rounded probability: fp32 rounding apart."""
    q_nope, q_pe, blocks = _two_blocks(n, r, v)
    o_ref, lse_ref = _attend(mla_prefill_block_ref, q_nope, q_pe, blocks, True, 37, 3, v)
    o, lse = _attend(mla_prefill_block, q_nope, q_pe, blocks, True, 37, 3, v)
    v_max = max(dequantize(e4m3_rows(b[3], 0), 0).abs().max().item() for b in blocks)
    assert torch.isfinite(o).all() and (o - o_ref).abs().max() <= 2 * E4M3_HALF_STEP * v_max
    assert _rel(lse, lse_ref) < 1e-5


def _v_max(kv: torch.Tensor, wkv_b: torch.Tensor, n: int) -> float:
    """The largest |v| of the expanded cache (v = kv wkv_b[:, n:]^T): e4m3_rows keeps it exactly."""
    return torch.einsum("bsc,hvc->bshv", kv.float(), wkv_b[:, n:].float()).abs().max().item()


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "t", "h", "start", "rows"), [(1, 20, 3, 13, 7), (2, 9, 2, 30, 16)])
def test_fp8_is_close_to_the_exact_attention_and_not_equal(kernel, dtype, b, t, h, start, rows):
    """mla_prefill over several key blocks, a chunk at start: fp8 against the exact fp32 formula farther than 1e-3
    (the exact kernel is within 1e-6 in fp32: fp8 rounds) and within FP8_ERROR (4-9% measured here: q and k within
    2^-4 of themselves move scores of std ~2 by a few hundredths, and the peaked softmax carries that to o). Blocks of
    7 and 16 keys fit one key tile of 32, where the kernel rounds at the block's max as the formula does: the two
    agree to fp32 rounding (to a bf16 step in bf16)."""
    q_nope, q_pe, kv, pe, wkv_b, scale = _inputs(b, t, h, 32, 16, 32, 64, start, dtype)
    exact = mla_prefill(*(x.float() for x in (q_nope, q_pe, kv, pe, wkv_b)), start, scale, rows, False)
    got = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, rows, kernel, SMALL, fp8=True)
    assert got.dtype == dtype and got.shape == exact.shape
    assert 1e-3 < _rel(got, exact) < FP8_ERROR, _rel(got, exact)
    if kernel:
        ref = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, rows, False, fp8=True)
        assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else BF16_STEP), _rel(got, ref)


@pytest.mark.parametrize("attend", [mla_prefill_block_ref, pytest.param(mla_prefill_block, marks=needs_triton)])
def test_the_rope_part_of_the_scores_is_not_rounded(attend):
    """lse depends on the scores alone (its sums take the unrounded probabilities): with q_nope zero the scores are
    the rope part's, and fp8's lse is the exact one's to fp32 rounding; with q_nope as drawn it moves (the nope
    part is rounded)."""
    q_nope, q_pe, blocks = _two_blocks(32, 16, 32)
    for nope, moved in ((torch.zeros_like(q_nope), False), (q_nope, True)):
        _, lse = _attend(attend, nope, q_pe, blocks, True, 37, 3, 32)
        _, want = _attend(mla_prefill_block_ref, nope, q_pe, blocks, False, 37, 3, 32)
        assert (_rel(lse, want) > 1e-3) == moved, _rel(lse, want)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_triton)])
def test_an_fp8_chunk_sees_every_earlier_chunks_rows(kernel):
    """A prompt of 40 tokens attended at once with fp8, and its tokens 25..39 as a chunk at start_pos 25: the same
    rows (q rounds per token, k per key, v per block of keys that both passes cut alike, and each row's running max
    over the same keys), and a chunk blind to the earlier rows gives others."""
    q_nope, q_pe, kv, pe, wkv_b, scale = _inputs(1, 40, 2, 32, 16, 32, 64, 0, torch.float32)
    whole = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, 0, scale, 16, kernel, SMALL, fp8=True)
    chunk = mla_prefill(q_nope[:, 25:], q_pe[:, 25:], kv, pe, wkv_b, 25, scale, 16, kernel, SMALL, fp8=True)
    assert _rel(chunk, whole[:, 25:]) < 1e-5
    blind = mla_prefill(q_nope[:, 25:], q_pe[:, 25:], kv[:, 25:], pe[:, 25:], wkv_b, 0, scale, 16, kernel, SMALL, True)
    assert _rel(blind, whole[:, 25:]) > 1e-2


def _plan(monkeypatch, name: str, fp8: bool) -> tuple[MLAPrefillConfig, list[int]]:
    monkeypatch.setattr(prefill_module, "cuda_props", lambda index: CARDS[name])
    return block_plan(default_config(fp8), torch.device("cuda", 0), V3["n"], V3["r"], V3["v"], 2, fp8)


@pytest.mark.parametrize(("name", "bf16_keys", "fp8_keys"), [("H100", 64, 128), ("RTX 4090", 16, 64)])
def test_e4m3_tiles_take_half_the_shared_memory(monkeypatch, name, bf16_keys, fp8_keys):
    """V3's widths: a query row of 128 e4m3 nope + 64 bf16 rope columns (256 bytes against 384), a key row of those
    and 128 e4m3 values (384 against 640); each variant's default tiles (fp8's: 64 query rows, 2 stages of 128 keys)
    fitted to the card: the 100 KB Ada card keeps 64 keys under fp8, 16 under bf16."""
    assert _plan(monkeypatch, name, False)[0].keys == bf16_keys
    cfg, pads = _plan(monkeypatch, name, True)
    assert cfg.keys == fp8_keys and pads == [128, 64, 128]


def test_fp8_tiles_keep_tl_dots_smallest_k_for_8_bit_operands(monkeypatch):
    """A narrow nope dim pads to 32 under fp8, a 16-key tile grows to 32, and a card too small even for them stays
    at 32: Triton takes no 8-bit product of K < 32."""
    monkeypatch.setattr(prefill_module, "cuda_props", lambda index: type("P", (), {"shared_memory_per_block_optin": 1}))
    cfg, pads = block_plan(MLAPrefillConfig(keys=16), torch.device("cuda", 0), 16, 16, 16, 2, True)
    assert cfg.keys == FP8_MIN_K and pads == [FP8_MIN_K, 16, 16]


def test_the_fp8_kernel_runs_where_the_gpu_has_fp8_tensor_cores(monkeypatch):
    for name, runs in (("A100", False), ("RTX 3090", False), ("RTX 4090", True), ("H100", True), ("RTX 5090", True)):
        monkeypatch.setattr(prefill_module, "cuda_props", lambda index, p=CARDS[name]: p)
        assert fp8_kernel_runs(torch.device("cuda", 0)) == runs, name
    # the tests' CPU runs the kernels under TRITON_INTERPRET
    assert fp8_kernel_runs(torch.device("cpu")) == prefill_module.interpreted()


def _kernel_args(fp8: bool, cfg: MLAPrefillConfig, pads: list[int]) -> dict:
    """block_kernel's arguments as mla_prefill_block passes them at V3's widths in bf16 (stride_vc: 1 for bf16)."""
    nv = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = dict(qn_ptr=nv, qp_ptr="*bf16", kn_ptr=nv, kp_ptr="*bf16", v_ptr=nv, o_ptr="*fp32", lse_ptr="*fp32")
    scales = dict(qs_ptr="*fp32", ks_ptr="*fp32", vs_ptr="*fp32", stride_qst="i32", stride_kst="i32")
    names = ("T", "S", "q_start", "k_start", "stride_qnt", "stride_qnh", "stride_qpt", "stride_qph", "stride_knt")
    names += ("stride_knh", "stride_kpt", "stride_vt", "stride_vh", "stride_ot", "stride_oh", "stride_lt")
    ints = {k: "i32" for k in names} | dict(stride_vsh="i32", stride_vc="i32" if fp8 else 1)
    dims = dict(N=V3["n"], R=V3["r"], V=V3["v"], NP=pads[0], RP=pads[1], VP=pads[2], BM=cfg.rows, BN=cfg.keys)
    kinds = dict(DOT="tl.bfloat16", NV_DOT="tl.float8e4nv" if fp8 else "tl.bfloat16", PRECISION="tf32")
    return {**ptrs, "qk_scale": "fp32", **ints, **scales, **dims, **kinds, "FP8": fp8, "WIDE": False}


@pytest.mark.slow
@needs_triton
def test_the_fp8_kernel_compiles_for_ada_and_hopper_within_the_rules_shared_memory(monkeypatch):
    """The fp8 block kernel at V3's widths, tiled as block_plan tiles it for an RTX 4090 (sm_89) and an H100
    (sm_90): it compiles (e4m3 products, the cast of p), and Triton allots it no more shared memory than the rule
    counts (its stages of 384-byte key rows and the 256-byte query rows) nor than the card gives."""
    cases = []
    for name in ("RTX 4090", "H100"):
        cfg, pads = _plan(monkeypatch, name, True)
        rule = cfg.stages * cfg.keys * (pads[0] + 2 * pads[1] + pads[2]) + cfg.rows * (pads[0] + 2 * pads[1])
        c = card_of(CARDS[name])
        args = _kernel_args(True, cfg, pads)
        cases.append((name, rule, c.smem, Build(KERNEL, c.capability, args, cfg.warps, cfg.stages)))
    for (name, rule, smem, _), shared in zip(cases, shared_bytes([b for *_, b in cases]), strict=True):
        assert isinstance(shared, int) and shared <= min(rule, smem), (name, shared, rule, smem)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "start"), [(300, 0), (200, 1500)])
def test_fp8_at_deepseek_v3_size(t, start):
    """bf16 at V3's heads and widths, blocks of 512 keys, on FP8 tensor cores: the kernel within e4m3 steps of its
    torch formula and close to (not equal to) the exact kernel."""
    if not fp8_kernel_runs(torch.device(DEVICE)):
        pytest.skip("no FP8 tensor cores")
    q_nope, q_pe, kv, pe, wkv_b, scale = _inputs(
        1, t, V3["h"], V3["n"], V3["r"], V3["v"], V3["c"], start, torch.bfloat16
    )
    exact = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, 512, True)
    got = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, 512, True, fp8=True)
    ref = mla_prefill(q_nope, q_pe, kv, pe, wkv_b, start, scale, 512, False, fp8=True)
    assert not got.isnan().any()
    assert (got.float() - ref.float()).abs().max() <= 2 * E4M3_HALF_STEP * _v_max(kv, wkv_b, V3["n"])
    assert 1e-3 < _rel(got, exact) < FP8_ERROR, _rel(got, exact)


def test_e4m3_rows_in_pieces_are_the_rows_rounded_at_once(monkeypatch):
    from dsfp4.kernels.mla import e4m3_rows as rows_module

    x = torch.randn(7, 3, 40, generator=torch.Generator().manual_seed(3))
    whole = rows_module.e4m3_rows(x, -1)
    monkeypatch.setattr(rows_module, "PIECE_ELEMENTS", 2 * 3 * 40)  # pieces of 2 rows of the first dim
    pieces = rows_module.e4m3_rows(x, -1)
    assert torch.equal(pieces.values.float(), whole.values.float()) and torch.equal(pieces.scale, whole.scale)
    assert pieces.values.stride(-1) == 1
