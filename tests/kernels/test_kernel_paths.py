"""The one rule as each card would be seen: the kernels' paths, the note or refusal `run` and `doctor` give, what
use_kernels and the FP8 path pick, and what the planner reserves for a whole DeepSeek-V3 on a 24 GB card."""

from __future__ import annotations

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels import backend
from dsfp4.kernels import kernel_paths as kernel_paths_module
from dsfp4.kernels.backend import FP8Path
from dsfp4.kernels.kernel_paths import (
    EXPERTS_PART,
    FP4_MMA_PATH,
    FP8_PART,
    FP8_PATHS,
    REFERENCE_PATH,
    Gpu,
    kernel_paths,
    paths_for,
)
from tests.fixtures.cards import CARDS, OTHER_CARDS

# card -> (Triton kernels run, the FP8 path, a word of the note: "" at speed)
EXPECTED = {
    "A100": (True, FP8Path.BY_BITS, ""),
    "RTX 3090": (True, FP8Path.BY_BITS, ""),
    "RTX 4090": (True, FP8Path.NATIVE, ""),
    "RTX 5090": (True, FP8Path.NATIVE, ""),
    "H100": (True, FP8Path.NATIVE, ""),
    "RTX 2080 Ti": (False, FP8Path.REFERENCE, "need sm_80"),
    "MI300X": (False, FP8Path.REFERENCE, "ROCm"),
}
ALL_CARDS = {**CARDS, **OTHER_CARDS}


@pytest.fixture
def seen_as(monkeypatch):
    """Make this machine's cuda:0 look like a card (its properties, ROCm or not) to the rule."""

    def see(name: str) -> torch.device:
        p = ALL_CARDS[name]
        for module in (backend, kernel_paths_module):
            monkeypatch.setattr(module, "cuda_props", lambda index: p)
            monkeypatch.setattr(module, "fp8_by_bits_forced", lambda: False)
            monkeypatch.setattr(module, "fp4_mma_forced", lambda: None)
        monkeypatch.setattr(torch.version, "hip", "6.2" if name == "MI300X" else None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        backend._kernels_on.cache_clear()
        return torch.device("cuda", 0)

    yield see
    backend._kernels_on.cache_clear()


@pytest.mark.skipif(backend.triton is None, reason="the rule's kernels need Triton installed")
@pytest.mark.parametrize("name", EXPECTED)
def test_each_card_gets_its_paths_from_the_one_rule(seen_as, name):
    kernels, fp8, word = EXPECTED[name]
    device = seen_as(name)
    assert backend.use_kernels(device) is kernels
    assert backend.fp8_path(device) is fp8
    assert backend.has_fp8_kernels(device) is (fp8 is not FP8Path.REFERENCE)
    paths = kernel_paths(device)
    assert (paths.kernels, paths.fp8_kernels) == (kernels, fp8 is not FP8Path.REFERENCE)
    assert paths.parts[FP8_PART] == FP8_PATHS[fp8]
    assert (word in paths.word) if word else paths.word == ""
    assert not paths.refused
    if not kernels:
        assert "torch reference" in paths.word and set(paths.parts.values()) >= {REFERENCE_PATH}
    assert paths.capability == (ALL_CARDS[name].major, ALL_CARDS[name].minor)
    assert paths.smem == ALL_CARDS[name].shared_memory_per_block_optin


@pytest.mark.skipif(backend.triton is None, reason="the rule's kernels need Triton installed")
@pytest.mark.parametrize("name", EXPECTED)
def test_only_blackwell_takes_the_fp4_tensor_core_prefill_by_default(seen_as, name):
    device = seen_as(name)
    blackwell = name == "RTX 5090"
    assert backend.fp4_mma(device, "mxfp4") is blackwell
    assert backend.fp4_mma(device, "nvfp4") is False  # NVFP4 records keep the software path
    assert (kernel_paths(device).parts[EXPERTS_PART] == FP4_MMA_PATH) is blackwell
    assert "unmeasured" in FP4_MMA_PATH


@pytest.mark.parametrize("forced", [True, False])
def test_forcing_the_fp4_tensor_cores_reaches_every_card_from_sm_89_and_off_turns_blackwell_off(forced):
    for name, p in ALL_CARDS.items():
        gpu = Gpu(name, (p.major, p.minor), p.shared_memory_per_block_optin, p.multi_processor_count, name == "MI300X")
        takes = forced and EXPECTED[name][1] is FP8Path.NATIVE  # kernels run and e4m3 converts in hardware
        assert (paths_for(gpu, fp4_mma=forced).parts[EXPERTS_PART] == FP4_MMA_PATH) is takes
        assert backend.fp4_mma_for((p.major, p.minor), forced, name == "MI300X") is takes
    assert backend.fp4_mma_for((10, 0)) and backend.fp4_mma_for((12, 1)) and not backend.fp4_mma_for((9, 0))


def test_forcing_by_bits_changes_only_the_cards_that_convert_e4m3_in_hardware():
    for name, p in ALL_CARDS.items():
        gpu = Gpu(name, (p.major, p.minor), p.shared_memory_per_block_optin, p.multi_processor_count, name == "MI300X")
        natively, forced = paths_for(gpu).parts[FP8_PART], paths_for(gpu, forced_by_bits=True).parts[FP8_PART]
        want = FP8_PATHS[FP8Path.BY_BITS] if EXPECTED[name][1] is FP8Path.NATIVE else natively
        assert forced == want


def test_no_triton_runs_every_part_by_reference_with_a_note():
    paths = paths_for(Gpu("RTX 4090", (8, 9), 101376, 128), has_triton=False)
    assert not paths.kernels and not paths.fp8_kernels and not paths.refused
    assert "Triton is not installed" in paths.word and "pip install triton" in paths.word


def test_a_card_this_torch_has_no_kernels_for_is_refused_before_anything_loads():
    archs = ("sm_75", "sm_80", "sm_86", "sm_90", "compute_90")
    old = Gpu("NVIDIA GeForce GTX 1080", (6, 1), 49152, 20, torch_archs=archs)
    paths = paths_for(old)
    assert paths.refused and "sm_61" in paths.word and "sm_75, sm_80" in paths.word
    with pytest.raises(ConfigError, match="install a torch build"):
        paths.check()
    # a cubin of the major version serves later minors; PTX serves every later card
    assert not paths_for(Gpu("RTX 3090", (8, 6), 101376, 82, torch_archs=("sm_80",))).refused
    assert not paths_for(Gpu("RTX 5090", (12, 0), 101376, 170, torch_archs=("sm_90", "compute_90"))).refused
    assert paths_for(Gpu("RTX 5090", (12, 0), 101376, 170, torch_archs=("sm_90",))).refused


def test_the_cpu_runs_the_references_without_a_word():
    paths = kernel_paths(torch.device("cpu"))
    assert not paths.kernels and paths.word == "" and not paths.refused


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA plans for a user's card")
def test_a_cuda_device_planned_for_on_a_machine_without_one_is_a_card_that_runs_the_kernels():
    paths = kernel_paths(torch.device("cuda"))
    assert paths.kernels and paths.fp8_kernels and not paths.refused and paths.word == ""


@pytest.mark.parametrize("name", ["RTX 3090", "RTX 2080 Ti"])
def test_the_planner_reserves_for_each_cards_paths(name):
    """A whole DeepSeek-V3 on 24 GB: the 3090's by-bits FP8 reserves what the 4090's native path does (no dense
    fp32 copy of the largest FP8 matrix: the reserve that cost 51 of 160 device slots); an sm_75 card, whose every
    matrix takes the reference, reserves more and holds fewer slots."""
    from dsfp4.projection.machines import MACHINES, USER_PROCESS
    from dsfp4.projection.planned import planned_manifest
    from dsfp4.projection.whole_model import IO_THREADS, MAX_CONTEXT, PREFILL_CHUNK, full_args
    from dsfp4.runtime.plan.planner import make_plan

    m = planned_manifest(full_args("v3"), "fp8", "nvfp4")

    def plan(card: str):
        p = ALL_CARDS[card]
        paths = paths_for(Gpu(card, (p.major, p.minor), p.shared_memory_per_block_optin, p.multi_processor_count))
        b = MACHINES["24g"].budgets
        return make_plan(
            m,
            torch.device("cuda"),
            torch.bfloat16,
            b,
            MAX_CONTEXT,
            PREFILL_CHUNK,
            IO_THREADS,
            process=USER_PROCESS,
            fp8_kernels=paths.fp8_kernels,
            kernels=paths.kernels,
        )

    fast, this = plan("RTX 4090"), plan(name)
    if EXPECTED[name][0]:
        assert (this.workspace, this.gpu_slots) == (fast.workspace, fast.gpu_slots)
    else:
        assert this.workspace > fast.workspace and this.gpu_slots < fast.gpu_slots


@pytest.mark.skipif(backend.triton is None, reason="the rule's kernels need Triton installed")
@pytest.mark.parametrize("name", ["RTX 3090", "RTX 4090"])
def test_the_workspace_holds_the_widened_pieces_only_where_the_fp8_path_is_by_bits(seen_as, name):
    """A prefill chunk on the 3090 widens W a piece at a time (kernels/fp8/widened_gemm.py): its workspace holds
    the largest piece; a decode step's tokens and the 4090's native path hold none."""
    from dsfp4.kernels.fp8.widened_gemm import WIDEN_GEMM_TOKENS, WIDEN_PIECE_BYTES
    from dsfp4.projection.planned import planned_manifest
    from dsfp4.projection.whole_model import full_args
    from dsfp4.runtime.plan.workspace import widened_gemm_bytes

    m, cuda = planned_manifest(full_args("v3"), "fp8", "nvfp4"), seen_as(name)
    chunk = widened_gemm_bytes(m, cuda, torch.bfloat16, WIDEN_GEMM_TOKENS, fp8_kernels=True)
    if EXPECTED[name][1] is FP8Path.BY_BITS:
        assert WIDEN_PIECE_BYTES // 2 < chunk < 2 * WIDEN_PIECE_BYTES
    else:
        assert chunk == 0
    assert widened_gemm_bytes(m, cuda, torch.bfloat16, WIDEN_GEMM_TOKENS - 1, fp8_kernels=True) == 0
    assert widened_gemm_bytes(m, cuda, torch.float32, WIDEN_GEMM_TOKENS, fp8_kernels=True) == 0
