"""The FP8 kernels as GPUs without a CUDA device here would build them: the by-bits kernels compile for sm_80 and
sm_86 (no e4m3 instruction, no fp8 type), the native ones do not; the tile rules of the prefill GEMM and of the MoE
prefill kernel, evaluated for an A100, an RTX 3090, 4090, 5090 and an H100, fit each card's shared memory, by the
rules' count and by what Triton allots the compiled kernels."""

from __future__ import annotations

import dataclasses

import pytest

from dsfp4.kernels.backend import card_of, triton
from dsfp4.kernels.fp8 import gemm as fg
from dsfp4.kernels.moe import prefill as mp
from dsfp4.layout.fp8 import FP8_BLOCK
from dsfp4.layout.record import RecordLayout
from tests.fixtures.cards import CARDS, props
from tests.kernels.ptx_targets import Build, shared_bytes

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")


# (tokens, rows) of V3's prefill: a chunk through q_b, through the dense w2; a short prompt through kv_a
GEMM_CASES = [(4096, 24576), (512, 7168), (17, 576)]
GEMM = "dsfp4.kernels.fp8.gemm"


def _paths(card) -> list[bool]:
    """by_bits values the card can run: the native W8A8 from sm_89, by bits from sm_80 (forced there on later cards)."""
    return [False, True] if card.capability >= (8, 9) else [True]


@pytest.mark.parametrize("name", CARDS)
def test_gemm_plans_fit_each_card(name):
    c = card_of(CARDS[name])
    for t, n in GEMM_CASES:
        for by_bits in _paths(c):
            p = fg.gemm_plan(t, n, c, by_bits, 2)
            assert fg.gemm_smem(p.block_m, p.num_stages, by_bits, 2, c.capability) <= c.smem, (name, t, n, by_bits)
            assert p.num_stages >= fg.GEMM_MIN_STAGES
    # the large tile once the tiles fill the SMs, the small one below
    assert fg.gemm_plan(4096, 24576, c).block_m == 128 and fg.gemm_plan(17, 576, c).block_m == 64


def test_a_small_shared_memory_takes_fewer_stages_then_the_small_tile():
    tight = card_of(props(8, 6, 82, 60000))  # a 3-stage 128-row by-bits tile needs 96 KiB on sm_86
    p = fg.gemm_plan(4096, 24576, tight, by_bits=True)
    assert (p.block_m, p.num_stages) == (128, 2)
    tighter = card_of(props(8, 6, 82, 40000))
    p = fg.gemm_plan(4096, 24576, tighter, by_bits=True)
    assert p.block_m == 64 and fg.gemm_smem(64, p.num_stages, True, 2, (8, 6)) <= 40000


def _gemm_args(by_bits: bool, p: fg.GemmPlan, dtype: str) -> dict:
    tiles = dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, SCALE_BLOCK=FP8_BLOCK, GROUP_M=fg.GEMM_GROUP_M)
    ints = dict(T="i32", N="i32", K="i32", stride_yt="i32", stride_sbn="i32", stride_bn="i32")
    if by_bits:
        ptrs = dict(x_ptr=f"*{dtype}", b_ptr="*u8", sb_ptr="*fp32", y_ptr=f"*{dtype}")
        return {**ptrs, **ints, "stride_xt": "i32", **tiles, "WIDE": False}
    ptrs = dict(a_ptr="*fp8e4nv", sa_ptr="*fp32", b_ptr="*fp8e4nv", sb_ptr="*fp32", y_ptr=f"*{dtype}")
    return {**ptrs, **ints, "stride_at": "i32", "stride_sat": "i32", **tiles}


@pytest.mark.slow
def test_gemm_shared_memory_as_triton_allots_it():
    """The rule's count against the compiled kernel's shared memory on each card's architecture (within 1 KiB of
    scratch), and within what the card gives a program."""
    cases = []
    for name, card_props in CARDS.items():
        c = card_of(card_props)
        for t, n in GEMM_CASES[:2]:
            for by_bits in _paths(c):
                p = fg.gemm_plan(t, n, c, by_bits, 2)
                kernel = "fp8_gemm_bits_kernel" if by_bits else "fp8_gemm_kernel"
                args = _gemm_args(by_bits, p, "bf16")
                cases.append(
                    (name, c, p, by_bits, Build(f"{GEMM}:{kernel}", c.capability, args, p.num_warps, p.num_stages))
                )
    for (name, c, p, by_bits, _), shared in zip(cases, shared_bytes([b for *_, b in cases]), strict=True):
        assert isinstance(shared, int), (name, by_bits, shared)
        counted = fg.gemm_smem(p.block_m, p.num_stages, by_bits, 2, c.capability)
        assert shared <= c.smem and abs(shared - counted) <= 1024, (name, p, by_bits, shared, counted)


# ---- the by-bits kernels build where no e4m3 instruction is -------------------------------------------------

FP8 = "dsfp4.kernels.fp8"
GEMV_PTRS = dict(q_ptr="*u8", s_ptr="*fp32", out_ptr="*fp32")
GEMV_INTS = dict(N="i32", K="i32", stride_xt="i32", stride_qn="i32", stride_sn="i32", stride_ot="i32")
GEMV_INTS |= dict(stride_os="i32", k_split="i32")


def _pieces(capability, t: int, f16x2: bool, by_bits: bool, x: str = "*bf16") -> Build:
    tiles = dict(T=t, BLOCK_N=8, BLOCK_K=1024, SCALE_BLOCK=FP8_BLOCK, F16X2=f16x2, USE_ASM=True, BY_BITS=by_bits)
    ptrs = GEMV_PTRS | ({} if by_bits else {"q_ptr": "*fp8e4nv"})
    return Build(f"{FP8}.gemv:fp8_gemv_pieces_kernel", capability, dict(x_ptr=x, **ptrs, **GEMV_INTS, **tiles))


def _by_bits_builds(capability) -> list[Build]:
    mma = dict(T="i32", BLOCK_T=16, BLOCK_N=64, SCALE_BLOCK=FP8_BLOCK, WIDE=False, BY_BITS=True)
    legacy = dict(T="i32", BLOCK_T=16, BLOCK_N=16, BLOCK_K=512, SCALE_BLOCK=FP8_BLOCK, BY_BITS=True)
    dequant = dict(q_ptr="*u8", s_ptr="*fp32", w_ptr="*bf16", N="i32", K="i32", stride_q="i32", stride_s="i32")
    dequant |= dict(stride_w="i32", SCALE_BLOCK=FP8_BLOCK, BN=32, BK=128, HW_E4M3=False)
    p = fg.gemm_plan(4096, 7168)
    return [
        _pieces(capability, 1, True, True),
        _pieces(capability, 16, True, True, "*fp16"),
        _pieces(capability, 4, False, True),
        Build(f"{FP8}.gemv_mma:fp8_gemv_mma_kernel", capability, dict(x_ptr="*bf16", **GEMV_PTRS, **GEMV_INTS, **mma)),
        Build(f"{FP8}.linear:fp8_gemv_kernel", capability, dict(x_ptr="*fp32", **GEMV_PTRS, **GEMV_INTS, **legacy)),
        Build(f"{GEMM}:fp8_gemm_bits_kernel", capability, _gemm_args(True, p, "fp16"), p.num_warps, p.num_stages),
        Build(f"{FP8}.dequant:_dequant_kernel", capability, dequant),
    ]


@pytest.mark.slow
def test_by_bits_kernels_build_for_ampere_and_the_native_ones_do_not():
    """ptxas takes every by-bits kernel for sm_80 and sm_86; the native piece kernel's cvt.rn.f16x2.e4m3x2 wants
    sm_89, where it builds."""
    builds = _by_bits_builds((8, 0)) + _by_bits_builds((8, 6))
    native = [_pieces((8, 6), 1, True, False), _pieces((8, 9), 1, True, False)]
    *by_bits, on_86, on_89 = shared_bytes(builds + native)
    for b, shared in zip(builds, by_bits, strict=True):
        assert isinstance(shared, int), (b.kernel, b.capability, shared)
    assert isinstance(on_86, str) and isinstance(on_89, int)


# ---- the MoE prefill kernel's stages ------------------------------------------------------------------------


def _moe_steps(fmt: str, block_m: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((stages, step bytes) of gate_up, of down) that TILES give V3's experts (7168 x 2048) at block_m."""
    bn_up, bk_up, bn_down, bk_down, st_up, st_down = mp.TILES[fmt][block_m]
    group, rows = (16 if fmt == "nvfp4" else 32), block_m + mp.tail_rows(block_m)
    return (st_up, mp.stage_bytes(rows, 2 * bn_up, bk_up, group)), (
        st_down,
        mp.stage_bytes(rows, bn_down, bk_down, group),
    )


@pytest.mark.parametrize("name", CARDS)
def test_moe_prefill_tiles_fit_each_card(name):
    smem = card_of(CARDS[name]).smem
    for fmt, tiles in mp.TILES.items():
        for block_m in tiles:
            for stages, step in _moe_steps(fmt, block_m):
                assert mp.fit_stages(stages, step, smem) == stages and stages * step <= smem, (fmt, block_m)


def test_moe_prefill_takes_fewer_stages_where_shared_memory_is_short():
    v3 = RecordLayout.for_expert("nvfp4", 7168, 2048)
    wide = mp.prefill_blocks(4096 * 8, 256, v3)
    short = mp.prefill_blocks(4096 * 8, 256, v3, smem=48 * 1024)
    assert (short.stages_up, short.stages_down) == (2, 2) < (wide.stages_up, wide.stages_down)
    assert dataclasses.replace(short, stages_up=wide.stages_up, stages_down=wide.stages_down) == wide


def _moe_builds(fmt: str, block_m: int, capability) -> list[Build]:
    bn_up, bk_up, bn_down, bk_down, st_up, st_down = mp.TILES[fmt][block_m]
    nv = fmt == "nvfp4"
    common = dict(G=16 if nv else -1, GROUP=16 if nv else 32, E8M0=not nv, BM=block_m, BT=mp.tail_rows(block_m))
    common |= dict(HW_E4M3=capability >= (8, 9), USE_ASM=True, DOT="tl.bfloat16", PRECISION="tf32")
    common |= dict(EMULATE_RNE=False, UNBIAS=1.0, experts_ptr="*i32", rec_ptr="*u8", off_ptr="*i64")
    common |= dict(pairs_ptr="*i32", n_pairs="i32", D=7168, INTER=2048)
    up = dict(x_ptr="*bf16", rw_ptr="*fp32", act_ptr="*bf16", TOP_K=8, W13=0, S13=1 << 20, BN=bn_up, BK=bk_up)
    down = dict(act_ptr="*bf16", out_ptr="*bf16", W2=0, S2=1 << 20, BN=bn_down, BK=bk_down)
    jit = "dsfp4.kernels.moe.prefill_jit"
    return [
        Build(f"{jit}:gate_up_kernel", capability, dict(**up, **common, LIMIT=0.0), mp.NUM_WARPS, st_up),
        Build(f"{jit}:down_kernel", capability, dict(**down, **common), mp.NUM_WARPS, st_down),
    ]


@pytest.mark.slow
def test_moe_prefill_shared_memory_as_triton_allots_it():
    """Compiled for sm_86 (by bits) and sm_90, every TILES entry takes at most the rule's count, within a 100 KB
    card's shared memory."""
    cases = [(fmt, m, cap) for fmt in mp.TILES for m in mp.TILES[fmt] for cap in ((8, 6), (9, 0))]
    builds = [b for fmt, m, cap in cases for b in _moe_builds(fmt, m, cap)]
    shared = shared_bytes(builds)
    for i, (fmt, m, _) in enumerate(cases):
        for (stages, step), got in zip(_moe_steps(fmt, m), shared[2 * i : 2 * i + 2], strict=True):
            assert isinstance(got, int) and got <= stages * step <= CARDS["RTX 3090"].shared_memory_per_block_optin
