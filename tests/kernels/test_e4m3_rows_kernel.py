"""The rounding kernels of the FP8 prefill attention (kernels/mla/e4m3_rows.py e4m3_rows_kernel, e4m3_rows_jit.py)
against the torch formula: the same e4m3 bytes, scales and layout, along the innermost dim (q_nope, k_nope) and along
the keys (v), from contiguous tensors and from views of an expanded key block; e4m3_rows takes the kernel only on a
GPU with e4m3 in hardware, and only for the shapes kernel_takes names. The bytes agree for finite x (the kernels'
max and clamp drop a NaN, the formula's keep it)."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels import backend
from dsfp4.kernels.backend import triton
from dsfp4.kernels.mla import e4m3_rows as rows_module
from dsfp4.kernels.mla.e4m3_rows import E4M3Rows, e4m3_rows, e4m3_rows_kernel, kernel_takes
from tests.fixtures.cards import CARDS

needs_triton = pytest.mark.skipif(triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values of magnitudes 1e-3 to 1e3 along the first dim, an all-zero row along each kind of dim."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    x[1] = 0
    x[..., 2] = 0
    return x.to(dtype).to(DEVICE)


def _same(got: E4M3Rows, want: E4M3Rows) -> None:
    assert got.values.shape == want.values.shape and got.values.stride() == want.values.stride()
    assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
    assert got.scale.shape == want.scale.shape and torch.equal(got.scale, want.scale)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "dim"), [((7, 3, 40), -1), ((6, 24), 1), ((70, 2, 20), 0), ((9, 3, 5), 0)])
def test_the_kernels_round_as_the_formula_does(dtype, shape, dim):
    """Innermost rows of 40 (padded to 64) and 24, and along 70 keys (two key tiles, one partial) and 9 (one):
    byte for byte the formula's, in its layout (the rounded dim of unit stride)."""
    x = _x(shape, dtype, len(shape) + dim)
    _same(e4m3_rows_kernel(x, dim), rows_module._rows(x, dim % x.dim()))


@needs_triton
def test_the_kernels_read_a_key_blocks_views_in_place():
    """k_nope and v as views of one expanded block [Sb, H, N + V] (mla_prefill's): each rounded from its strides
    as the formula rounds a contiguous copy."""
    keys = _x((67, 3, 40 + 24), torch.bfloat16, 5)
    k_nope, v = keys[..., :40], keys[..., 40:]
    _same(e4m3_rows_kernel(k_nope, -1), rows_module._rows(k_nope.contiguous(), 2))
    _same(e4m3_rows_kernel(v, 0), rows_module._rows(v.contiguous(), 0))


def test_the_kernel_is_taken_only_where_it_runs_and_for_its_shapes(monkeypatch):
    x = torch.randn(4, 2, 8)
    assert kernel_takes(x, 2) and kernel_takes(x, 0) and kernel_takes(x[0], 1)
    assert not kernel_takes(x, 1) and not kernel_takes(x[0], 0) and not kernel_takes(x.transpose(1, 2), 2)
    assert not kernel_takes(torch.randn(2, 3, 4, 5), 3)
    called = []
    monkeypatch.setattr(rows_module, "e4m3_rows_kernel", lambda *a: called.append(a) or rows_module._rows(*a))
    e4m3_rows(x, -1)
    assert not called  # the CPU takes the formula
    monkeypatch.setattr(rows_module, "hw_e4m3", lambda device: True)
    e4m3_rows(x, -1)
    e4m3_rows(x, 1)
    assert len(called) == 1  # along dim 1 of three: the formula
    # a card whose kernels run but hold no fp8 type (sm_80, sm_86): the formula
    monkeypatch.setattr(rows_module, "hw_e4m3", lambda device: False)
    e4m3_rows(x, -1)
    assert len(called) == 1


@needs_triton
def test_the_kernels_round_only_on_cards_with_e4m3_in_hardware(monkeypatch):
    """The dispatch asks the backend's rule (kernels.backend.hw_e4m3), which takes e4m3 on sm_89 on only."""
    cuda = torch.device("cuda", 0)
    assert not rows_module.hw_e4m3(torch.device("cpu"))
    monkeypatch.setattr(backend, "interpreted", lambda: False)  # as on a GPU machine
    for name, native in (("A100", False), ("RTX 3090", False), ("RTX 4090", True), ("H100", True)):
        monkeypatch.setattr(backend, "cuda_props", lambda index, p=CARDS[name]: p)
        assert rows_module.hw_e4m3(cuda) == native, name


@pytest.mark.gpu
@needs_triton
def test_the_kernels_at_deepseek_v3_size_on_the_gpu():
    """A block of 2,048 expanded keys at V3's 128 heads (nope 128, values 128) and 4,096 queries: the formula's
    bytes."""
    if DEVICE != "cuda":
        pytest.skip("needs a CUDA device")
    keys = _x((2048, 128, 256), torch.bfloat16, 7)
    _same(e4m3_rows_kernel(keys[..., :128], -1), rows_module._rows(keys[..., :128], 2))
    _same(e4m3_rows_kernel(keys[..., 128:], 0), rows_module._rows(keys[..., 128:], 0))
    q = _x((4096, 128, 128), torch.bfloat16, 8)
    _same(e4m3_rows_kernel(q, -1), rows_module._rows(q, 2))
