"""The prefill MoE kernel against the torch references (CPU interpreter at small shapes; -m gpu at V3 size)."""

from __future__ import annotations

import math

import pytest
import torch

from dsfp4.kernels.backend import triton
from dsfp4.kernels.moe import prefill as mp
from dsfp4.kernels.moe.ref import moe_ref
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import ABSENT, record_offsets
from tests.fixtures.moe_records import routing, slot_pool

pytestmark = [
    pytest.mark.skipif(triton is None, reason="Triton is not installed"),
    # the interpreter's sigmoid overflows exp(-x) to inf for very negative gates (the result, 0, is right)
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    """Workspaces start as NaN, so a row the kernels forget to write shows in the result."""

    def nan_filled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(mp, "_workspace", nan_filled)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def _align_ref(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[list[int], list[int], int]:
    """Each expert's pairs in token order, padded with the sentinel P to whole blocks, experts in order."""
    flat = ids.flatten().tolist()
    pairs, experts = [], []
    for e in range(n_experts):
        run = [p for p, pe in enumerate(flat) if pe == e]
        n_blocks = -(-len(run) // block_m)
        pairs += run + [len(flat)] * (n_blocks * block_m - len(run))
        experts += [e] * n_blocks
    return pairs, experts, len(pairs)


@pytest.mark.parametrize(
    ("t", "k", "n_experts", "block_m"), [(17, 4, 8, 16), (40, 2, 8, 32), (3, 2, 64, 16), (9, 3, 5, 4)]
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_align_by_expert_matches_a_python_reference(t, k, n_experts, block_m, dtype):
    gen = torch.Generator().manual_seed(t * k)
    ids, _ = routing(t, k, n_experts, gen)
    ids[0, 0] = ids[-1, -1] = ids[1, 0]  # an expert with several pairs, whatever the draw
    pairs, experts, n_padded = mp.align_by_expert(ids.to(dtype).to(DEVICE), n_experts, block_m)
    want_pairs, want_experts, want_padded = _align_ref(ids, n_experts, block_m)
    n_blocks = mp.max_blocks(t * k, n_experts, block_m)
    assert pairs.shape == (n_blocks * block_m,) and experts.shape == (n_blocks,) and want_padded <= n_blocks * block_m
    assert pairs.tolist() == want_pairs + [t * k] * (n_blocks * block_m - want_padded)  # sentinel P pads
    assert experts.tolist() == want_experts + [-1] * (n_blocks - len(want_experts))
    assert n_padded.tolist() == [want_padded]


def test_block_sizes_follow_the_pairs_per_expert():
    v3 = RecordLayout.for_expert("nvfp4", 7168, 2048)
    tokens = (17, 512, 1024, 2048, 4096, 16384)
    blocks = [mp.prefill_blocks(t * 8, 256, v3) for t in tokens]
    assert [(b.block_m, b.tail_m) for b in blocks] == [(16, 16), (16, 16), (32, 16), (64, 16), (128, 32), (128, 32)]
    assert all(b.rows >= 1.25 * t * 8 / 256 for b, t in zip(blocks, tokens, strict=True) if b.block_m < 128)
    assert set(mp.TILES["nvfp4"]) == set(mp.TILES["mxfp4"]) == {16, 32, 64, 128}  # every block_m the rule picks
    narrow, wide = (32, 128, 64, 128, 3, 3), (64, 64, 128, 64)
    assert [mp.prefill_blocks(t * 8, 256, v3) for t in (512, 1024, 2048, 4096)] == [
        mp.PrefillBlocks(16, 16, *narrow),
        mp.PrefillBlocks(32, 16, *narrow),
        mp.PrefillBlocks(64, 16, *wide, 3, 3),
        mp.PrefillBlocks(128, 32, *wide, 2, 3),  # 3 gate+up stages would leave one program an SM
    ]
    v3_mx = RecordLayout.for_expert("mxfp4", 7168, 2048)
    assert mp.prefill_blocks(4096 * 8, 256, v3_mx) == mp.PrefillBlocks(128, 32, 64, 64, 128, 64, 3, 3)
    small = RecordLayout.for_expert("mxfp4", 96, 32)  # 32-element K steps: 2 stages (SAFE_BK)
    assert mp.prefill_blocks(40, 8, small) == mp.PrefillBlocks(16, 16, 32, 32, 32, 32, 2, 2)
    odd = RecordLayout.for_expert("nvfp4", 64, 48)  # BN and BK halve until they divide
    assert mp.prefill_blocks(4096, 8, odd) == mp.PrefillBlocks(128, 32, 16, 64, 64, 16, 2, 2)


def _case_pool(fmt: str, t: int, k: int, dim: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_case's records and reference offsets (device slots only)."""
    _layout, records, offsets = slot_pool(fmt, dim, inter, 8, torch.Generator().manual_seed(t + dim), absent=(3,))
    return records, offsets


def _case(fmt: str, t: int, k: int, dim: int, inter: int, dtype: torch.dtype):
    """8 experts in shuffled slots, expert 3 left out and expert 5 read from a second ("host") buffer."""
    gen = torch.Generator().manual_seed(t + dim)
    layout, records, offsets = slot_pool(fmt, dim, inter, 8, gen, absent=(3,))
    ids, weights = routing(t, k, 8, gen)
    x = (torch.randn(t, dim, generator=gen) * 3).to(dtype)
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    records = records.to(DEVICE)
    host = records[offsets[5] // layout.nbytes][None].cpu()
    host = host.pin_memory() if DEVICE == "cuda" else host
    kernel_offsets = offsets.clone()
    kernel_offsets[5] = host.data_ptr() - records.data_ptr()
    args = [x, ids, weights, records, kernel_offsets]
    return layout, [a.to(DEVICE) for a in args], want, host


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("t", "k", "dim", "inter"), [(17, 4, 64, 32), (40, 2, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_moe_prefill_matches_the_reference(poisoned, fmt, t, k, dim, inter, dtype):
    layout, args, want, _host = _case(fmt, t, k, dim, inter, dtype)
    got = mp.moe_prefill(*args, layout)
    assert got.dtype == dtype and got.shape == want.shape and not got.isnan().any()
    assert _rel(got.cpu(), want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(mp.moe_prefill(*args, layout), got)  # no atomics: the same bits every run


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_moe_prefill_clamps_its_swiglu_like_the_reference(poisoned, fmt):
    """DeepSeek-V4's swiglu_limit in the grouped kernels, on a record read from the second buffer too."""
    layout, args, _want, _host = _case(fmt, 17, 4, 64, 32, torch.float32)
    x, ids, weights = (a.cpu() for a in args[:3])
    records, offsets = _case_pool(fmt, 17, 4, 64, 32)
    want = moe_ref(x.double(), ids, weights, records, offsets, layout, limit=0.5)
    assert _rel(moe_ref(x.double(), ids, weights, records, offsets, layout), want) > 0.05  # the clamp bites
    got = mp.moe_prefill(*args, layout, limit=0.5)
    assert _rel(got.cpu(), want) < 1e-5


@pytest.mark.parametrize(
    ("fmt", "scale_bytes"), [("nvfp4", (0x01, 0x07, 0x08, 0x3F, 0x7E)), ("mxfp4", (1, 100, 127, 135))]
)
def test_moe_prefill_is_exact_at_the_ends_of_the_scale_range(poisoned, fmt, scale_bytes):
    """e4m3 scales from the subnormal 2^-9 to 448 (NVFP4's one lifted bf16 product, fp4/codes.E4M3_LIFT) and
    e8m0 scales from 2^-126 to 2^8 (MXFP4's two), on every code: fp32 activations see any rounding."""
    gen = torch.Generator().manual_seed(7)
    layout, records, offsets = slot_pool(fmt, 64, 32, 4, gen)
    for name in ("w13_scale", "w2_scale"):
        part = layout.part(name)
        cycle = torch.tensor(scale_bytes, dtype=torch.uint8).repeat(part.nbytes // len(scale_bytes) + 1)
        records[:, part.offset : part.offset + part.nbytes] = cycle[: part.nbytes]
    ids, weights = routing(17, 2, 4, gen)
    x = torch.randn(17, 64, generator=gen)
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    got = mp.moe_prefill(*(a.to(DEVICE) for a in (x, ids, weights, records, offsets)), layout)
    assert not got.isnan().any() and _rel(got.cpu(), want) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.slow
def test_prefill_kernels_match_their_references_over_several_tiles(poisoned, fmt):
    """Small tiles: several K steps and column blocks per program, many blocks of block_m + tail_m rows. Expert 1
    is in every token's top-k: a full tail, then a second block; the other experts' tails stay empty or not."""
    layout, (x, ids, weights, records, offsets), _want, _host = _case(fmt, 40, 3, 128, 64, torch.float32)
    ids = ids.clone()
    ids[(ids != 1).all(1), 0] = 1
    counts = torch.bincount(ids.flatten().cpu(), minlength=8)
    assert counts[1] == 40 and ((counts > 16) & (counts < 32)).any() and (counts <= 16).any()
    blocks = mp.PrefillBlocks(block_m=16, tail_m=16, bn_up=16, bk_up=32, bn_down=32, bk_down=32)
    pairs, block_experts, _ = mp.align_by_expert(ids, 8, blocks.rows)
    where = (pairs, block_experts, records, offsets, layout, blocks)
    act = mp.gate_up(x, weights, *where)
    ref_offsets = offsets.clone()
    ref_offsets[5] = ABSENT  # the references read device slots only: compare expert 5 end to end
    act_ref = mp.gate_up_ref(x, weights, pairs, block_experts, records, ref_offsets, layout)
    row_e = block_experts.long().repeat_interleave(blocks.rows)
    defined = (row_e >= 0) & (ref_offsets[row_e.clamp(min=0)] != ABSENT)
    assert _rel(act[defined].cpu(), act_ref[defined].cpu()) < 1e-5
    out = mp.down(act, ids.numel(), *where)
    out_ref = mp.down_ref(act, ids.numel(), pairs, block_experts, records, ref_offsets, layout)
    by_ref = ref_offsets[ids.flatten()] != ABSENT
    assert _rel(out[by_ref].cpu(), out_ref[by_ref].cpu()) < 1e-5
    assert (out[ids.flatten() == 3] == 0).all()  # the left-out expert's pairs are zeros
    got = mp.moe_prefill(x, ids, weights, records, offsets, layout, blocks)
    records_ref, offsets_ref = _case_pool(fmt, 40, 3, 128, 64)
    want = moe_ref(x.cpu().double(), ids.cpu(), weights.cpu(), records_ref, offsets_ref, layout)
    assert _rel(got.cpu(), want) < 1e-5


def _v3_pool(fmt: str, n_experts: int, gen: torch.Generator) -> tuple[RecordLayout, torch.Tensor, torch.Tensor]:
    """V3-size records of random codes made on the GPU, with block scales in a sane range (no NaN bytes) and
    separate NVFP4 global scales for gate, up and down; experts in shuffled slots of a pool with a spare."""
    layout = RecordLayout.for_expert(fmt, 7168, 2048)
    records = torch.randint(0, 256, (n_experts + 1, layout.nbytes), generator=gen, device="cuda", dtype=torch.uint8)
    for name in ("w13_scale", "w2_scale"):
        p = layout.part(name)
        n = (n_experts + 1, p.nbytes)
        if fmt == "nvfp4":  # e4m3 exponent 5..8, any mantissa: 0.25 .. 3.75
            exponent = torch.randint(5, 9, n, generator=gen, device="cuda", dtype=torch.uint8)
            scale = exponent << 3 | torch.randint(0, 8, n, generator=gen, device="cuda", dtype=torch.uint8)
        else:  # e8m0 2^-9 .. 2^-6
            scale = torch.randint(118, 122, n, generator=gen, device="cuda", dtype=torch.uint8)
        records[:, p.offset : p.offset + p.nbytes] = scale
    if fmt == "nvfp4":
        g = layout.part("scale_2")
        g_bytes = torch.tensor([3e-3, 2e-3, 4e-3], device="cuda").view(torch.uint8)
        records[:, g.offset : g.offset + g.nbytes] = g_bytes
    slots = torch.randperm(n_experts + 1, generator=gen, device="cuda")[:n_experts]
    return layout, records, slots


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [512, 4096])
def test_moe_prefill_at_deepseek_v3_size(poisoned, fmt, t):
    """256 experts of V3 shape, top-8 random routing, bf16; one expert left out, two read from pinned host memory."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    layout, records, slots = _v3_pool(fmt, 256, gen)
    offsets = record_offsets(slots, records)
    offsets[7] = ABSENT
    host_slots = torch.full_like(slots, -1)
    host_slots[[11, 200]] = torch.tensor([0, 1], device="cuda")
    host = records[slots[[11, 200]]].cpu().pin_memory()
    mixed = record_offsets(torch.where(host_slots >= 0, -1, slots), records, host_slots, host)
    mixed[7] = ABSENT
    ids = torch.rand(t, 256, generator=gen, device="cuda").topk(8).indices
    weights = torch.rand(t, 8, generator=gen, device="cuda") + 0.1
    x = torch.randn(t, layout.dim, generator=gen, device="cuda").bfloat16()
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    got = mp.moe_prefill(x, ids, weights, records, mixed, layout)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    assert _rel(got, want) < 1e-2
    assert torch.equal(mp.moe_prefill(x, ids, weights, records, mixed, layout), got)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("fmt", "bk", "stages"),
    [
        ("nvfp4", 128, 3),
        ("nvfp4", 64, 2),
        ("nvfp4", 64, 3),
        ("nvfp4", 32, 2),
        ("mxfp4", 64, 3),
        ("mxfp4", 64, 4),
        ("mxfp4", 32, 2),
    ],
)
@pytest.mark.parametrize("wide", [False, True])
def test_moe_prefill_tiles_and_pipelines_on_the_gpu(poisoned, fmt, bk, stages, wide):
    """Each K step, pipeline depth and tile width the tile rules may pick, at 64 + 16 rows a block: mean 75 rows
    an expert, so blocks with empty, partial and full tails and second blocks all occur."""
    gen = torch.Generator(device="cuda").manual_seed(bk + stages)
    layout, records, slots = _v3_pool(fmt, 16, gen)
    offsets = record_offsets(slots, records)
    ids = torch.rand(300, 16, generator=gen, device="cuda").topk(4).indices
    weights = torch.rand(300, 4, generator=gen, device="cuda") + 0.1
    x = torch.randn(300, layout.dim, generator=gen, device="cuda").bfloat16()
    bn_up, bn_down = (64, 128) if wide else (32, 64)
    blocks = mp.PrefillBlocks(64, 16, bn_up, bk, bn_down, bk, stages, stages)
    got = mp.moe_prefill(x, ids, weights, records, offsets, layout, blocks)
    assert not got.isnan().any() and _rel(got, moe_ref(x.double(), ids, weights, records, offsets, layout)) < 1e-2
