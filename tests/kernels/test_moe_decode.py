"""The decode MoE kernel against the torch reference (CPU interpreter at small shapes; -m gpu at V3 size)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.moe.decode import DecodeConfig, DecodeMoE, combine_ref, workspace_bytes
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.kernels.moe.ref import moe_ref
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import record_offsets
from tests.fixtures.moe_records import random_expert, routing, slot_pool

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32 = DecodeConfig(bn1=16, bk1=64, bn2=32, bk2=32, words1=False, words2=False)
WORDS = {  # fp16 products on the code words in gate+up, down or both (bf16 and fp16 x)
    "gate_up": DecodeConfig(bn1=16, bk1=64, bn2=32, bk2=32, words2=False),
    "down": DecodeConfig(bn1=16, bk1=64, bn2=16, bk2=64, num_warps2=2, words1=False, words2=True),
    "both": DecodeConfig(bn1=16, bk1=64, bn2=32, bk2=2048, num_warps2=4, words2=True),  # down: whole rows (fit)
}  # each gives a thread two code words per chunk at 64 x 64 (words_sums' pairs; fewer take fp32 products)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _poisoned(kernel: DecodeMoE) -> DecodeMoE:
    """Every workspace NaN: each row read must have been written in the same call."""
    for w in (kernel.xq, kernel.inv, kernel.act, kernel.act_q, kernel.act_inv, kernel.out):
        w.fill_(float("nan"))
    kernel.plan.fill_(-1)  # a stale plan row leads no run: its pairs' rows stay NaN
    return kernel


def _absent_picked(ids: torch.Tensor, expert: int) -> torch.Tensor:
    """ids with token 0 choosing `expert` (still distinct per token)."""
    if expert not in ids[0]:
        ids[0, 0] = expert
    return ids


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.slow
def test_decode_kernel_matches_the_reference(fmt, t):
    gen = torch.Generator().manual_seed(t)
    n_experts, k = 6, 3
    layout, records, offsets = slot_pool(fmt, 64, 64, n_experts, gen, absent=(4,))
    ids, weights = routing(t, k, n_experts, gen)
    x = torch.randn(t, layout.dim, generator=gen) * 3
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    kernel = _poisoned(DecodeMoE(layout, k, DEVICE, FP32))
    got = kernel(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets))).cpu()
    assert not got.isnan().any() and _rel(got, want) < 1e-5


def test_fp32_x_keeps_fp32_products_whatever_the_config():
    """The exact runs: a config asking for the words changes no bit of an fp32 x's result."""
    gen = torch.Generator().manual_seed(5)
    layout, records, offsets = slot_pool("nvfp4", 64, 64, 6, gen, absent=(4,))
    ids, weights = routing(3, 3, 6, gen)
    args = [a.to(DEVICE) for a in (torch.randn(3, layout.dim, generator=gen), ids, weights, records, offsets)]
    plain = DecodeMoE(layout, 3, DEVICE, dataclasses.replace(WORDS["both"], words1=False, words2=False))(*args)
    assert torch.equal(_poisoned(DecodeMoE(layout, 3, DEVICE, WORDS["both"]))(*args), plain)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_decode_kernel_clamps_its_swiglu_like_the_reference(fmt, dtype):
    """DeepSeek-V4's swiglu_limit: gate clamped above, up to +-limit; a limit the values cross (bf16 x: on
    the words in both launches)."""
    gen = torch.Generator().manual_seed(11)
    layout, records, offsets = slot_pool(fmt, 64, 64, 6, gen)
    ids, weights = routing(3, 2, 6, gen)
    x = (torch.randn(3, layout.dim, generator=gen) * 3).to(dtype)
    want = moe_ref(x.double(), ids, weights, records, offsets, layout, limit=0.5)
    assert _rel(moe_ref(x.double(), ids, weights, records, offsets, layout), want) > 0.05  # the clamp bites
    config = FP32 if dtype == torch.float32 else WORDS["both"]
    kernel = _poisoned(DecodeMoE(layout, 2, DEVICE, config, limit=0.5))
    got = kernel(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets))).float().cpu()
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(
    ("words", "t", "scale"),
    [("both", t, scale) for t in (1, 3) for scale in (3.0, 5000.0)]
    + [(words, t, 5000.0) for words, t in (("both", 16), ("gate_up", 1), ("gate_up", 3), ("down", 1), ("down", 3))],
)
@pytest.mark.slow
def test_decode_kernel_in_fp16_products_for_bf16_x_matches_the_reference(fmt, words, t, scale):
    """bf16 x takes fp16 products on the code words: x (for down, each pair's activation) scaled by a power
    of two, so an x far past fp16's range (5000 * N(0, 1): products of 6 * 5000 summed) neither overflows
    nor loses precision. Token 0 picks the absent expert; runs of tokens sharing an expert (t = 3 and 16 of
    6 experts) included; at t = 1 every pair is its own run."""
    gen = torch.Generator().manual_seed(t)
    n_experts, k = 6, 3
    layout, records, offsets = slot_pool(fmt, 64, 64, n_experts, gen, absent=(4,))
    ids, weights = routing(t, k, n_experts, gen)
    ids = _absent_picked(ids, 4)
    assert t == 1 or len(set(ids.flatten().tolist())) < ids.numel()  # shared runs
    x = (torch.randn(t, layout.dim, generator=gen) * scale).bfloat16()
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    kernel = _poisoned(DecodeMoE(layout, k, DEVICE, WORDS[words]))
    assert kernel.words and (kernel.words1[kernel.config.gate_up(t)], kernel.words2) == (
        words != "down",
        words != "gate_up",
    )
    got = kernel(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets))).float().cpu()
    assert not got.isnan().any() and not got.isinf().any() and _rel(got, want) < 1e-2


def test_decode_config_fits_a_small_layout_and_workspace_bytes_counts_the_workspaces():
    layout = RecordLayout.for_expert("mxfp4", 64, 32)
    fitted = dict(bn1=16, bk1=64, bn2=32, bk2=32, num_warps2=4, bn3=64, bn1_wide=16, bk1_wide=64)
    assert WORDS["both"].fit(layout) == DecodeConfig(**fitted)
    assert WORDS["both"].gate_up(1) == (16, 64) and DecodeConfig(bn1=8).fit(layout).gate_up(3) == (16, 64)
    small = DecodeMoE(layout, 3, "cpu", DecodeConfig(bn1=8, bk1=64, bn2=8, bk2=32))  # 64 and 32 words a chunk
    # fewer than two words per thread (the narrow gate+up tile, down): fp32 products; the wide tile has 128
    assert small.words and small.words1 == {(8, 64): False, (16, 64): True} and not small.words2
    kernel = DecodeMoE(layout, 3, "cpu")
    held = {w.data_ptr(): w.numel() * w.element_size() for w in vars(kernel).values() if torch.is_tensor(w)}
    assert workspace_bytes(layout, 3) == sum(held.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t", [1, 3, 5])
@pytest.mark.parametrize("with_add", [False, True])
def test_combine_matches_its_reference_bit_for_bit(dtype, t, with_add):
    """The final launch alone: pair rows over many magnitudes (slot order and each rounding matter) and some
    exact bf16 ties (to even, as torch and the GPU round; the interpreter's own cast truncates); the rows past
    T * K NaN, never read. Two column blocks per token."""
    gen = torch.Generator().manual_seed(t)
    layout, k = RecordLayout.for_expert("nvfp4", 64, 32), 4
    kernel = _poisoned(DecodeMoE(layout, k, DEVICE, DecodeConfig(bn3=32)))
    scale = 2.0 ** torch.randint(-20, 8, (t * k, layout.dim), generator=gen)
    rows = torch.randn(t * k, layout.dim, generator=gen) * scale  # [T * K, D]
    ties = 1 + 2.0**-8 * torch.arange(1, 16, 2)  # halfway between bf16 neighbours, odd and even below
    rows.view(t, k, -1)[:, 0, : ties.numel()], rows.view(t, k, -1)[:, 1:, : ties.numel()] = ties, 0.0
    kernel.out[: t * k] = rows.to(DEVICE)
    add = (torch.randn(t, layout.dim, generator=gen) * 1000).to(dtype).to(DEVICE) if with_add else None
    got = kernel.combine(t, dtype, add)
    want = combine_ref(kernel.out, t, k, dtype, add)
    assert got.dtype == dtype and not got.isnan().any() and torch.equal(got, want)


@pytest.mark.parametrize(("t", "dtype"), [(1, torch.bfloat16), (3, torch.float32), (5, torch.bfloat16)])
@pytest.mark.slow
def test_decode_kernel_adds_the_addend_after_rounding(t, dtype):
    """add= (the shared experts' output) gives exactly torch's y + add on the kernel's own y, on poisoned
    workspaces, and the routed sum still matches the reference."""
    gen = torch.Generator().manual_seed(20 + t)
    n_experts, k = 6, 3
    layout, records, offsets = slot_pool("nvfp4", 64, 64, n_experts, gen, absent=(4,))
    ids, weights = routing(t, k, n_experts, gen)
    x = (torch.randn(t, layout.dim, generator=gen) * 3).to(dtype)
    add = (torch.randn(t, layout.dim, generator=gen) * 30).to(dtype)
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    config = FP32 if dtype == torch.float32 else WORDS["both"]
    args = [a.to(DEVICE) for a in (x, ids, weights, records, offsets)]
    plain = _poisoned(DecodeMoE(layout, k, DEVICE, config))(*args)
    got = _poisoned(DecodeMoE(layout, k, DEVICE, config))(*args, add=add.to(DEVICE))
    assert got.dtype == dtype and not got.isnan().any() and torch.equal(got, plain + add.to(DEVICE))
    assert _rel(plain.float().cpu(), want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("t", [3, 20])
def test_moe_kernel_adds_the_addend_on_every_path(t):
    """MoEKernel's add= is y + add on each path: on the CPU the reference's (both token counts), on CUDA the decode
    kernel's (3 tokens) and the prefill kernels' (20)."""
    gen = torch.Generator().manual_seed(t)
    layout, records, offsets = slot_pool("mxfp4", 64, 64, 6, gen)
    ids, weights = routing(t, 2, 6, gen)
    x, add = (torch.randn(t, layout.dim, generator=gen).bfloat16().to(DEVICE) for _ in range(2))
    kernel = MoEKernel(layout, 2, torch.device(DEVICE))
    args = [x, *(a.to(DEVICE) for a in (ids, weights, records, offsets))]
    assert torch.equal(kernel(*args, add=add), kernel(*args) + add)


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


def _v3_case(fmt: str, t: int, gen: torch.Generator):
    """V3 expert shape, 8 of 256 experts (4 distinct records in shuffled device slots): (layout, slots, args
    [x bf16, ids, weights, records, offsets] on the GPU)."""
    layout = RecordLayout.for_expert(fmt, 7168, 2048)
    distinct = [torch.frombuffer(bytearray(random_expert(layout, gen)), dtype=torch.uint8) for _ in range(4)]
    records = torch.stack(distinct).repeat(64, 1).cuda()  # 256 slots, 4 distinct records
    slots = torch.randperm(256, generator=gen).cuda()
    ids, weights = routing(t, 8, 256, gen)
    x = torch.randn(t, layout.dim, generator=gen).bfloat16()
    return layout, slots, [x.cuda(), ids.cuda(), weights.cuda(), records, record_offsets(slots, records)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("config", [DecodeConfig(), DecodeConfig(bn1=16, bk1=256, bn2=16, bk2=256, words2=False)])
def test_decode_kernel_at_deepseek_v3_size(fmt, t, config):
    """V3 expert shape, 8 of 256 experts, records on the device and (zero-copy) in pinned host memory; down
    on the words (the default) or in fp32 products (the earlier default)."""
    gen = torch.Generator().manual_seed(0)
    layout, slots, args = _v3_case(fmt, t, gen)
    records = args[3]
    want = moe_ref(args[0].double(), *args[1:], layout)  # float64 on the GPU: the CPU takes minutes
    kernel = DecodeMoE(layout, 8, torch.device("cuda"), config)
    for _ in range(2):
        got = kernel(*args)
        assert not got.isnan().any() and _rel(got, want) < 1e-2
    host = records.cpu().pin_memory()
    from_host = record_offsets(torch.full_like(slots, -1), records, slots, host)
    got = kernel(*args[:4], from_host)
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5])
def test_decode_kernel_with_an_addend_replays_in_a_cuda_graph_at_v3_size(t):
    """add= at V3 size (7168 columns, top-8): captured with its output allocation, replayed on new x and add,
    bit for bit the eager call's y + add and combine_ref's sum of the pair rows."""
    gen = torch.Generator().manual_seed(t)
    layout, _, args = _v3_case("nvfp4", t, gen)
    add = torch.randn(t, layout.dim, generator=gen).bfloat16().cuda()  # the shared experts' output
    kernel = _poisoned(DecodeMoE(layout, 8, torch.device("cuda")))
    kernel(*args, add=add)  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernel(*args, add=add)
    args[0].copy_(torch.randn(t, layout.dim, generator=gen).bfloat16())
    add.copy_(torch.randn(t, layout.dim, generator=gen).bfloat16())
    graph.replay()
    assert torch.equal(y, combine_ref(kernel.out, t, 8, torch.bfloat16, add))
    assert torch.equal(y, kernel(*args) + add)
    want = moe_ref(args[0].double(), *args[1:], layout) + add.double()
    assert not y.isnan().any() and _rel(y, want) < 1e-2


@pytest.mark.parametrize("t", [2, 3, 5])
@pytest.mark.slow
def test_narrow_and_wide_gate_up_tiles_both_match_the_reference(t):
    """Below wide_from tokens gate+up takes the narrow tile, from it on the wide one: two different launches."""
    gen = torch.Generator().manual_seed(40 + t)
    layout, records, offsets = slot_pool("nvfp4", 64, 64, 6, gen, absent=(2,))
    ids, weights = routing(t, 3, 6, gen)
    x = torch.randn(t, layout.dim, generator=gen) * 3
    config = dataclasses.replace(FP32, bn1=4, bk1=32, bn1_wide=16, bk1_wide=64, wide_from=3)
    assert config.gate_up(2) == (4, 32) and config.gate_up(3) == (16, 64)
    got = _poisoned(DecodeMoE(layout, 3, DEVICE, config))(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets)))
    assert _rel(got.cpu(), moe_ref(x.double(), ids, weights, records, offsets, layout)) < 1e-5
