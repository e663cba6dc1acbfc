"""Backbone matmul kernels (kernels/fp8_linear.py, kernels/fp4_matmul.py, behind kernels/linear.py) against
float64 references: small ragged shapes on the CPU through TRITON_INTERPRET=1, DeepSeek-V3's attention shapes
on a GPU with -m gpu."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels import fp8_linear as f8
from dsfp4.kernels.fp4_matmul import fp4_matmul, fp4_matmul_ref, triton
from dsfp4.kernels.fp8_dequant import fp8_dequantize, fp8_dequantize_ref
from dsfp4.kernels.linear import QuantizedWeight, linear, linear_triton
from dsfp4.layout.fp8 import fp8_block_dequantize, fp8_block_quantize
from dsfp4.layout.quant import quantize

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # output rounding of each dtype
W8A8_TOL = 6e-2  # x rounded to e4m3 (3 mantissa bits) per 128-group: ~2.6% relative error on random data
H100_SMS = 132


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty hands out NaN-filled float tensors: an output element a kernel leaves unwritten shows up."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "an output element was never written"
    return ((got.double().cpu() - want.cpu()).abs().max() / want.abs().max()).item()


def _weight(n: int, k: int, seed: int, device: str = DEVICE) -> torch.Tensor:
    """[N, K] spread over scale regimes: columns from 1e-3 to 10, row blocks from 10 to 1e-2."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cols = torch.logspace(-3, 1, k, device=device)[None, :]
    rows = torch.logspace(1, -2, n, device=device)[:, None]
    return torch.randn(n, k, generator=gen, device=device) * cols * rows


def _x(t: int, k: int, dtype: torch.dtype, seed: int, device: str = DEVICE) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(t, k, generator=gen, device=device).to(dtype)


def _ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x @ W^T in float64 from the stored FP8 weight."""
    return x.double() @ fp8_block_dequantize(q, s, dtype=torch.float64).T


def _ref_w8a8(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The same with x rounded as fp8_gemm rounds it (act_quant_ref)."""
    x_q, x_s = f8.act_quant_ref(x)
    x_d = x_q.double() * x_s.double().repeat_interleave(128, dim=1)[:, : x.shape[1]]
    return _ref(x_d, q, s)


SHAPES = [(1, 200, 96), (3, 130, 200), (16, 64, 257), (4, 200, 1280)]  # the last splits K (below)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "n", "k"), SHAPES)
def test_fp8_gemv_matches_float64(poisoned, dtype, t, n, k):
    q, s = fp8_block_quantize(_weight(n, k, seed=n + k))
    x = _x(t, k, dtype, seed=t)
    y = f8.fp8_gemv(x, q, s)
    assert y.dtype == dtype and y.shape == (t, n)
    assert _rel(y, _ref(x, q, s)) < TOL[dtype]
    assert _rel(y, f8.fp8_linear_ref(x, q, s).double()) < TOL[dtype]  # and its torch reference


def test_gemv_plan_splits_k_only_where_rows_leave_sms_idle():
    plan = {name: f8.gemv_plan(1, n, k, H100_SMS) for name, n, k in ATTENTION_SHAPES}
    assert plan["kv_a"].split > 1 and plan["q_a"].split > 1
    assert plan["o"].split == plan["q_b"].split == plan["kv_b"].split == 1
    for name, _, k in ATTENTION_SHAPES:  # splits cover K exactly once, in whole steps
        p = plan[name]
        assert p.k_split % p.block_k == 0 and (p.split - 1) * p.k_split < k <= p.split * p.k_split
    assert f8.gemv_plan(4, 200, 1280, f8.REFERENCE_SMS).split == 3  # the split case of SHAPES on the CPU


def test_fp8_gemv_split_k_is_deterministic():
    q, s = fp8_block_quantize(_weight(200, 1280, seed=0))
    x = _x(4, 1280, torch.bfloat16, seed=1)
    assert torch.equal(f8.fp8_gemv(x, q, s), f8.fp8_gemv(x, q, s))


def test_act_quant_matches_its_reference(poisoned):
    x = _x(5, 300, torch.float32, seed=2) * torch.logspace(-8, 3, 300, device=DEVICE)[None, :]  # subnormals too
    x[1, 128:256] = 0.0  # an all-zero group takes scale 1
    x[2, :7] = torch.tensor([448.0, -448.0, 232.0, 240.0, 248.0, 2.0**-10, 3 * 2.0**-11])  # ties of e4m3
    for xi in (x, x.bfloat16()):
        q, s = f8.act_quant(xi)
        q_ref, s_ref = f8.act_quant_ref(xi)
        assert torch.equal(s.cpu(), s_ref.cpu())
        # equal values (the GPU may round a flushed subnormal to +0 where the CPU keeps -0)
        assert torch.equal(q.float().cpu(), q_ref.float().cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "n", "k"), [(17, 200, 96), (40, 130, 200), (33, 64, 257)])
def test_fp8_gemm_matches_its_reference(poisoned, dtype, t, n, k):
    q, s = fp8_block_quantize(_weight(n, k, seed=n + k))
    x = _x(t, k, dtype, seed=t)
    y = f8.fp8_gemm(x, q, s)
    assert y.dtype == dtype and y.shape == (t, n)
    assert _rel(y, _ref_w8a8(x, q, s)) < TOL[dtype]
    assert _rel(y, f8.fp8_gemm_ref(x, q, s).double()) < TOL[dtype]
    assert _rel(y, _ref(x, q, s)) < W8A8_TOL  # what rounding x to e4m3 costs


@pytest.mark.parametrize("t", [1, 3, 16, 17, 40])
def test_fp8_linear_picks_a_kernel_by_token_count(poisoned, t):
    q, s = fp8_block_quantize(_weight(200, 200, seed=3))
    x = _x(t, 200, torch.bfloat16, seed=t)
    want = _ref(x, q, s) if t <= f8.GEMV_MAX_TOKENS else _ref_w8a8(x, q, s)
    assert _rel(f8.fp8_linear(x, q, s), want) < TOL[torch.bfloat16]
    x32 = x.float()  # fp32 prefill takes the exact reference rather than W8A8
    assert _rel(f8.fp8_linear(x32, q, s), _ref(x32, q, s)) < TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp4_matmul_tensor_core_path_with_half_activations(poisoned, fmt, dtype):
    t, n, k = 40, 80, 192
    parts = quantize(fmt, _weight(n, k, seed=4).cpu())
    packed, scale = parts[0], parts[1].view(torch.uint8)
    g = parts[2].reshape(1).expand(2).contiguous() if fmt == "nvfp4" else None
    x = _x(t, k, dtype, seed=5)
    want = fp4_matmul_ref(x.cpu().double(), packed, scale, g, n, fmt)
    got = fp4_matmul(x, packed.to(DEVICE), scale.to(DEVICE), g if g is None else g.to(DEVICE), n, fmt)
    # bf16 x and the FP4 weights multiply exactly in bf16; fp16 x is rounded to bf16 first
    assert _rel(got, want) < (1e-5 if dtype == torch.bfloat16 else 1e-2)


@pytest.mark.parametrize("fmt", ["fp8_e4m3_b128", "nvfp4", "mxfp4", "bf16", "f32"])
@pytest.mark.parametrize("tokens", [3, 20])  # [2, tokens, K]: the GEMV and the GEMM
def test_linear_keeps_x_dtype_and_leading_dims(poisoned, fmt, tokens):
    n, k = 96, 128
    w = QuantizedWeight(fmt, tuple(p.to(DEVICE) for p in quantize(fmt, _weight(n, k, seed=6).cpu())), (n, k))
    x = _x(2 * tokens, 2 * k, torch.bfloat16, seed=7).reshape(2, tokens, 2 * k)[..., ::2]  # non-contiguous
    want = (x.double() @ w.dequantize(torch.float64).T).reshape(2 * tokens, n)
    tol = W8A8_TOL if fmt == "fp8_e4m3_b128" and 2 * tokens > f8.GEMV_MAX_TOKENS else TOL[torch.bfloat16]
    for fn in (linear_triton, linear):
        y = fn(x, w)
        assert y.dtype == x.dtype and y.shape == (2, tokens, n)
        assert _rel(y.reshape(-1, n), want) < tol


# ---- GPU: DeepSeek-V3 attention projections at full size ----------------------------------------------

ATTENTION_SHAPES = [
    ("q_a", 1536, 7168),
    ("kv_a", 576, 7168),
    ("q_b", 24576, 1536),
    ("kv_b", 32768, 512),
    ("o", 7168, 16384),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 512])
@pytest.mark.parametrize(("name", "n", "k"), ATTENTION_SHAPES)
def test_fp8_linear_on_deepseek_attention_shapes(poisoned, name, n, k, t):
    q, s = fp8_block_quantize(_weight(n, k, seed=n, device="cuda") * 1e-2)
    w = QuantizedWeight("fp8_e4m3_b128", (q, s), (n, k), name)
    x = _x(t, k, torch.bfloat16, seed=t, device="cuda")
    y = linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (t, n)
    if t <= f8.GEMV_MAX_TOKENS:
        assert _rel(y, _ref(x, q, s)) < 1e-2
        assert torch.equal(y, linear(x, w))  # split-K sums in a fixed order
    else:
        assert _rel(y, _ref_w8a8(x, q, s)) < 1e-2  # the kernel, given its rounded activations
        assert _rel(y, _ref(x, q, s)) < W8A8_TOL  # and what that rounding costs


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 512])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_linear_on_a_deepseek_shape(fmt, t):
    n, k = 1536, 7168  # q_a
    w = QuantizedWeight(fmt, quantize(fmt, _weight(n, k, seed=8, device="cuda") * 1e-2), (n, k))
    x = _x(t, k, torch.bfloat16, seed=t, device="cuda")
    y = linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (t, n)
    assert _rel(y, x.double() @ w.dequantize(torch.float64).T) < 1e-2


@pytest.mark.gpu
def test_fp8_gemv_replays_in_a_cuda_graph():
    q, s = fp8_block_quantize(_weight(576, 7168, seed=9, device="cuda"))  # kv_a: split-K, two launches
    x = _x(1, 7168, torch.bfloat16, seed=10, device="cuda")
    eager = f8.fp8_linear(x, q, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f8.fp8_linear(x, q, s)
    x.copy_(_x(1, 7168, torch.bfloat16, seed=11, device="cuda"))
    graph.replay()
    assert torch.equal(y, f8.fp8_linear(x, q, s)) and not torch.equal(y, eager)


@pytest.mark.parametrize(("n", "k"), [(200, 96), (576, 300), (256, 128)])
def test_fp8_dequantize_matches_its_reference_exactly(n, k):
    q, s = fp8_block_quantize(_weight(n, k, seed=n * k))
    for dtype in (torch.float32, torch.bfloat16):
        got, want = fp8_dequantize(q, s, dtype).cpu(), fp8_dequantize_ref(q, s, dtype=dtype).cpu()
        assert got.dtype == dtype
        if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates to bf16 (the GPU rounds)
            assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(got, want)
