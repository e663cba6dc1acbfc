"""A streamed prefill wave as compacted calls (kernels/moe/waves.py) on every path MoEKernel takes: the old per-piece
wave's result, runs within a piece's workspace, zeros for tokens the wave has no expert of, the same bits every run,
and the variants the engine's warm-up compiles for them."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from dsfp4.kernels.backend import fp4_mma, triton
from dsfp4.kernels.cpu import moe as host_moe
from dsfp4.kernels.moe import waves
from dsfp4.kernels.moe.kernel import MoEKernel, workspace_bytes
from dsfp4.kernels.moe.prefill import prefill_blocks
from dsfp4.kernels.moe.prefill_mma import moe_w4a8_ref
from dsfp4.kernels.moe.ref import moe_ref
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import ABSENT
from tests.fixtures.moe_records import routing, slot_pool

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
N_EXPERTS, DIM, INTER = 8, 64, 32
# (triton, host, mma): the flags MoEKernel dispatches by, each path forced (Triton's on the GPU where there is one,
# else in its interpreter on the CPU)
PATHS = {
    "reference": (False, False, False),
    "cpu": (False, True, False),
    "triton": (True, False, False),
    "w4a8_reference": (False, False, True),
    "w4a8_triton": (True, False, True),
}
GPU = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _kernel(path: str, layout: RecordLayout, k: int) -> MoEKernel:
    """MoEKernel forced onto `path`, on the device its tensors take (_on)."""
    flags = PATHS[path]
    if flags[0] and triton is None:
        pytest.skip("Triton is not installed")
    if flags[1] and not host_moe.available():
        pytest.skip("no C compiler builds kernels/cpu/moe.c here")
    if flags[0] and flags[2] and GPU.type == "cuda" and not fp4_mma(GPU, layout.format):
        pytest.skip("the W4A8 kernels run on a card where backend.fp4_mma takes them (Blackwell, or forced)")
    kernel = MoEKernel(layout, k, GPU if flags[0] else torch.device("cpu"))
    kernel.triton, kernel.host, kernel.mma = flags
    return kernel


def _on(kernel: MoEKernel, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors where the kernel's path computes: Triton's on the GPU where there is one."""
    device = GPU if kernel.triton else torch.device("cpu")
    return [t.to(device) for t in tensors]


def _wave(t: int, k: int, present: int, seed: int, dtype: torch.dtype, fmt: str = "mxfp4"):
    """(layout, x [T, D], ids [T, K], weights [T, K], records, the wave's offsets [E]: `present` experts in it)."""
    gen = torch.Generator().manual_seed(seed)
    layout, records, offsets = slot_pool(fmt, DIM, INTER, N_EXPERTS, gen)
    ids, weights = routing(t, k, N_EXPERTS, gen)
    x = (torch.randn(t, DIM, generator=gen) * 3).to(dtype)
    left_out = torch.randperm(N_EXPERTS, generator=gen)[present:]
    offsets[left_out] = ABSENT
    return layout, x, ids, weights, records, offsets


def _old(kernel: MoEKernel, x, ids, weights, records, offsets, piece: int) -> torch.Tensor:
    """The wave as MoE._streamed ran it: the kernel over the tokens `piece` at a time, with all their ids (a short last
    piece on the prefill path too, as the CPU takes it), on the CPU."""
    x, ids, weights, records, offsets = _on(kernel, x, ids, weights, records, offsets)
    parts = [slice(a, a + piece) for a in range(0, x.shape[0], piece)]
    return torch.cat([kernel.prefill(x[s], ids[s], weights[s], records, offsets) for s in parts]).cpu()


def _present(ids: torch.Tensor, offsets: torch.Tensor) -> waves.WavePairs | None:
    """present_pairs of the experts with an offset (as the store's list of a wave's experts gives them)."""
    experts, n = (offsets != ABSENT).nonzero()[:, 0].tolist(), offsets.numel()
    return waves.present_pairs(waves.StepChoices.of(ids.cpu().numpy(), n), waves.in_wave(experts, n))


def _compacted(kernel: MoEKernel, x, ids, weights, records, offsets, piece: int | None) -> torch.Tensor:
    """add_wave from zeros, on the CPU."""
    x, ids, weights, records, offsets = _on(kernel, x, ids, weights, records, offsets)
    pairs = _present(ids, offsets)
    assert pairs is not None and waves.compacts(x.shape[0], piece)
    runs = waves.wave_runs(kernel, pairs, min(x.shape[0], piece or x.shape[0]), x.dtype)
    return waves.add_wave(kernel, x, ids, weights, records, offsets, pairs, runs, None).cpu()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("t", "k", "present", "piece"), [(17, 1, 1, None), (40, 2, 3, 20), (70, 3, 6, 17)])
def test_a_compacted_wave_gives_the_old_waves_sum_in_fp32(path, t, k, present, piece):
    layout, x, ids, weights, records, offsets = _wave(t, k, present, t + k, torch.float32)
    kernel = _kernel(path, layout, k)
    got = _compacted(kernel, x, ids, weights, records, offsets, piece)
    want = _old(kernel, x, ids, weights, records, offsets, piece or t)
    assert got.dtype == torch.float32 and got.shape == (t, DIM) and not got.isnan().any()
    # the same products, summed in another order in fp32
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("t", "k", "present"), [(33, 2, 2), (64, 4, 5)])
def test_a_compacted_wave_in_bf16_is_the_formula_within_its_rounding(path, t, k, present):
    """bf16 x against moe_ref of the wave in float64 (the W4A8 paths against their reference with their MXFP8
    roundings), as close as the old wave is."""
    layout, x, ids, weights, records, offsets = _wave(t, k, present, t * k, torch.bfloat16)
    kernel = _kernel(path, layout, k)
    got = _compacted(kernel, x, ids, weights, records, offsets, 20)
    old = _old(kernel, x, ids, weights, records, offsets, 20)
    args = (ids, weights, records, offsets, layout)
    want = moe_ref(x.double(), *args)
    # W4A8 rounds x and the SwiGLU output to MXFP8, a code of which is a few % of a row: against the roundings of
    # its own SwiGLU (the kernel's from fp32 products, the CPU's reference from bf16 ones)
    if kernel.mma:
        want = moe_w4a8_ref(x.double(), *args, act_dtype=x.dtype) if kernel.triton else moe_w4a8_ref(x, *args)
    assert _rel(got, want) < 1e-2 and _rel(old, want) < 1e-2
    assert _rel(got.bfloat16(), old) < 1e-2


@pytest.mark.parametrize("path", ["reference", "cpu", "triton"])
def test_tokens_with_no_expert_in_the_wave_get_zeros_and_a_call_gives_the_same_bits_twice(path):
    layout, x, ids, weights, records, offsets = _wave(48, 2, 3, 5, torch.bfloat16)
    kernel = _kernel(path, layout, 2)
    none = (offsets[ids] == ABSENT).all(1)
    assert none.any() and not none.all()
    got = _compacted(kernel, x, ids, weights, records, offsets, 24)
    assert (got[none] == 0).all() and (got[~none] != 0).any(1).all()
    assert torch.equal(_compacted(kernel, x, ids, weights, records, offsets, 24), got)


def test_a_wave_adds_to_the_waves_before_it_and_every_pair_present_takes_the_chunks_own_calls():
    layout, x, ids, weights, records, offsets = _wave(40, 2, 4, 9, torch.float32)
    kernel = _kernel("reference", layout, 2)
    before = torch.randn(40, DIM)
    pairs = _present(ids, offsets)
    runs = waves.wave_runs(kernel, pairs, 20, x.dtype)
    got = waves.add_wave(kernel, x, ids, weights, records, offsets, pairs, runs, before.clone())
    assert _rel(got, before + _old(kernel, x, ids, weights, records, offsets, 20)) < 1e-5
    assert _present(ids, torch.arange(N_EXPERTS) * layout.nbytes) is None
    # a wave of no chosen expert (the CPU lane took them all) adds nothing
    none = torch.full_like(offsets, ABSENT)
    empty = _present(ids, none)
    assert (
        empty.pairs.size == 0
        and sum(empty.counts) == 0
        and torch.equal(waves.add_wave(kernel, x, ids, weights, records, none, empty, [], got), got)
    )
    assert not waves.compacts(40, 16) and not waves.compacts(16, None) and waves.compacts(17, None)


def test_the_runs_go_by_expert_within_a_pieces_pairs_and_workspace_and_sum_as_one(monkeypatch):
    """Runs cut short (a bound that shrinks with the experts a run spans) give the one-run result, each call over the
    experts its pairs belong to, renumbered from 0, within the bound."""
    layout, x, ids, weights, records, offsets = _wave(60, 3, 5, 3, torch.float32)
    kernel = _kernel("cpu", layout, 3)
    whole = _compacted(kernel, x, ids, weights, records, offsets, 20)
    calls = []
    real = kernel.prefill

    def prefill(xw, local, chosen, records, wave_offsets):
        calls.append((xw.shape[0], wave_offsets.numel()))
        assert local.shape == chosen.shape == (xw.shape[0], 1)
        # every expert of the call has pairs in it
        assert torch.equal(local.flatten().unique(), torch.arange(wave_offsets.numel()))
        return real(xw, local, chosen, records, wave_offsets)

    monkeypatch.setattr(kernel, "prefill", prefill)
    monkeypatch.setattr(waves, "run_pairs", lambda *a: 14 - 3 * a[4])
    cut = _compacted(kernel, x, ids, weights, records, offsets, 20)
    pairs = _present(ids, offsets).pairs.size
    assert sum(c[0] for c in calls) == pairs and all(r <= max(1, 14 - 3 * s) for r, s in calls)
    assert any(s > 1 for _, s in calls) and len(calls) > 5
    assert _rel(cut, whole) < 1e-6
    monkeypatch.undo()
    bound = waves.run_pairs(layout, 3, N_EXPERTS, 20, 5, torch.float32, False)
    assert bound <= 20 * 3
    assert workspace_bytes(layout, 1, 5, bound, torch.float32) <= workspace_bytes(
        layout, 3, N_EXPERTS, 20, torch.float32
    )


def _scanned(layout: RecordLayout, k: int, e: int, piece: int, s: int, mma: bool) -> int:
    """run_pairs by scanning every count: the last before the first that passes the piece's workspace."""
    budget = workspace_bytes(layout, k, e, piece, torch.bfloat16, mma)
    for r in range(1, piece * k + 1):
        if workspace_bytes(layout, 1, s, max(r, waves.MAX_TOKENS + 1), torch.bfloat16, mma) > budget:
            return r - 1
    return piece * k


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_run_pairs_is_the_scanned_limit_and_deepseek_v3s_runs_keep_most_of_a_chunks_pairs(fmt):
    v3 = RecordLayout.for_expert(fmt, 7168, 2048)
    for mma in (False, True):
        for s in (1, 17, 50, 66, 151, 256):
            assert waves.run_pairs(v3, 8, 256, 512, s, torch.bfloat16, mma) == _scanned(v3, 8, 256, 512, s, mma)
        runs = [waves.run_pairs(v3, 8, 256, 512, s, torch.bfloat16, mma) for s in range(1, 257)]
        # the docstring's figures
        assert min(runs) >= 1894 and max(runs) <= 2749
    small = RecordLayout.for_expert(fmt, DIM, INTER)
    for piece, s in ((17, 1), (20, 5), (40, 8)):
        assert waves.run_pairs(small, 3, N_EXPERTS, piece, s, torch.bfloat16, False) == _scanned(
            small, 3, N_EXPERTS, piece, s, False
        )


def _key(layout: RecordLayout, p: int, s: int) -> tuple:
    return prefill_blocks(p, s, layout), p % waves.SPECIALIZED_DIVISOR == 0, p == 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_warm_ups_sizes_cover_every_compacted_call_of_deepseek_v3(fmt):
    """Every (pairs, experts) of a 512-token chunk's runs takes the variant of one of wave_sizes' calls over one
    expert: all of them up to 200 pairs and 64 experts, and a draw of 20,000 beyond."""
    v3 = RecordLayout.for_expert(fmt, 7168, 2048)
    sizes = waves.wave_sizes(512 * 8, waves.wave_variant(v3))
    keys = {_key(v3, p, 1) for p in sizes}
    assert len(keys) == len(sizes) and sizes == sorted(sizes) and sizes[0] == 1
    # the four tile sizes, each with a multiple of 16 and another count (and 1 at the smallest)
    assert len(sizes) == 9 and max(sizes) < 100
    draw = random.Random(0)
    cases = [(p, s) for p in range(1, 201) for s in range(1, 65)]
    cases += [(draw.randint(1, 4096), draw.randint(1, 256)) for _ in range(20_000)]
    assert {_key(v3, p, s) for p, s in cases} <= keys


def test_the_warm_up_calls_the_prefill_path_once_per_size_where_triton_runs(monkeypatch):
    layout = RecordLayout.for_expert("nvfp4", DIM, INTER)
    records = torch.zeros(1, layout.nbytes, dtype=torch.uint8)
    kernel = MoEKernel(layout, 2, torch.device("cpu"))
    kernel.triton = kernel.host = False
    assert waves.warm_up_waves(kernel, torch.bfloat16, records, 20) == 0
    calls = []
    kernel.triton = True
    monkeypatch.setattr(kernel, "prefill", lambda x, ids, w, r, o: calls.append((x.shape[0], ids.shape, o.tolist())))
    n = waves.warm_up_waves(kernel, torch.bfloat16, records, 20)
    sizes = waves.wave_sizes(40, waves.wave_variant(layout))
    assert n == len(calls) == len(sizes) and [c[0] for c in calls] == sizes
    assert all(c[1] == (c[0], 1) and c[2] == [ABSENT] for c in calls)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_wave_of_most_experts_gives_each_its_groups_rows_and_few_pairs_keep_the_pieces_calls(fmt):
    v3 = MoEKernel(RecordLayout.for_expert(fmt, 7168, 2048), 8, torch.device("cpu"))

    def wave(present: int, pairs: int) -> waves.WavePairs:  # `pairs` pairs over `present` of 256 experts
        counts = [pairs // present + (e < pairs % present) if e < present else 0 for e in range(256)]
        return waves.WavePairs(np.zeros(pairs, dtype=np.int64), np.zeros(pairs, dtype=np.int64), counts)

    # a group of 11,776 tokens routes ~368 pairs to an expert: runs of ~2,000-2,700 pairs by expert hold ~7 of them,
    # most whole, whether the wave holds 17 experts or 151 (a chunk's calls: 16 rows an expert)
    for present in (17, 151, 256):
        rows, compacted = waves.call_rows(
            v3.layout, 8, 256, 512, present, 11776 * 8 * present / 256, torch.bfloat16, False
        )
        assert compacted and 250 < rows <= 368
        w = wave(present, 11776 * 8 * present // 256)
        assert waves.gains(v3, w, waves.wave_runs(v3, w, 512, torch.bfloat16), 512)
    # few pairs over many experts: fewer rows than a chunk's
    assert waves.call_rows(v3.layout, 8, 256, 512, 151, 200, torch.bfloat16, False) == (16.0, False)
    assert not waves.gains(v3, wave(151, 200), waves.wave_runs(v3, wave(151, 200), 512, torch.bfloat16), 512)


def _check_runs(counts: list[int], cap, runs: list[tuple[int, int, int, int]]) -> None:
    """runs are expert_runs(counts, cap): consecutive, covering every pair, each spanning the experts its pairs
    belong to and within cap of them (or one pair), each full where the next could have added to it."""
    starts = [0, *itertools.accumulate(counts)]  # the first pair of each expert, and the end
    assert runs[0][0] == 0 and runs[-1][1] == starts[-1]
    for (a, b, first, end), nxt in zip(runs, [*runs[1:], None], strict=True):
        assert a < b and (nxt is None or nxt[0] == b)
        assert starts[first] <= a < starts[first + 1] and starts[end - 1] < b <= starts[end]
        assert b - a <= max(cap(end - first), 1)
        if nxt is not None and nxt[2] == end - 1:
            # an expert cut across runs: its first run was full
            assert b - a >= cap(end - first)


def test_expert_runs_cover_the_pairs_by_expert_within_the_cap_of_the_experts_they_span():
    draw = random.Random(7)
    caps = [lambda s: 7, lambda s: max(1, 12 - 2 * s), lambda s: 0, lambda s: 1000]
    for _ in range(400):
        counts = [draw.randint(1, 20) for _ in range(draw.randint(1, 12))]
        for cap in caps:
            _check_runs(counts, cap, waves.expert_runs(counts, cap))
    # a run filled by the next expert's first pairs, and one run where it holds them all
    assert waves.expert_runs([3, 4], lambda s: 4) == [(0, 4, 0, 2), (4, 7, 1, 2)]
    assert waves.expert_runs([3, 4], lambda s: 9) == [(0, 7, 0, 2)]
    assert waves.expert_runs([5], lambda s: 2) == [(0, 2, 0, 1), (2, 4, 0, 1), (4, 5, 0, 1)]


def test_a_waves_present_pairs_are_its_experts_pairs_by_expert_with_their_places_and_counts():
    layout, x, ids, weights, records, offsets = _wave(50, 3, 4, 11, torch.float32)
    wave = _present(ids, offsets)
    present = (offsets[ids] != ABSENT).flatten()
    kept = present.nonzero()[:, 0]  # token-then-slot order
    chosen = ids.flatten()[kept]
    # by expert, token order within one
    assert wave.pairs.tolist() == kept[torch.sort(chosen, stable=True).indices].tolist()
    assert wave.counts == torch.bincount(chosen, minlength=N_EXPERTS).tolist()
    assert all(c == 0 for e, c in enumerate(wave.counts) if offsets[e] == ABSENT)
    # a pair's place: the present pairs of its token before it
    flat = present.view(50, 3)
    for p, place in zip(wave.pairs.tolist(), wave.place.tolist(), strict=True):
        t, j = divmod(p, 3)
        assert place == int(flat[t, :j].sum())
