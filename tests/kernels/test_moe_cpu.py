"""The CPU's MoE kernel (kernels/cpu/moe.c) against the torch reference, each of its paths, and its build."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.cpu import build
from dsfp4.kernels.cpu import moe as host_moe
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.kernels.moe.ref import moe_ref
from tests.fixtures.moe_records import routing, slot_pool

pytestmark = pytest.mark.skipif(not host_moe.available(), reason="no C compiler builds kernels/cpu/moe.c here")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("path", list(build.PATHS))
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("t", [1, 3, 19])  # 19: the kernel serves 8 tokens per decoded row, and a ragged rest
def test_the_cpu_kernel_matches_the_reference(fmt, t, path):
    gen = torch.Generator().manual_seed(t)
    n_experts, k = 6, 3
    layout, records, offsets = slot_pool(fmt, 64, 96, n_experts, gen, absent=(4,))
    ids, weights = routing(t, k, n_experts, gen)
    x = torch.randn(t, layout.dim, generator=gen) * 3
    want = moe_ref(x.double(), ids, weights, records, offsets, layout)
    got = host_moe.moe_host(x, ids, weights, records, offsets, layout, path=path)
    assert got.dtype == x.dtype and _rel(got, want) < 1e-5


def test_the_rows_split_over_threads_give_one_threads_bits(cpu_threads):
    """The kernel takes torch's thread count (one a worker under `pytest -n`): three threads split each matrix's rows
    and give the bits one thread gives."""
    gen = torch.Generator().manual_seed(19)
    layout, records, offsets = slot_pool("nvfp4", 64, 96, 6, gen, absent=(4,))
    ids, weights = routing(19, 3, 6, gen)
    x = torch.randn(19, layout.dim, generator=gen)
    got = []
    for n in (1, 3):
        cpu_threads(n)
        got.append(host_moe.moe_host(x, ids, weights, records, offsets, layout))
    assert torch.equal(got[0], got[1])


def test_the_swiglu_limit_is_applied():
    gen = torch.Generator().manual_seed(0)
    layout, records, offsets = slot_pool("nvfp4", 64, 64, 4, gen)
    ids, weights = routing(2, 2, 4, gen)
    x = torch.randn(2, layout.dim, generator=gen) * 3
    want = moe_ref(x.double(), ids, weights, records, offsets, layout, limit=0.5)
    assert _rel(moe_ref(x.double(), ids, weights, records, offsets, layout), want) > 0.05  # the clamp bites
    assert _rel(host_moe.moe_host(x, ids, weights, records, offsets, layout, limit=0.5), want) < 1e-5


def test_moe_kernel_takes_it_on_the_cpu_in_bf16():
    gen = torch.Generator().manual_seed(1)
    layout, records, offsets = slot_pool("mxfp4", 64, 64, 5, gen)
    ids, weights = routing(4, 2, 5, gen)
    x = torch.randn(4, layout.dim, generator=gen)
    kernel = MoEKernel(layout, 2, torch.device("cpu"))
    assert kernel.host
    got = kernel(x.bfloat16(), ids, weights, records, offsets, add=x.bfloat16())
    want = moe_ref(x.double(), ids, weights, records, offsets, layout) + x.double()
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2


def test_a_missing_compiler_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(build.KernelUnavailable, match="no C compiler .*no-such-cc.* install gcc or set \\$CC"):
        build.load.__wrapped__(host_moe.SOURCE, ("-DNEW_KEY",))


def test_a_failing_build_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(build.KernelUnavailable, match="failed on bad.c"):
        build.load.__wrapped__(bad)
    assert not list((tmp_path / "dsfp4" / "kernels").iterdir())


def test_a_build_is_cached_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = tmp_path / "one.c"
    src.write_text("int one(void) { return 1; }\n")
    assert build.load.__wrapped__(src).one() == 1
    src.write_text("int one(void) { return 2; }\n")  # a changed source is built anew, not read from the cache
    assert build.load.__wrapped__(src).one() == 2
    assert len(list((tmp_path / "dsfp4" / "kernels").glob("one-*.so"))) == 2


def test_a_cache_that_cannot_be_written_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    src = tmp_path / "two.c"
    src.write_text("int two(void) { return 2; }\n")
    with pytest.raises(build.KernelUnavailable, match="cannot build two.c into"):
        build.load.__wrapped__(src)
