"""The FP8 kernels by bits (the BY_BITS path of kernels/backend.py: sm_80/86, or forced by DSFP4_FP8_BY_BITS=1)
against fp8_linear_ref under TRITON_INTERPRET, the rule that picks a path for each GPU, and (-m gpu) a tiny model's
greedy tokens with the path forced on whatever CUDA card runs the suite."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsfp4.kernels import backend
from dsfp4.kernels.backend import FP8_BY_BITS_ENV, FP8Path, fp8_path, fp8_path_for, triton
from dsfp4.kernels.fp8 import gemm as fg
from dsfp4.kernels.fp8 import linear as f8
from dsfp4.kernels.fp8 import widened_gemm as wg
from dsfp4.kernels.fp8.dequant import fp8_dequantize, fp8_dequantize_ref
from dsfp4.kernels.linear import QuantizedWeight
from dsfp4.layout.fp8 import fp8_block_quantize

# poisoned: torch.empty hands out NaNs, so an output a kernel leaves unwritten shows up
from tests.kernels.test_fp8_linear import TOL, _ref, _rel, _tol, _weight, _x, poisoned  # noqa: F401

pytestmark = [pytest.mark.skipif(triton is None, reason="Triton is not installed"), pytest.mark.usefixtures("poisoned")]


@pytest.fixture
def forced(monkeypatch):
    """DSFP4_FP8_BY_BITS=1 as a process would start with it (the backend reads it once)."""
    monkeypatch.setenv(FP8_BY_BITS_ENV, "1")
    backend.fp8_by_bits_forced.cache_clear()
    yield
    monkeypatch.delenv(FP8_BY_BITS_ENV)
    backend.fp8_by_bits_forced.cache_clear()


# ---- the rule ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "path", "forced_path"),
    [
        ((7, 5), FP8Path.REFERENCE, FP8Path.REFERENCE),  # Turing: no bf16 tensor cores
        ((8, 0), FP8Path.BY_BITS, FP8Path.BY_BITS),  # A100
        ((8, 6), FP8Path.BY_BITS, FP8Path.BY_BITS),  # RTX 3090
        ((8, 9), FP8Path.NATIVE, FP8Path.BY_BITS),  # RTX 4090
        ((9, 0), FP8Path.NATIVE, FP8Path.BY_BITS),  # H100, H200
        ((12, 0), FP8Path.NATIVE, FP8Path.BY_BITS),  # RTX 5090
    ],
)
def test_each_capability_takes_its_path(capability, path, forced_path):
    assert fp8_path_for(capability) is path
    assert fp8_path_for(capability, forced=True) is forced_path
    assert fp8_path_for(capability, hip=True) is FP8Path.REFERENCE  # ROCm reports CUDA-like numbers


@pytest.mark.parametrize(
    ("capability", "hw", "kernels"), [((7, 5), False, False), ((8, 6), False, True), ((9, 0), True, True)]
)
def test_a_cuda_device_follows_the_rule(monkeypatch, capability, hw, kernels):
    """What the kernels' flags, the planner's fp8_kernels and QuantizedWeight read, for a faked CUDA device."""
    props = SimpleNamespace(major=capability[0], minor=capability[1])
    monkeypatch.setattr(backend, "cuda_props", lambda index: props)
    monkeypatch.setattr(backend, "interpreted", lambda: False)
    cuda = torch.device("cuda", 0)
    assert backend.hw_e4m3(cuda) is hw and backend.has_fp8_kernels(cuda) is kernels
    assert fp8_path(cuda) is fp8_path_for(capability)


def test_the_environment_forces_the_path_once_read(forced):
    assert fp8_path("cpu") is FP8Path.BY_BITS  # the interpreter stands in for a GPU
    assert backend.has_fp8_kernels("cpu") and not backend.hw_e4m3("cpu")


def test_without_the_interpreter_the_cpu_takes_the_reference(monkeypatch):
    monkeypatch.setattr(backend, "interpreted", lambda: False)
    assert fp8_path("cpu") is FP8Path.REFERENCE and not backend.has_fp8_kernels("cpu")


# ---- the kernels, under the interpreter -------------------------------------------------------------------

# ragged N and K blocks (200 rows: 128 + 72; 257 columns: two blocks and one column)
GEMV_SHAPES = [(1, 200, 96), (3, 130, 200), (8, 72, 264), (16, 64, 257)]


@pytest.mark.parametrize("math", ["f16x2", "f32", "legacy", "mma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "n", "k"), GEMV_SHAPES)
def test_by_bits_gemv_gives_the_native_kernels_bits(math, dtype, t, n, k):
    """Placed at 2^-8 of their values, the weights meet x scaled 2^8 higher (f16x2) or fp32 sums scaled by 2^-8: the
    same products and sums as the native kernels, so the same outputs; and fp8_linear_ref's within tolerance."""
    q, s = fp8_block_quantize(_weight(n, k, seed=n + k))
    x = _x(t, k, dtype, seed=t)
    y = f8.fp8_gemv(x, q, s, math=math, by_bits=True)
    assert y.dtype == dtype and y.shape == (t, n)
    assert _rel(y, f8.fp8_linear_ref(x, q, s).double()) < _tol(x, k, math)
    assert _rel(y, _ref(x, q, s)) < _tol(x, k, math)
    assert torch.equal(y, f8.fp8_gemv(x, q, s, math=math))


def test_by_bits_gemv_takes_fp32_x_and_split_k():
    q, s = fp8_block_quantize(_weight(72, 1280, seed=5))  # 72 rows: K splits on the reference SMs
    x = _x(4, 1280, torch.float32, seed=6)
    y = f8.fp8_gemv(x, q, s, by_bits=True)
    assert _rel(y, f8.fp8_linear_ref(x, q, s).double()) < TOL[torch.float32]
    assert torch.equal(y, f8.fp8_gemv(x, q, s))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "n", "k"), [(17, 200, 96), (64, 130, 257)])
def test_by_bits_gemm_is_w8a16(dtype, t, n, k):
    """x is not rounded to e4m3 here: the result is fp8_linear_ref's (fp32 sums of exact products), where the
    native W8A8 GEMM's is fp8_gemm_ref's."""
    q, s = fp8_block_quantize(_weight(n, k, seed=n + k))
    x = _x(t, k, dtype, seed=t)
    y = fg.fp8_gemm(x, q, s, by_bits=True)
    assert y.dtype == dtype and y.shape == (t, n)
    assert _rel(y, f8.fp8_linear_ref(x, q, s).double()) < TOL[dtype]
    assert _rel(y, _ref(x, q, s)) < TOL[dtype]


@pytest.mark.slow
def test_by_bits_gemm_on_a_block_of_128_rows():
    """The large tile (its 8 warps) and several column tiles."""
    q, s = fp8_block_quantize(_weight(300, 256, seed=7))
    x = _x(130, 256, torch.bfloat16, seed=8)
    p = fg.GemmPlan(128, fg.GEMM_BLOCK_N, 8, 2)
    assert _rel(fg.fp8_gemm(x, q, s, by_bits=True, plan=p), _ref(x, q, s)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("t", [1, 3, 8, 16, 17, 64])
def test_fp8_linear_forced_by_bits_matches_the_reference(forced, t):
    q, s = fp8_block_quantize(_weight(72, 200, seed=3))
    x = _x(t, 200, torch.bfloat16, seed=t)
    y = f8.fp8_linear(x, q, s)
    assert _rel(y, f8.fp8_linear_ref(x, q, s).double()) < _tol(x, 200, None)
    if t > f8.GEMV_MAX_TOKENS:  # W8A16: closer to the unrounded product than W8A8
        assert _rel(y, _ref(x, q, s)) < _rel(fg.fp8_gemm_ref(x, q, s), _ref(x, q, s))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("piece_bytes", [1, 1 << 30])
def test_widened_gemm_matches_the_reference_whole_or_in_pieces(dtype, piece_bytes):
    """300 rows: whole (one widening), or pieces of one scale block (128 + 128 + 44 rows) through one buffer."""
    q, s = fp8_block_quantize(_weight(300, 257, seed=11))
    x = _x(20, 257, dtype, seed=12)
    assert wg.piece_rows(300, 257, x.element_size(), piece_bytes) == (128 if piece_bytes == 1 else 300)
    y = wg.fp8_widened_gemm(x, q, s, piece_bytes)
    assert y.dtype == dtype and y.shape == (20, 300)
    assert _rel(y, _ref(x, q, s)) < TOL[dtype]


def test_only_the_by_bits_path_widens_and_from_its_bound():
    bound = wg.WIDEN_GEMM_TOKENS
    assert [wg.gemm_route(t, by_bits=True) for t in (bound - 1, bound)] == ["triton", "widened"]
    assert wg.gemm_route(4096, by_bits=False) == "triton"
    # the most held at once: the piece and its products, of the matrix with the largest
    assert wg.widened_bytes([(300, 257), (128, 64)], 20, 2) == (257 + 20) * 300 * 2
    assert wg.widened_bytes([], 20, 2) == 0


def test_fp8_linear_forced_by_bits_widens_from_the_bound(forced, monkeypatch):
    calls = []
    widen = wg.fp8_widened_gemm
    monkeypatch.setattr(f8, "fp8_widened_gemm", lambda *a: calls.append(a[0].shape[0]) or widen(*a))
    q, s = fp8_block_quantize(_weight(72, 200, seed=13))
    x = _x(wg.WIDEN_GEMM_TOKENS, 200, torch.bfloat16, seed=14)
    y = f8.fp8_linear(x, q, s)
    assert calls == [wg.WIDEN_GEMM_TOKENS]
    assert _rel(y, _ref(x, q, s)) < TOL[torch.bfloat16]


def test_dequantize_and_the_weight_follow_the_forced_path(forced):
    q, s = fp8_block_quantize(_weight(200, 96, seed=9))
    w = QuantizedWeight("fp8_e4m3_b128", (q, s), (200, 96))
    assert torch.equal(fp8_dequantize(q, s, torch.float32), fp8_dequantize_ref(q, s, dtype=torch.float32))
    assert torch.equal(w.dequantize(torch.float32), fp8_dequantize_ref(q, s, dtype=torch.float32))


def test_dequantize_by_bits_on_request_gives_the_references_values():
    """The by-bits widening (kernels/fp8/widened_gemm.py) on whatever path the device takes."""
    q, s = fp8_block_quantize(_weight(200, 96, seed=10))
    # fp32: the interpreter's stores to bf16 truncate
    assert torch.equal(fp8_dequantize(q, s, torch.float32, by_bits=True), fp8_dequantize_ref(q, s, dtype=torch.float32))


# ---- GPU: a tiny model's tokens with the path forced ------------------------------------------------------


@pytest.mark.gpu
def test_forced_by_bits_decodes_the_tokens_of_the_native_path(converted, monkeypatch):
    """The forced path on whatever CUDA card: decode (GEMV, absorbed attention, MoE by bits) gives the native
    path's tokens, graphs and all; a prompt past the GEMV's tokens (W8A16 prefill, x unrounded) gives logits nearer
    the CPU's fp32 reference than the native W8A8 prefill's (on the H200 the two differed by 16% of the logits'
    range on this random model: W8A8's rounding, not a bound to hold the by-bits path to)."""
    from dsfp4.runtime.engine import Engine

    prompt, long = [0, 5, 9, 11, 40, 7], list(range(3, 43))
    runs = {}
    for by_bits in (False, True):
        monkeypatch.setenv(FP8_BY_BITS_ENV, "1" if by_bits else "0")
        backend.fp8_by_bits_forced.cache_clear()
        assert fp8_path(torch.device("cuda")) is (FP8Path.BY_BITS if by_bits else fp8_path_for(_capability()))
        with Engine(converted, device="cuda", max_context=64) as engine:
            runs[by_bits] = (
                engine.generate(prompt, max_tokens=12, temperature=0).token_ids,
                engine.logits(long).float(),
            )
    backend.fp8_by_bits_forced.cache_clear()
    with Engine(converted, device="cpu", dtype="fp32", max_context=64) as engine:
        ref = engine.logits(long).float()
    assert runs[True][0] == runs[False][0]
    native, bits = runs[False][1].cpu(), runs[True][1].cpu()
    assert (bits - ref).norm() < (native - ref).norm()


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()
