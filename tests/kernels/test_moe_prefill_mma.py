"""The FP4 tensor-core prefill (W4A8) and its MXFP8 activations against their torch references (the CPU interpreter
at small shapes; -m gpu at V3 size, where Triton upcasts dot_scaled below Blackwell), its error against the exact
W4A16 reference bounded, and where MoEKernel takes it."""

from __future__ import annotations

import math

import pytest
import torch

from dsfp4.errors import FormatError
from dsfp4.kernels import backend
from dsfp4.kernels.backend import tl, triton
from dsfp4.kernels.moe import act_mxfp8 as mx
from dsfp4.kernels.moe import prefill as mp
from dsfp4.kernels.moe import prefill_mma as pm
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.kernels.moe.ref import moe_ref
from dsfp4.layout.record import RecordLayout
from tests.fixtures.moe_records import routing, slot_pool

pytestmark = [
    pytest.mark.skipif(triton is None, reason="Triton is not installed"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# e4m3 keeps 3 mantissa bits: a normal code is within 2^-4 of its value; a subnormal within 2^-10 of the block scale
NORMAL_ERROR, SUBNORMAL_QUANTUM = 2.0**-4, 2.0**-10


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


if triton is not None:

    @triton.jit
    def _probe_kernel(w_ptr, s_ptr, a_ptr, o_ptr):
        r, k = tl.arange(0, 16), tl.arange(0, 32)
        w = tl.load(w_ptr + r[:, None] * 16 + tl.arange(0, 16)[None, :])
        s = tl.load(s_ptr + r[:, None])
        a = tl.load(a_ptr + r[:, None] * 32 + k[None, :])
        tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot_scaled(w, s, "e2m1", tl.trans(a), s, "e4m3"))

    @triton.jit
    def _e4m3_kernel(x_ptr, o_ptr, n, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(o_ptr + i, mx.e4m3_bits(tl.load(x_ptr + i, mask=i < n, other=0.0)).to(tl.uint8), mask=i < n)


@pytest.fixture
def poisoned(monkeypatch):
    """Workspaces start as NaN, so a row the kernels forget to write shows in the result."""

    def nan_filled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(pm, "_workspace", nan_filled)


@pytest.fixture(scope="module")
def dot_scaled_runs() -> None:
    """Skip where this Triton cannot run tl.dot_scaled here (an interpreter without it, a card Triton refuses)."""
    ones = torch.full((16, 1), 127, dtype=torch.uint8, device=DEVICE)
    w = torch.full((16, 16), 0x22, dtype=torch.uint8, device=DEVICE)  # every code 1.0
    a = torch.full((16, 32), 0x38, dtype=torch.uint8, device=DEVICE)  # e4m3 1.0
    out = torch.empty(16, 16, device=DEVICE)
    try:
        _probe_kernel[(1,)](w, ones, a, out)
    except Exception as e:  # noqa: BLE001 (any failure of the compiler or interpreter means it cannot run here)
        pytest.skip(f"tl.dot_scaled does not run here: {type(e).__name__}")
    assert torch.equal(out.cpu(), torch.full((16, 16), 32.0))


def test_e4m3_rounding_by_bits_is_torchs_on_every_tie_and_subnormal():
    """The kernel's integer rounding against torch's conversion on grids that hold every e4m3 value, every tie
    between two and the subnormals (quantum 2^-9)."""
    grid = torch.cat([torch.arange(0, 448 + 2**-12, 2**-12), torch.arange(0, 2**-5, 2**-16)])
    grid = torch.cat([grid, -grid]).to(DEVICE)
    got = torch.empty(grid.numel(), dtype=torch.uint8, device=DEVICE)
    _e4m3_kernel[(triton.cdiv(grid.numel(), 4096),)](grid, got, grid.numel(), B=4096)
    assert torch.equal(got, grid.to(torch.float8_e4m3fn).view(torch.uint8))


def _activations(gen: torch.Generator) -> torch.Tensor:
    """Rows across 40 binades, a zero block, a block whose amax is exactly 448 * 2^-k, subnormal-heavy blocks."""
    x = torch.randn(37, 128, generator=gen) * torch.logspace(-20, 20, 128)[None, :]
    x[0, :32] = 0
    x[1, :32] = torch.tensor([448.0 * 2**-5] + [0.5**k for k in range(31)])
    x[2, :32] = torch.linspace(-3, 3, 32) * 2**-9
    return x


def test_mxfp8_kernel_gives_the_references_codes_and_scales():
    x = _activations(torch.Generator().manual_seed(0))
    codes, scales = mx.mxfp8_quantize(x.to(DEVICE))
    want_codes, want_scales = mx.mxfp8_quantize_ref(x)
    assert torch.equal(codes.cpu(), want_codes) and torch.equal(scales.cpu(), want_scales)
    bf = x.bfloat16()
    assert torch.equal(mx.mxfp8_quantize(bf.to(DEVICE))[0].cpu(), mx.mxfp8_quantize_ref(bf)[0])


def test_mxfp8_takes_the_least_scale_that_saturates_nothing_and_rounds_within_half_a_code():
    x = _activations(torch.Generator().manual_seed(1))
    codes, scales = mx.mxfp8_quantize_ref(x)
    values = codes.view(torch.float8_e4m3fn).float().reshape(37, -1, mx.GROUP)  # [N, K/G, G]
    amax = values.abs().amax(-1)
    assert (amax <= 448).all() and not values.isnan().any()
    x_amax = x.double().reshape(37, -1, mx.GROUP).abs().amax(-1)
    live = x_amax > 2.0**-100
    # half the scale would pass 448: it is the least
    assert (x_amax[live] / torch.exp2(scales.double()[live] - 127) > 224).all()
    scale = torch.exp2(scales.double() - 127).repeat_interleave(mx.GROUP, 1)
    err = (mx.mxfp8_dequantize(codes, scales).double() - x.double()).abs()
    assert (err <= NORMAL_ERROR * x.double().abs() + SUBNORMAL_QUANTUM * scale).all()
    rounded = mx.mxfp8_round(x)
    assert torch.equal(mx.mxfp8_round(rounded), rounded)  # its values round to themselves


def _case(t: int, k: int, dim: int, inter: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(t + dim)
    layout, records, offsets = slot_pool("mxfp4", dim, inter, 8, gen, absent=(3,))
    ids, weights = routing(t, k, 8, gen)
    x = (torch.randn(t, dim, generator=gen) * 3).to(dtype)
    return layout, x, ids, weights, records, offsets


@pytest.mark.parametrize(("t", "k", "dim", "inter"), [(17, 4, 64, 32), (40, 3, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_prefill_mma_matches_its_reference(dot_scaled_runs, poisoned, t, k, dim, inter, dtype):
    layout, x, ids, weights, records, offsets = _case(t, k, dim, inter, dtype)
    want = pm.moe_w4a8_ref(x.double(), ids, weights, records, offsets, layout, act_dtype=dtype)
    got = pm.moe_prefill_mma(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets)), layout)
    assert got.dtype == dtype and not got.isnan().any()
    assert _rel(got.cpu(), want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_moe_prefill_mma_over_several_tiles_and_a_full_tail(dot_scaled_runs, poisoned):
    """Small tiles: several K steps and column blocks per program; expert 1 in every token's top-k."""
    layout, x, ids, weights, records, offsets = _case(40, 3, 128, 64, torch.float32)
    ids[(ids != 1).all(1), 0] = 1
    blocks = mp.PrefillBlocks(block_m=16, tail_m=16, bn_up=16, bk_up=32, bn_down=32, bk_down=32)
    got = pm.moe_prefill_mma(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets)), layout, blocks)
    want = pm.moe_w4a8_ref(x.double(), ids, weights, records, offsets, layout, act_dtype=torch.float32)
    assert _rel(got.cpu(), want) < 1e-5


def test_the_activations_rounding_stays_within_its_bound_of_the_exact_result():
    """W4A8 against W4A16 (ref.moe_ref): x and the SwiGLU output each within 2^-4 of themselves (plus subnormals)
    keep the result within a few percent of its scale (RMS 1-3% here), never equal to it."""
    layout, x, ids, weights, records, offsets = _case(64, 4, 128, 64, torch.float64)
    exact = moe_ref(x, ids, weights, records, offsets, layout)
    w4a8 = pm.moe_w4a8_ref(x, ids, weights, records, offsets, layout)
    rms = ((w4a8 - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
    assert 1e-3 < rms < 2 * 3 * NORMAL_ERROR / math.sqrt(12)  # two roundings of uniform error <= 2^-4 each


def test_nvfp4_records_keep_the_software_path():
    layout = RecordLayout.for_expert("nvfp4", 64, 32)
    assert not pm.takes(layout) and not backend.fp4_mma("cpu", "nvfp4")
    x, ids = torch.zeros(17, 64), torch.zeros(17, 2, dtype=torch.long)
    with pytest.raises(FormatError, match="mxfp4 records"):
        pm.moe_prefill_mma(x, ids, ids.float(), torch.zeros(1, layout.nbytes, dtype=torch.uint8), ids[0], layout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's paths")
@pytest.mark.parametrize("forced", [None, False, True])
def test_the_cpu_takes_the_variants_reference_for_prefill_only_when_forced(monkeypatch, forced):
    monkeypatch.setattr(backend, "fp4_mma_forced", lambda: forced)
    layout, x, ids, weights, records, offsets = _case(40, 3, 128, 64, torch.float32)
    moe = MoEKernel(layout, 3, torch.device("cpu"))
    assert moe.mma is (forced is True)
    assert MoEKernel(RecordLayout.for_expert("nvfp4", 128, 64), 3, torch.device("cpu")).mma is False
    got = moe(x, ids, weights, records, offsets)
    exact = moe_ref(x, ids, weights, records, offsets, layout)
    if forced:
        assert torch.allclose(got, pm.moe_w4a8_ref(x, ids, weights, records, offsets, layout), atol=1e-5)
        assert _rel(got, exact) > 1e-3
        decode = moe(x[:4], ids[:4], weights[:4], records, offsets)  # decode stays exact
        assert _rel(decode, moe_ref(x[:4], ids[:4], weights[:4], records, offsets, layout)) < 1e-5
    else:
        assert _rel(got, exact) < 1e-5


@pytest.mark.gpu
# the tile plans of 16 + 16, 64 + 16 and 128 + 32 rows (prefill_blocks)
@pytest.mark.parametrize("t", [512, 2048, 4096])
def test_moe_prefill_mma_at_deepseek_v3_size(dot_scaled_runs, poisoned, t):
    """256 MXFP4 experts of V3 shape, top-8, bf16, one left out: the kernel against its reference (on an H200 Triton
    upcasts dot_scaled to bf16 MMAs: the numbers of the Blackwell path, not its speed)."""
    from tests.kernels.test_moe_prefill import _v3_pool

    gen = torch.Generator(device="cuda").manual_seed(t)
    layout, records, slots = _v3_pool("mxfp4", 256, gen)
    offsets = slots.long() * records.shape[1]
    offsets[7] = -1
    ids = torch.rand(t, 256, generator=gen, device="cuda").topk(8).indices
    weights = torch.rand(t, 8, generator=gen, device="cuda") + 0.1
    x = torch.randn(t, layout.dim, generator=gen, device="cuda").bfloat16()
    got = pm.moe_prefill_mma(x, ids, weights, records, offsets, layout)
    want = pm.moe_w4a8_ref(x.double(), ids, weights, records, offsets, layout, act_dtype=torch.bfloat16)
    assert not got.isnan().any() and _rel(got, want) < 1e-2
    assert _rel(got, moe_ref(x.double(), ids, weights, records, offsets, layout)) < 0.1
    assert torch.equal(pm.moe_prefill_mma(x, ids, weights, records, offsets, layout), got)
