"""The whole model's time to first token, projected as whole_model.py projects its decode: the trace's rows after
the profile's are the prompt, prefilled as `dsfp4 run` prefills it (simulate.py simulate_prefill: layer by layer, the
feed-forward over the plan's prefill_group tokens at once) through the pools of a plan for the prompt and an answer,
warm from the trace's first half; its compute is the prompt's FLOPs on the user's GPU's dense BF16 peak: the routed
experts' at the share our prefill kernel reached on the H100 with as many rows an expert as the runtime's wave calls
give it (wave_rows, expert_share), the shared experts' at PREFILL_SHARE, the FP8 backbone's at its kernel path's share
(Machine.fp8_prefill), attention's against the positions before each token (the family's attention_flops,
layout/family.py) at ATTENTION_SHARE (what it reached on the H200), and bringing the cached keys to the attended form
once per attention call (key_expansion_flops) at PREFILL_SHARE."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsfp4.kernels.moe.waves import call_rows
from dsfp4.layout.manifest import Manifest
from dsfp4.projection.machines import MACHINES, Machine
from dsfp4.projection.simulate import Projection, StepCosts
from dsfp4.projection.simulate_prefill import simulate_prefill
from dsfp4.projection.whole_model import (
    HOST_S,
    MAX_CONTEXT,
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
from dsfp4.runtime.store.waves import wave_size

# the share of a GPU's peak the projected prefill runs at: our prefill MoE's TFLOP/s at 4,096 tokens on the H100
# over the H100 SXM's dense BF16 peak (docs/BENCHMARKS.md, 2026-11-23)
PREFILL_SHARE = 310.5 / 989.4
# the routed experts' prefill kernel by the rows an expert has in one call: (rows, TFLOP/s over the H100 SXM's peak);
# NVFP4, 256 experts of V3's shapes, uniform top-8 routing of 512 to 4,096 tokens (bench_kernels, docs/BENCHMARKS.md
# 2026-11-23, run 57); the kernel's tiles stop growing at 128 rows, and PREFILL_SHARE is that figure
EXPERT_ROW_SHARES = ((16, 90.3 / 989.4), (32, 155.2 / 989.4), (64, 251.8 / 989.4), (128, PREFILL_SHARE))
# the share attention against earlier positions runs at (its decompressed FLOPs over the peak, the keys' expansion
# apart): fitted to layer-by-layer resident prefills of 32,768 tokens on the H200 (the users' order), the weights at
# their kernels' profiled time, the expansion at PREFILL_SHARE, the hidden states' crossings at the link's rate
# (docs/BENCHMARKS.md, 2026-12-02, a 32k prefill profiled)
ATTENTION_SHARE = 0.38
# the host's time to plan and queue a compacted prefill wave (kernels/moe/waves.py), beside the device's compute of
# the wave before: a 17-expert wave of 11,776 tokens in 3 runs on the H200 machine (docs/BENCHMARKS.md, 2026-12-04);
# an upper estimate for the 16 GB plan's waves of 8, in 1-2 runs
WAVE_HOST_S = 4.5e-3
# prompt tokens the time to first token is projected for
PROMPTS = (64, 512, 2048, 8192, 32768)
# the context a prompt's plan holds beyond it: room for an answer
ANSWER_TOKENS = 1024


def expert_share(rows: float) -> float:
    """The routed experts' prefill kernel's share of the peak at `rows` rows an expert a call (EXPERT_ROW_SHARES,
    interpolated in log rows, flat outside them)."""
    xs, ys = zip(*EXPERT_ROW_SHARES, strict=True)
    return float(np.interp(np.log2(max(rows, 1.0)), np.log2(xs), ys))


def wave_rows(m: Manifest, prompt: int, group: int, chunk: int, slots: int) -> float:
    """Rows an expert has in a routed-kernel call of a layer-wise prefill (kernels/moe/waves.py call_rows, the
    runtime's rule): a wave holds the store's wave_size of a layer's experts and the pairs of the group's tokens
    routed to them."""
    a = m.args
    k, experts, piece = a.n_activated_experts, a.n_routed_experts, min(prompt, chunk)
    present = min(wave_size(experts, slots), experts)
    pairs = min(prompt, group) * k * present / experts
    return call_rows(m.record, k, experts, piece, present, pairs, torch.bfloat16, False)[0]


def prefill_costs(m: Manifest, machine: Machine, rows: float = EXPERT_ROW_SHARES[-1][0]) -> StepCosts:
    """A prompt token's compute on the machine's GPU: the routed experts' at expert_share(rows) of its peak (`rows`
    an expert a kernel call), the shared experts' at PREFILL_SHARE, the FP8 backbone's (attention's matrices, the
    dense layers, the head) at its kernel path's share (Machine.fp8_prefill); and WAVE_HOST_S a compacted wave."""
    a, backbone_rate = m.args, machine.flops * machine.fp8_prefill
    attn, experts, other = step_flops(m)
    routed = a.n_activated_experts * 2.0 * 3 * a.dim * a.moe_inter_dim
    experts_s = routed / (machine.flops * expert_share(rows)) + (experts - routed) / (machine.flops * PREFILL_SHARE)
    return StepCosts(attn / backbone_rate, experts_s, other / backbone_rate, HOST_S, WAVE_HOST_S)


def context_seconds(m: Manifest, machine: Machine, n: int, attend: int = 0) -> np.ndarray:
    """[n] seconds of a prompt token's attention against the positions before it (position i), per MoE layer, the
    dense layers' share included, at ATTENTION_SHARE of the machine's peak; and its share of bringing the cached keys
    to the attended form (the family's key_expansion_flops), once per attention call of `attend` tokens (the plan's
    attention_group; 0: the whole prompt) for every position the call reads, a product at PREFILL_SHARE."""
    a = m.args
    flops = np.array([a.family_spec.attention_flops(a, i) for i in range(n)]) / ATTENTION_SHARE
    size = attend or n
    for first in range(0, n, size):
        last = min(first + size, n)
        flops[first:last] += last * a.family_spec.key_expansion_flops(a) / (last - first) / PREFILL_SHARE
    return flops / n_moe_layers(m) / machine.flops


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
        for n in prompts:
            m, plan = full_plan(family, machine, max_context=max(MAX_CONTEXT, n + ANSWER_TOKENS))
            trace = spread(ids, n_moe_layers(m))
            half = len(trace) // 2
            warm = warm_order(trace[:half], m.args.n_routed_experts)
            prompt = trace[(half + np.arange(n)) % len(trace)]  # [n, L, K]
            per_expert = wave_rows(m, n, plan.prefill_group, PREFILL_CHUNK, plan.gpu_slots)
            p = simulate_prefill(
                prompt,
                plan.gpu_slots,
                plan.ram_slots,
                m.record.nbytes,
                machine.links,
                prefill_costs(m, machine, per_expert),
                PREFILL_CHUNK,
                RunOptions.policy,
                warm,
                host_stream(m, plan),
                group=plan.prefill_group,
                context_s=context_seconds(m, machine, n, plan.attention_group),
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
