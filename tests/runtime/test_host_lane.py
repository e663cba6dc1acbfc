"""The CPU lane (RunOptions.cpu_experts): RAM hits computed on the host give the tokens of the same run without it,
eager and captured, exact routing and under a threshold; what it takes and how the share is decided."""

from __future__ import annotations

import json

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.cpu import moe as host_moe
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan import probes
from tests.fixtures.cli import run_cli
from tests.runtime.test_expert_store import PROMPT, _engine, _generate
from tests.runtime.test_expert_threshold import captured_and_eager

needs_kernel = pytest.mark.skipif(not host_moe.available(), reason="no C compiler builds kernels/cpu/moe.c here")


@needs_kernel
@pytest.mark.parametrize("knobs", [{}, {"expert_threshold": 0.49}])
def test_ram_hits_computed_on_the_host_give_the_same_tokens(converted, knobs):
    """2 device and 3 RAM slots: most experts cross from RAM, and with a share of 1 the host takes every RAM hit."""
    alone = _generate(_engine(converted, 2, 3, io_threads=1, cpu_experts="off", **knobs), n=12)
    lane = _generate(_engine(converted, 2, 3, io_threads=1, cpu_experts="1", **knobs), n=12)
    assert lane.token_ids == alone.token_ids
    s, before = lane.stats.store, alone.stats.store
    assert s["host_computed"] > 0 and before["host_computed"] == 0
    # the host's experts are RAM hits that never cross to the device: fewer bytes copied
    assert s["host_computed"] <= s["ram_hits"] and s["h2d_bytes"] < before["h2d_bytes"]
    assert (
        "computed on the CPU" in lane.stats.line()
        and "share 1.00 of the experts not on the GPU: " in lane.stats.table()
    )


@needs_kernel
def test_a_share_splits_the_experts_that_cross(converted):
    """At 0.5 the host takes about half of the experts not on the device, and only RAM hits."""
    g = _generate(_engine(converted, 2, 3, io_threads=1, cpu_experts="0.5"), n=12)
    s = g.stats.store
    crossing = s["expert_uses"] - s["gpu_hits"]
    assert 0 < s["host_computed"] <= min(s["ram_hits"], crossing)


def test_the_flag_is_checked(converted):
    for bad in ("2", "-0.1", "fast"):
        with pytest.raises(ConfigError, match=f"--cpu-experts {bad}: give auto, off, or a share"):
            RunOptions(cpu_experts=bad)
    r = run_cli("run", converted, "--prompt", "hi", "--cpu-experts", "fast")
    assert r.exit_code != 0 and "--cpu-experts fast: give auto, off" in r.output and "Traceback" not in r.output
    assert probes.host_share("0.25", None, torch.device("cpu")).share == 0.0  # no expert records: nothing to take


def test_auto_takes_nothing_off_cuda_and_a_number_is_itself(converted):
    layout = Manifest.read(converted).record
    cpu = torch.device("cpu")
    auto = probes.host_share("auto", layout, cpu)
    assert auto.share == 0.0 and "on the CPU already" in auto.describe()  # the device is the host already
    assert probes.host_share("off", layout, cpu).describe() == "off (--cpu-experts off)"
    assert probes.host_share("0.25", layout, cpu).share == 0.25


@needs_kernel
def test_the_kernel_probe_measures_a_record(converted):
    assert probes.host_moe_gbps(Manifest.read(converted).record) > 0


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("knobs", [{}, {"expert_threshold": 0.49}])
def test_on_cuda_graph_steps_add_what_the_host_computed(converted, knobs):
    """Captured steps read the host's sum and experts from buffers filled between the pieces; eager steps add the
    sum themselves: the same tokens. With exact routing they are the tokens of the run without the lane; under a
    threshold the lane's pinned RAM slots change what RAM evicts, and so what is cold: compared with itself only."""
    captured, eager = captured_and_eager(converted, "host_computed", ram_slots=3, cpu_experts="1", **knobs)
    assert captured == eager
    if not knobs:
        assert captured == captured_and_eager(converted, "ram_hits", ram_slots=3, cpu_experts="off")[0]
    layout = Manifest.read(converted).record
    split = probes.host_share("auto", layout, torch.device("cuda"))
    assert 0 < split.share < 1 and split.cpu_gbps > 0 and split.pcie_gbps > 0 and "GB/s" in split.describe()


def test_plan_reports_the_lane(converted):
    r = run_cli("run", converted, "--plan", "--device", "cpu")
    assert r.exit_code == 0 and "CPU lane: off (--cpu-experts off)" in r.output
    r = run_cli("run", converted, "--plan", "--json", "--device", "cpu", "--cpu-experts", "0.3")
    assert json.loads(r.stdout)["cpu_lane"]["share"] == 0.3


@needs_kernel
def test_a_failed_step_leaves_no_ram_slot_pinned(converted):
    """A wave that fails after the host took its experts: the job is waited for and its slots unpinned."""
    engine = _engine(converted, 2, 3, io_threads=1, cpu_experts="1")
    with engine:
        engine.generate(PROMPT, max_tokens=2, temperature=0)  # RAM holds records now
        store, real = engine.model.experts, engine.model.experts.load_waves

        def failing(layer, experts, prefetch=None, host=()):
            yield from ()
            raise OSError("the disk went away")

        store.load_waves = failing
        with pytest.raises(OSError, match="went away"):
            engine.generate(PROMPT, max_tokens=2, temperature=0)
        store.load_waves = real
        assert store.counters.host_computed > 0 and not any(store.ram_pool.pins)


def test_a_share_without_a_compiler_fails_at_load(monkeypatch, converted):
    monkeypatch.setattr(host_moe, "available", lambda: False)
    monkeypatch.setattr(host_moe, "why_unavailable", lambda: "no C compiler (cc) on PATH")
    layout = Manifest.read(converted).record
    with pytest.raises(ConfigError, match="--cpu-experts 0.5: the CPU kernel cannot be built here .*give off"):
        probes.host_share("0.5", layout, torch.device("cpu"))
    assert "cannot be built" in probes.host_share("auto", layout, torch.device("cuda")).describe()
