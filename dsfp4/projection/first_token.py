"""The whole model's time to first token, projected as whole_model.py projects its decode: the trace's rows after
the profile's are the prompt, prefilled in chunks as `dsfp4 run` prefills (simulate.py simulate_prefill) through the
plan's pools warm from the trace's first half; its compute is the prompt's FLOPs at PREFILL_SHARE of the user's GPU's
dense BF16 peak (what our prefill reached on the H100), attention's scores left out (under 10% of a V3 layer's FLOPs
at 2,048 tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsfp4.layout.manifest import Manifest
from dsfp4.projection.machines import MACHINES, Machine
from dsfp4.projection.simulate import Projection, StepCosts, simulate_prefill
from dsfp4.projection.whole_model import (
    HOST_S,
    PREFILL_CHUNK,
    columns,
    full_plan,
    host_stream,
    n_moe_layers,
    spread,
    step_flops,
    warm_order,
)
from dsfp4.runtime.options import RunOptions

# the share of a GPU's peak the projected prefill runs at: our prefill MoE's TFLOP/s at 4,096 tokens on the H100
# over the H100 SXM's dense BF16 peak (docs/BENCHMARKS.md, 2026-11-23)
PREFILL_SHARE = 310.5 / 989.4
# prompt tokens the time to first token is projected for
PROMPTS = (64, 512, 2048)


def prefill_costs(m: Manifest, machine: Machine) -> StepCosts:
    """A prompt token's compute on the machine's GPU at PREFILL_SHARE of its peak."""
    rate = machine.flops * PREFILL_SHARE
    attn, experts, other = step_flops(m)
    return StepCosts(attn / rate, experts / rate, other / rate, HOST_S)


@dataclass(frozen=True)
class FirstToken:
    machine: str
    # tokens
    prompt: int
    # the prompt's totals; seconds: the time to its first token
    projection: Projection

    def to_dict(self) -> dict:
        return {"machine": self.machine, "prompt": self.prompt, **self.projection.to_dict()}


def first_tokens(family: str, ids: np.ndarray, machines: list[str], prompts: tuple[int, ...] = PROMPTS) -> list:
    """The whole model's time to first token on each machine for prompts of each length: the trace's rows after its
    first half (wrapping around, as --routing does), prefilled through the plan's pools warm from that half."""
    rows = []
    for name in machines:
        machine = MACHINES[name]
        m, plan = full_plan(family, machine)
        trace = spread(ids, n_moe_layers(m))
        half = len(trace) // 2
        warm = warm_order(trace[:half], m.args.n_routed_experts)
        costs = prefill_costs(m, machine)
        for n in prompts:
            prompt = trace[(half + np.arange(n)) % len(trace)]  # [n, L, K]
            p = simulate_prefill(
                prompt,
                plan.gpu_slots,
                plan.ram_slots,
                m.record.nbytes,
                machine.links,
                costs,
                PREFILL_CHUNK,
                RunOptions.policy,
                warm,
                host_stream(m, plan),
            )
            rows.append(FirstToken(name, n, p))
    return rows


def first_token_table(rows: list[FirstToken]) -> str:
    head = ("machine", "prompt", "TTFT s", "compute s", "SSD GB", "PCIe GB", "device %", "RAM %", "SSD %")
    lines = [head]
    for r in rows:
        p = r.projection
        uses = max(p.uses, 1)
        lines.append(
            (
                r.machine,
                str(r.prompt),
                f"{p.seconds:.1f}",
                f"{p.compute_s:.1f}",
                f"{p.ssd_bytes / 1e9:.1f}",
                f"{p.pcie_bytes / 1e9:.1f}",
                f"{100 * p.device_hits / uses:.1f}",
                f"{100 * p.ram_hits / uses:.1f}",
                f"{100 * p.ssd_misses / uses:.1f}",
            )
        )
    return columns(lines, left=1)
