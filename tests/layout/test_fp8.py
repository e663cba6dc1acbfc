"""FP8 128x128 block format: dequantization with ragged edges, quantization round trip, bad scales."""

import pytest
import torch

from dsfp4.errors import FormatError
from dsfp4.layout import fp8
from dsfp4.layout.formats import FORMATS, component_shapes, stored_nbytes


def _random_fp8(n, k, gen):
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(*fp8.scale_grid((n, k)), generator=gen) + 0.01
    return q, s


def test_dequantize_ragged_576_rows_matches_elementwise_definition():
    gen = torch.Generator().manual_seed(0)
    q, s = _random_fp8(576, 7168, gen)
    assert tuple(s.shape) == (5, 56)
    w = fp8.fp8_block_dequantize(q, s, dtype=torch.float32)
    rows = torch.arange(576) // 128
    cols = torch.arange(7168) // 128
    assert torch.equal(w, q.float() * s[rows][:, cols])


def test_dequantize_ragged_both_axes_to_bf16():
    gen = torch.Generator().manual_seed(1)
    q, s = _random_fp8(200, 300, gen)
    assert tuple(s.shape) == (2, 3)
    w = fp8.fp8_block_dequantize(q, s)
    assert w.dtype == torch.bfloat16
    ref = (q.float() * s[torch.arange(200) // 128][:, torch.arange(300) // 128]).to(torch.bfloat16)
    assert torch.equal(w, ref)


def test_scale_grid_mismatch_names_the_tensor():
    q, _ = _random_fp8(576, 256, torch.Generator().manual_seed(2))
    with pytest.raises(FormatError, match=r"kv_a.*\[4, 2\].*expected \[5, 2\]"):
        fp8.fp8_block_dequantize(q, torch.ones(4, 2), name="kv_a")


def test_quantize_dequantize_round_trip_exact_on_representable_weights():
    gen = torch.Generator().manual_seed(3)
    q, _ = _random_fp8(200, 300, gen)
    q[0, 0] = 448.0  # every block needs its amax at 448 for the scale to come back unchanged
    q[0, 128] = 448.0
    q[0, 256] = -448.0
    q[128, 0] = 448.0
    q[128, 128] = 448.0
    q[128, 256] = 448.0
    s = torch.tensor([[0.5, 2.0**-7, 4.0], [1.0, 2.0**-3, 8.0]])
    w = fp8.fp8_block_dequantize(q, s, dtype=torch.float32)
    q2, s2 = fp8.fp8_block_quantize(w)
    assert torch.equal(s2, s)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_quantize_zero_blocks_and_error_bound():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(4))
    w[:128, :128] = 0
    q, s = fp8.fp8_block_quantize(w)
    assert s[0, 0].item() == 1.0
    deq = fp8.fp8_block_dequantize(q, s, dtype=torch.float32)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4, plus the subnormal step near zero
    step = s[torch.arange(300) // 128][:, torch.arange(260) // 128]
    assert torch.all((w - deq).abs() <= w.abs() * 2**-4 + step * 2**-10)


def test_descriptor_table_sizes():
    assert component_shapes(FORMATS["fp8_e4m3_b128"], (576, 7168)) == [(576, 7168), (5, 56)]
    assert component_shapes(FORMATS["nvfp4"], (2048, 7168)) == [(2048, 3584), (2048, 448), ()]
    assert component_shapes(FORMATS["mxfp4"], (2048, 7168)) == [(2048, 3584), (2048, 224)]
    # checkpoint-spec b.4: one V3 expert is 3 x 7,340,032 packed + 3 x 917,504 scales + fp32 scalars
    expert = [(2048, 7168), (2048, 7168), (7168, 2048)]
    assert sum(stored_nbytes(FORMATS["nvfp4"], s) for s in expert) == 24_772_620
    assert sum(stored_nbytes(FORMATS["mxfp4"], s) for s in expert) == 23_396_352
