"""The decode MoE kernel against the torch reference (CPU interpreter at small shapes; -m gpu at V3 size)."""

from __future__ import annotations

import pytest
import torch
from moe_records import random_expert, routing, slot_pool

from dsfp4.kernels.fp4_decode import triton
from dsfp4.kernels.moe_decode import DecodeConfig, DecodeMoE
from dsfp4.kernels.moe_ref import moe_ref, record_offsets
from dsfp4.layout.record import RecordLayout

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 3, 16])
def test_decode_kernel_matches_the_reference(fmt, t):
    gen = torch.Generator().manual_seed(t)
    n_experts, k = 6, 3
    layout, records, offsets = slot_pool(fmt, 64, 64, n_experts, gen, absent=(4,))
    ids, weights = routing(t, k, n_experts, gen)
    x = torch.randn(t, layout.dim, generator=gen) * 3
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    kernel = DecodeMoE(layout, k, DEVICE, DecodeConfig(bn1=16, bk1=64, bn2=32, bk2=32))
    args = [a.to(DEVICE) for a in (x, ids, weights, records, offsets)]
    kernel.act.fill_(float("nan"))  # poisoned workspaces: every row read must have been written
    kernel.out.fill_(float("nan"))
    got = kernel(*args).cpu()
    assert not got.isnan().any() and _rel(got, want) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_decode_kernel_clamps_its_swiglu_like_the_reference(fmt):
    """DeepSeek-V4's swiglu_limit: gate clamped above, up to +-limit; a limit the values cross."""
    gen = torch.Generator().manual_seed(11)
    layout, records, offsets = slot_pool(fmt, 64, 64, 6, gen)
    ids, weights = routing(3, 2, 6, gen)
    x = torch.randn(3, layout.dim, generator=gen) * 3
    want = moe_ref(x.double(), ids, weights, records, offsets, layout, limit=0.5)
    assert _rel(moe_ref(x.double(), ids, weights, records, offsets, layout), want) > 0.05  # the clamp bites
    kernel = DecodeMoE(layout, 2, DEVICE, DecodeConfig(bn1=16, bk1=64, bn2=32, bk2=32), limit=0.5)
    got = kernel(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets))).cpu()
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("scale", [3.0, 5000.0])
def test_decode_kernel_in_fp16_products_for_bf16_x_matches_the_reference(fmt, t, scale):
    """bf16 x takes gate+up's fp16 products on the code words: x scaled per token by a power of two, so an
    x far past fp16's range (5000 * N(0, 1): products of 6 * 5000 summed) neither overflows nor loses
    precision; runs of tokens sharing an expert (t = 16 of 6 experts) included."""
    gen = torch.Generator().manual_seed(t)
    n_experts, k = 6, 3
    layout, records, offsets = slot_pool(fmt, 64, 64, n_experts, gen, absent=(4,))
    ids, weights = routing(t, k, n_experts, gen)
    x = (torch.randn(t, layout.dim, generator=gen) * scale).bfloat16()
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    kernel = DecodeMoE(layout, k, DEVICE, DecodeConfig(bn1=16, bk1=64, bn2=32, bk2=32))
    assert kernel.words
    args = [a.to(DEVICE) for a in (x, ids, weights, records, offsets)]
    kernel.act.fill_(float("nan"))
    kernel.out.fill_(float("nan"))
    got = kernel(*args).float().cpu()
    assert not got.isnan().any() and not got.isinf().any() and _rel(got, want) < 1e-2


def test_decode_kernel_writes_bf16_and_reads_a_padded_row_stride():
    gen = torch.Generator().manual_seed(7)
    layout, records, offsets = slot_pool("nvfp4", 64, 32, 4, gen)
    ids, weights = routing(2, 2, 4, gen)
    wide = torch.randn(2, 80, generator=gen)  # rows with a stride larger than the dim
    x = wide[:, :64]
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    kernel = DecodeMoE(layout, 2, DEVICE, DecodeConfig(bn1=16, bk1=32, bn2=16, bk2=32))
    got = kernel(*(a.to(DEVICE) for a in (x.bfloat16(), ids, weights, records, offsets)))
    assert got.dtype == torch.bfloat16 and _rel(got.float().cpu(), want) < 1e-2


def test_record_offsets_point_at_device_slots_then_host_slots():
    records = torch.zeros(3, 4096, dtype=torch.uint8)
    host = torch.zeros(2, 4096, dtype=torch.uint8)
    slots = torch.tensor([2, -1, -1, 0])
    host_slots = torch.tensor([1, 0, -1, 1])
    off = record_offsets(slots, records, host_slots, host).tolist()
    delta = host.data_ptr() - records.data_ptr()
    assert off == [2 * 4096, delta, -1, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_decode_kernel_at_deepseek_v3_size(fmt, t):
    """V3 expert shape, 8 of 256 experts, records on the device and (zero-copy) in pinned host memory."""
    gen = torch.Generator().manual_seed(0)
    layout = RecordLayout.for_expert(fmt, 7168, 2048)
    distinct = [torch.frombuffer(bytearray(random_expert(layout, gen)), dtype=torch.uint8) for _ in range(4)]
    records = torch.stack(distinct).repeat(64, 1).cuda()  # 256 slots, 4 distinct records
    slots = torch.randperm(256, generator=gen).cuda()
    offsets = record_offsets(slots, records)
    ids, weights = routing(t, 8, 256, gen)
    x = torch.randn(t, layout.dim, generator=gen).bfloat16()
    args = [x.cuda(), ids.cuda(), weights.cuda(), records, offsets]
    want = moe_ref(args[0].double(), *args[1:], layout)  # float64 on the GPU: the CPU takes minutes
    kernel = DecodeMoE(layout, 8, torch.device("cuda"))
    for _ in range(2):
        got = kernel(*args)
        assert not got.isnan().any() and _rel(got, want) < 1e-2
    host = records.cpu().pin_memory()
    from_host = record_offsets(torch.full_like(slots, -1), records, slots, host)
    got = kernel(*args[:4], from_host)
    assert _rel(got, want) < 1e-2
