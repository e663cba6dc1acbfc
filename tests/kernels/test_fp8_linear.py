"""Backbone matmul kernels (kernels/fp8/linear.py, kernels/fp4/matmul.py, behind kernels/linear.py) against
float64 references: small ragged shapes on the CPU through TRITON_INTERPRET=1, DeepSeek-V3's attention shapes
on a GPU with -m gpu."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dsfp4.kernels.backend import REFERENCE_SMS
from dsfp4.kernels.fp4.matmul import fp4_matmul, fp4_matmul_ref, triton
from dsfp4.kernels.fp8 import gemv as g8
from dsfp4.kernels.fp8 import linear as f8
from dsfp4.kernels.fp8.dequant import fp8_dequantize, fp8_dequantize_ref
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


SHAPES = [(1, 200, 96), (3, 130, 200), (16, 64, 257), (4, 72, 1280)]  # the last splits K (below)
MATHS = ["f16x2", "f32", "legacy", "mma"]
# fp16 products and piece sums round to fp16's 11 bits before the fp32 sums: about twice fp16's output rounding
F16X2_TOL = {torch.bfloat16: 1e-2, torch.float16: 4e-3}


def _tol(x: torch.Tensor, k: int, math: str) -> float:
    """The tolerance of the kernel fp8_gemv picks for x (fp32 x and K off the piece grid take the legacy one)."""
    return F16X2_TOL[x.dtype] if f8.gemv_math(x, k, math) == "f16x2" else TOL[x.dtype]


@pytest.mark.parametrize("math", MATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "n", "k"), SHAPES)
@pytest.mark.slow
def test_fp8_gemv_matches_float64(poisoned, math, dtype, t, n, k):
    if dtype == torch.float32 and math != "legacy":
        pytest.skip("fp32 x always takes the legacy kernel")
    q, s = fp8_block_quantize(_weight(n, k, seed=n + k))
    x = _x(t, k, dtype, seed=t)
    y = f8.fp8_gemv(x, q, s, math=math)
    assert y.dtype == dtype and y.shape == (t, n)
    assert _rel(y, _ref(x, q, s)) < _tol(x, k, math)
    assert _rel(y, f8.fp8_linear_ref(x, q, s).double()) < _tol(x, k, math)  # and its torch reference


def test_fp32_x_keeps_the_legacy_kernel_bits():
    q, s = fp8_block_quantize(_weight(130, 200, seed=1))
    x = _x(3, 200, torch.float32, seed=2)
    assert torch.equal(f8.fp8_gemv(x, q, s), f8.fp8_gemv(x, q, s, math="legacy"))
    assert f8.gemv_math(x.bfloat16(), 200) == f8.GEMV_MATH and f8.gemv_math(x.bfloat16(), 201) == "legacy"
    many = _x(f8.GEMV_MMA_TOKENS, 200, torch.bfloat16, seed=3)
    assert f8.gemv_math(many, 200) == "mma" and f8.gemv_math(many.float(), 200) == "legacy"
    long_k = f8.GEMV_MMA_LONG_K + 8  # the tensor cores only at the most tokens there
    assert f8.gemv_math(many, long_k) == f8.GEMV_MATH
    assert f8.gemv_math(_x(f8.GEMV_MAX_TOKENS, 8, torch.bfloat16, seed=3), long_k) == "mma"


@pytest.mark.parametrize("math", ["f16x2", "f32", "mma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.slow
def test_fp8_gemv_takes_any_x_magnitude(poisoned, math, dtype):
    """Tokens far above and below fp16's range (bf16: 2^+-80), pieces spread over 2^+-30 (fp16: 2^+-4), a zero
    token: f16x2 scales x per token and piece, so each token keeps its precision and no sum overflows."""
    t, n, k = 4, 72, 256
    q, s = fp8_block_quantize(_weight(n, k, seed=3))
    top = 30.0 if dtype == torch.bfloat16 else 4.0
    pieces = torch.logspace(-top, top, k // 8, base=2.0, device=DEVICE).repeat_interleave(8)
    mags = torch.tensor([2.0**80, 2.0**-80, 1.0, 0.0], device=DEVICE)[:, None] if dtype == torch.bfloat16 else 1.0
    x = (_x(t, k, torch.float32, seed=4) * pieces * mags).to(dtype)
    y = f8.fp8_gemv(x, q, s, math=math)
    want = _ref(x, q, s)
    for i in range(t - 1 if dtype == torch.bfloat16 else t):  # each token against its own largest output
        assert _rel(y[i], want[i]) < F16X2_TOL[dtype]
    if dtype == torch.bfloat16:
        assert torch.equal(y[-1].float(), torch.zeros(n, device=DEVICE))


def test_fp8_gemv_f16x2_sums_at_the_fp16_bound(poisoned):
    """Every weight +448 in e4m3 and every x the same, scaled to just under 2^X16_TOP: each piece sums to the
    bound (8 * 448 * 15.94 = 57120 < 65504); one exponent more would overflow to inf."""
    n, k = 64, 1024
    q = torch.full((n, k), 448.0, device=DEVICE).to(torch.float8_e4m3fn)
    s = torch.full((1, k // 128), 2.0**-20, device=DEVICE)
    x = torch.full((2, k), 1.9921875, device=DEVICE, dtype=torch.bfloat16)  # 1 + 127/128: scaled to 15.94
    x[1] *= -(2.0**60)
    y = f8.fp8_gemv(x, q, s, math="f16x2")
    assert _rel(y, _ref(x, q, s)) < F16X2_TOL[torch.bfloat16]


# ---- the piece kernel's PTX, run on the CPU by a small emulator of the instructions it uses ----------------------


def _h(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0])


def _hb(v: float) -> int:  # to fp16 bits, rounded to nearest even (v: exact in float64)
    return int(np.array([v], np.float16).view(np.uint16)[0])


def _f(bits: int) -> float:
    return float(np.array([bits & 0xFFFFFFFF], np.uint32).view(np.float32)[0])


def _fb(v: float) -> int:  # to fp32 bits, rounded to nearest even
    return int(np.array([v], np.float32).view(np.uint32)[0])


def _x2(op, *regs: int) -> int:  # an f16x2 operation, half by half
    return sum(_hb(op(*(_h(r >> 16 * i) for r in regs))) << 16 * i for i in range(2))


E4M3_F16 = [_hb(v) for v in torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()]
PTX_OPS = {
    "mul.rn.f16x2": lambda a, b: _x2(lambda x, y: x * y, a, b),
    "fma.rn.f16x2": lambda a, b, c: _x2(lambda x, y, z: x * y + z, a, b, c),
    "add.rn.f16": lambda a, b: _hb(_h(a) + _h(b)),
    "cvt.f32.f16": lambda a: _fb(_h(a)),
    "cvt.rn.f16x2.e4m3x2": lambda a: E4M3_F16[a & 0xFF] | E4M3_F16[(a >> 8) & 0xFF] << 16,
    "cvt.rn.f16x2.f32": lambda a, b: _hb(_f(b)) | _hb(_f(a)) << 16,  # a to the upper half
    "abs.f32": lambda a: a & 0x7FFFFFFF,
    "max.f32": lambda a, b: _fb(max(_f(a), _f(b))),
    "mul.f32": lambda a, b: _fb(_f(a) * _f(b)),
    "shr.u32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: (a << b) & 0xFFFFFFFF,
    "sub.s32": lambda a, b: a - b,
    "max.s32": max,
    "min.s32": min,
    "mov.b32": lambda a: a,
}


def _ptx(text: str, args: dict[int, int]) -> dict[int, int]:
    """Runs the kernels' inline PTX on integers holding register bits: args and results keyed by $ number."""
    regs = {f"${i}": v for i, v in args.items()}
    for line in (ln.strip().rstrip(";") for ln in text.splitlines()):
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [o.strip() for o in re.split(r",(?![^{]*})", rest)]
        val = [regs[o] if o in regs else int(o, 0) for o in src if not o.startswith("{")]
        if dst.startswith("{"):  # unpack: the first register takes the low bits
            names, bits = [n.strip() for n in dst.strip("{}").split(",")], int(op.split(".")[1][1:]) // 2
            for i, name in enumerate(names):
                regs[name] = (val[0] >> bits * i) & ((1 << bits) - 1)
        elif src and src[0].startswith("{"):  # pack
            names, bits = [n.strip() for n in src[0].strip("{}").split(",")], int(op.split(".")[1][1:]) // 2
            regs[dst] = sum(regs[n] << bits * i for i, n in enumerate(names))
        else:
            regs[dst] = PTX_OPS[op](*val)
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def _u(t: torch.Tensor) -> list[int]:
    """A tensor's bytes as unsigned 32-bit (4-byte dtypes) or 64-bit (8-byte) integers."""
    return t.numpy().view(np.uint32 if t.element_size() == 4 else np.uint64).tolist()


def test_piece_ptx_pairs_every_byte_with_its_x():
    """PAIRS_PTX then piece_ptx on random pieces: byte i meets x[i], within fp16 rounding of the exact sum."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(64):
        codes = torch.randint(0, 0x7F, (8,), generator=gen) | (torch.rand(8, generator=gen) < 0.5) * 0x80  # no NaN
        codes = codes.to(torch.uint8)
        x = (torch.randn(8, generator=gen) * 4).half()
        words = [_ptx(g8.PAIRS_PTX, {2: w}) for w in _u(codes.view(torch.int32))]  # {0: bytes 0, 1; 1: bytes 2, 3}
        (lo0, hi0), (lo1, hi1) = ((r[0], r[1]) for r in words)
        xa, xb = _u(x.view(torch.int64))
        got = _f(_ptx(g8.piece_ptx(), {1: lo0 | hi0 << 32, 2: lo1 | hi1 << 32, 3: xa, 4: xb})[0])
        prod = codes.view(torch.float8_e4m3fn).double() * x.double()
        assert abs(got - prod.sum().item()) <= 2**-9 * prod.abs().sum().item()


def test_x16_ptx_scales_each_piece_into_the_fp16_bound():
    """x16_ptx: the piece's largest |x| lands in [2^(X16_TOP - 1), 2^X16_TOP), x * 2^s exactly as torch rounds it."""
    gen = torch.Generator().manual_seed(6)
    for scale in [2.0**-120, 2.0**-30, 1.0, 3.0, 2.0**40, 0.0]:
        x = (torch.randn(8, generator=gen) * scale).bfloat16().float()
        got = _ptx(g8.x16_ptx(), {3 + i: w for i, w in enumerate(_u(x))})
        x16 = torch.from_numpy(np.array([got[0], got[1]], np.uint64).view(np.float16))
        assert torch.equal(x16, (x / _f(got[2])).half())  # got[2] = 2^-s
        if scale:
            assert 2.0 ** (g8.X16_TOP - 1) <= x16.abs().max().item() < 2.0**g8.X16_TOP


def test_gemv_plan_splits_k_only_where_rows_leave_sms_idle():
    plan = {name: f8.gemv_plan(1, n, k, H100_SMS, "legacy") for name, n, k in ATTENTION_SHAPES}
    assert plan["kv_a"].split > 1 and plan["q_a"].split > 1
    assert plan["o"].split == plan["q_b"].split == plan["kv_b"].split == 1
    for name, _, k in ATTENTION_SHAPES:  # splits cover K exactly once, in whole steps
        p = plan[name]
        assert p.k_split % p.block_k == 0 and (p.split - 1) * p.k_split < k <= p.split * p.k_split
    assert f8.gemv_plan(4, 72, 1280, REFERENCE_SMS, "legacy").split == 3  # the split case of SHAPES on the CPU


@pytest.mark.parametrize("t", [1, 2, 4, 8, 16])
def test_piece_plan_fills_the_sms_without_splitting_deepseek_shapes(t):
    """Rows per program follow GEMV_ROWS for T, halved while the row blocks number fewer than two per SM: every
    V3 shape gets a program per SM without a K split (q_a and kv_a 4 rows, o 8 at T = 1)."""
    most = next(rows for top, rows in f8.GEMV_ROWS if t <= top)
    for name, n, k in ATTENTION_SHAPES + MLP_SHAPES:
        p = f8.gemv_plan(t, n, k, H100_SMS, "f16x2")
        assert p.split == 1 and p.k_split >= k and 128 % p.block_n == 0, name
        halved = -(-n // (2 * p.block_n)) < f8.PROGRAMS_PER_SM * H100_SMS
        assert p.block_n == most or (f8.GEMV_MIN_ROWS <= p.block_n < most and halved), name
        assert -(-n // p.block_n) >= H100_SMS, name
    assert f8.gemv_plan(1, 576, 7168, H100_SMS, "f16x2").block_n == 4
    assert f8.gemv_plan(1, 1536, 7168, H100_SMS, "f16x2").block_n == 4
    assert f8.gemv_plan(1, 7168, 16384, H100_SMS, "f16x2").block_n == 8
    assert f8.gemv_plan(4, 72, 1280, REFERENCE_SMS, "f16x2").split == 2  # too few rows: K splits after all


def test_mma_plan_halves_rows_then_splits_k_in_whole_scale_blocks():
    """The tensor-core GEMV: 64 rows a program, halved to 16 while the SMs lack two programs each, then K split in
    whole 128-wide blocks until every SM has one; the splits cover K exactly once."""
    most, least = f8.GEMV_MMA_ROWS
    for name, n, k in ATTENTION_SHAPES + MLP_SHAPES:
        p = f8.gemv_plan(16, n, k, H100_SMS, "mma")
        assert p.block_t == 16 and p.block_k == 128 and 128 % p.block_n == 0, name
        assert p.block_n == most or (least <= p.block_n < most and -(-n // (2 * p.block_n)) < 2 * H100_SMS), name
        assert p.k_split % 128 == 0 and (p.split - 1) * p.k_split < k <= p.split * p.k_split, name
        assert p.split == 1 or -(-n // p.block_n) < H100_SMS, name
    assert f8.gemv_plan(16, 576, 7168, H100_SMS, "mma").split > 1  # 36 row blocks of 16 on 132 SMs
    assert f8.gemv_plan(16, 18432, 7168, H100_SMS, "mma") == f8.GemvPlan(16, 64, 128, 1, 7168, "mma", f8.GEMV_WARPS)


@pytest.mark.parametrize("math", MATHS)
@pytest.mark.slow
def test_fp8_gemv_split_k_is_deterministic(math):
    q, s = fp8_block_quantize(_weight(72, 1280, seed=0))
    x = _x(4, 1280, torch.bfloat16, seed=1)
    assert torch.equal(f8.fp8_gemv(x, q, s, math=math), f8.fp8_gemv(x, q, s, math=math))


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
@pytest.mark.slow
def test_fp8_linear_picks_a_kernel_by_token_count(poisoned, t):
    q, s = fp8_block_quantize(_weight(72, 200, seed=3))
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
@pytest.mark.slow
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
MLP_SHAPES = [
    ("shared_w13", 2048, 7168),
    ("shared_w2", 7168, 2048),
    ("dense_w13", 18432, 7168),
    ("dense_w2", 7168, 18432),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize("math", MATHS)
@pytest.mark.parametrize(("name", "n", "k"), ATTENTION_SHAPES[:3] + MLP_SHAPES[:2])
def test_fp8_gemv_maths_on_deepseek_shapes(poisoned, name, n, k, math, t):
    q, s = fp8_block_quantize(_weight(n, k, seed=n, device="cuda") * 1e-2)
    x = _x(t, k, torch.bfloat16, seed=t, device="cuda")
    assert _rel(f8.fp8_gemv(x, q, s, math=math), _ref(x, q, s)) < 1e-2


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
