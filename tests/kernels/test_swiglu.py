"""The experts' activation: silu(gate) * up, and DeepSeek-V4's clamp."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsfp4.kernels.swiglu import swiglu


def test_swiglu_without_a_limit_is_silu_times_up():
    gate, up = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0)) * 20
    assert torch.equal(swiglu(gate, up), F.silu(gate) * up)


def test_swiglu_clamps_gate_above_and_up_both_ways_before_the_product():
    gate = torch.tensor([-30.0, -2.0, 3.0, 12.0, 50.0])
    up = torch.tensor([-50.0, 11.0, -3.0, 9.0, -10.5])
    got = swiglu(gate, up, 10.0)
    want = F.silu(torch.tensor([-30.0, -2.0, 3.0, 10.0, 10.0])) * torch.tensor([-10.0, 10.0, -3.0, 9.0, -10.0])
    assert torch.equal(got, want)
