"""FP4 formats: e2m1 codes, packing, NVFP4 and MXFP4 round trips, edge cases and error bounds."""

import pytest
import torch

from dsfp4.errors import FormatError
from dsfp4.layout import fp4
from dsfp4.layout.quant import dequantize, quantize


def test_all_16_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    values = fp4.e2m1_decode(codes)
    assert values.tolist()[:8] == list(fp4.E2M1_MAGNITUDES)
    assert torch.equal(torch.signbit(values[8:]), torch.ones(8, dtype=torch.bool))  # code 8 is -0
    assert torch.equal(fp4.e2m1_encode(values), codes)


def test_rounding_is_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, 7.0, 1e9, -0.75, -1e9, -0.1])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 6.0, 6.0, 6.0, -1.0, -6.0, -0.0]
    got = fp4.e2m1_decode(fp4.e2m1_encode(x))
    assert got.tolist() == want
    assert bool(torch.signbit(got[-1]))  # a small negative rounds to -0, keeping its sign


def test_pack_unpack_identity_and_nibble_order():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(fp4.pack_fp4(fp4.unpack_fp4(every_byte)), every_byte)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fp4.unpack_fp4(fp4.pack_fp4(codes)), codes)
    assert fp4.pack_fp4(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21  # even element low


def _grid_nvfp4(n, k, gen):
    """A weight exactly representable in NVFP4: random codes with a +-6 in every block, e4m3 block
    scales whose maximum is 448 and a power-of-two global scale."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    codes[:, ::16] = torch.where(torch.rand(n, k // 16, generator=gen) < 0.5, 7, 15).to(torch.uint8)
    scale = (torch.rand(n, k // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
    scale[0, 0] = 448.0
    g = torch.tensor(2.0**-10)
    return fp4.pack_fp4(codes), scale, g


def test_nvfp4_exact_round_trip_of_representable_weights():
    gen = torch.Generator().manual_seed(1)
    packed, scale, g = _grid_nvfp4(32, 128, gen)
    w = fp4.nvfp4_dequantize(packed, scale, g)
    p2, s2, g2 = fp4.nvfp4_quantize(w)
    assert g2.item() == g.item()
    assert torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(p2, packed)


def _nvfp4_block_bound(w, scale, g):
    """Largest error any element of a block may have: half the widest e2m1 step (1.0) times the block
    scale, or the clipping of a block whose e4m3 scale rounded down."""
    blocks = w.reshape(w.shape[0], -1, 16)
    s = scale.float() * g
    clip = (blocks.abs().amax(-1) - 6 * s).clamp(min=0)
    return torch.maximum(s, clip)[..., None].expand_as(blocks).reshape(w.shape)


@pytest.mark.parametrize("case", ["gaussian", "one_huge", "subnormal_scales", "heavy_tail"])
def test_nvfp4_error_bound_per_element(case):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=gen)
    if case == "one_huge":
        w[3, 17] = 1e6
    elif case == "subnormal_scales":
        # block magnitudes spread over 10 decades: many e4m3 block scales land in the subnormal range
        w = w * torch.logspace(0, -10, 16).repeat_interleave(16)[None, :]
    elif case == "heavy_tail":
        w = torch.distributions.StudentT(2.0).sample((64, 256))
    packed, scale, g = fp4.nvfp4_quantize(w, "w")
    deq = fp4.nvfp4_dequantize(packed, scale, g)
    assert torch.all((w - deq).abs() <= _nvfp4_block_bound(w, scale, g) * (1 + 1e-6))
    if case == "one_huge":
        assert deq[3, 17].item() == pytest.approx(1e6, rel=1e-6)
    if case == "subnormal_scales":
        nonzero = w.reshape(64, -1, 16).abs().amax(-1) > 0
        assert bool((scale.float()[nonzero] > 0).all())  # an underflowed scale is kept at 2^-9


def test_nvfp4_zero_blocks_negative_zero_and_zero_tensor():
    w = torch.randn(4, 64)
    w[1, 16:32] = 0.0
    packed, scale, g = fp4.nvfp4_quantize(w)
    assert scale.float()[1, 1].item() == 1.0
    assert torch.equal(fp4.nvfp4_dequantize(packed, scale, g)[1, 16:32], torch.zeros(16))
    neg = torch.full((2, 32), -0.0)
    p, s, g0 = fp4.nvfp4_quantize(neg)
    assert g0.item() == 1.0 and torch.equal(fp4.unpack_fp4(p), torch.full((2, 32), 8, dtype=torch.uint8))
    assert bool(torch.signbit(fp4.nvfp4_dequantize(p, s, g0)).all())


def test_nvfp4_shared_amax_ties_global_scale():
    gate, up = torch.randn(16, 64), 3 * torch.randn(16, 64)
    amax = torch.maximum(gate.abs().max(), up.abs().max())
    assert fp4.nvfp4_quantize(gate, amax=amax)[2].item() == fp4.nvfp4_quantize(up)[2].item()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_e4m3_b128"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_rejected_naming_the_tensor(fmt, bad):
    w = torch.randn(16, 64)
    w[2, 5] = bad
    with pytest.raises(FormatError, match="layers.3.ffn.experts.7.w1"):
        quantize(fmt, w, "layers.3.ffn.experts.7.w1")


def test_bad_shapes_are_rejected():
    with pytest.raises(FormatError, match="multiple of the fp4 block size 16"):
        fp4.nvfp4_quantize(torch.randn(4, 40), "x")
    with pytest.raises(FormatError, match="multiple of the fp4 block size 32"):
        fp4.mxfp4_quantize(torch.randn(4, 48), "x")
    with pytest.raises(FormatError, match="2-D"):
        fp4.nvfp4_quantize(torch.randn(64), "x")


def test_mxfp4_exact_round_trip_and_no_clipping():
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8, 128), dtype=torch.uint8, generator=gen)
    codes[:, ::32] = 7
    exps = torch.randint(100, 150, (8, 4), generator=gen).to(torch.uint8)
    exps[0, 0] = 0  # 2^-127: an fp32 subnormal scale still decodes exactly
    codes[0, :32] = 0
    codes[0, 0] = 7
    w = fp4.mxfp4_dequantize(fp4.pack_fp4(codes), exps)
    p2, e2 = fp4.mxfp4_quantize(w)
    assert torch.equal(e2, exps) and torch.equal(fp4.unpack_fp4(p2), codes)
    x = torch.randn(32, 256, generator=gen) * 1e3
    p, e = fp4.mxfp4_quantize(x)
    scale = torch.ldexp(torch.ones(e.shape), e.to(torch.int32) - 127).repeat_interleave(32, 1)
    assert torch.all((x - fp4.mxfp4_dequantize(p, e)).abs() <= scale)  # half of the widest step (2)


def test_mxfp4_zero_block_and_nan_scale():
    p, e = fp4.mxfp4_quantize(torch.zeros(2, 32))
    assert e.tolist() == [[127], [127]]
    with pytest.raises(FormatError, match="e8m0 scale byte 255"):
        fp4.mxfp4_dequantize(p, torch.full((2, 1), 255, dtype=torch.uint8), name="x")


# Relative RMS error ||W - Q(W)|| / ||W|| on N(0, 1) weights, [256, 4096]. Measured on this
# implementation: nvfp4 0.0952, mxfp4 0.1155, fp8_e4m3_b128 0.0265 (seed 0). The bounds leave ~5%.
GAUSSIAN_BOUNDS = {"nvfp4": (0.090, 0.100), "mxfp4": (0.110, 0.121), "fp8_e4m3_b128": (0.025, 0.028)}


@pytest.mark.parametrize("fmt", sorted(GAUSSIAN_BOUNDS))
def test_gaussian_quantization_error_in_expected_range(fmt):
    w = torch.randn(256, 4096, generator=torch.Generator().manual_seed(0))
    err = ((w - dequantize(fmt, quantize(fmt, w, "w"))).norm() / w.norm()).item()
    lo, hi = GAUSSIAN_BOUNDS[fmt]
    assert lo < err < hi, err
