"""Benchmark of long prompts on the GPU machine (docs/BENCHMARKS.md): the bench model's time to first token at the
whole model's share of a machine's budgets under a routing trace, measured beside the store's simulation of the same
plan, trace rows and links (simulate_prefill, the projection's), and its resident prefill (every record on the device)
in tokens/s and as a share of the GPU's dense BF16 peak.

    python scripts/bench_prefill.py MODEL --routing TRACE --ceilings DOCTOR.json [--streamed 2048,8192]
        [--resident 8192,32768] [--machine 16g] [--family v3] [--out DIR]

MODEL is scripts/bench_model.py's (DeepSeek-V3 widths, a few layers). The simulation's compute is the resident
prefill's measured rate (FLOP/s over the prompt's FLOPs: the weights' and attention's, the family's attention_flops)
at the same prompt length, so the check isolates the store: its reads, copies and their overlap with compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `dsfp4` itself sets

import numpy as np
import torch

from dsfp4.layout.manifest import Manifest
from dsfp4.layout.routing_trace import read_trace
from dsfp4.projection.bench_check import whole_model_share
from dsfp4.projection.first_token import WAVE_HOST_S
from dsfp4.projection.simulate import Links, Projection, StepCosts
from dsfp4.projection.simulate_prefill import simulate_prefill
from dsfp4.projection.whole_model import host_stream, n_moe_layers, spread, step_flops
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.load import plan_engine
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.counters import disk_rate
from dsfp4.tools.doctor import Ceilings

# NVIDIA's dense BF16 tensor peak of the H100 SXM and the H200 (the same chip's)
HOPPER_BF16 = 989.4e12
# context beyond the prompt
SLACK = 16


def prompt_flops(m: Manifest, n: int) -> tuple[float, np.ndarray]:
    """A prompt of n tokens from position 0: (its weights' FLOPs, its attention's FLOPs at each position [n])."""
    attn, experts, other = step_flops(m)
    weights = n * (n_moe_layers(m) * (attn + experts) + other)
    a = m.args
    return weights, np.array([a.family_spec.attention_flops(a, i) for i in range(n)])


def prefill(engine: Engine, n: int, vocab: int) -> dict:
    """One prompt of n tokens (ids from the vocabulary; a trace routes them) -> its stats: TTFT, store counters."""
    ids = [10 + i % (vocab - 20) for i in range(n)]
    g = engine.generate(ids, max_tokens=1, temperature=0)
    s = g.stats
    return {"prefill_s": s.prefill_s, "ttft_s": s.ttft_s, "store": s.store}


def resident(model: Path, trace: Path, n: int, chunk: int, m: Manifest, peak: float, device: str) -> dict:
    """The bench model with every record on the device: a short warm-up, then the prompt of n tokens (a chunk through
    every block after another, the decoder's order where every record is resident)."""
    budgets = {"preset": "80g"} if device == "cuda" else {}
    options = RunOptions(device=device, max_context=n + SLACK, routing=trace, prefill_chunk=chunk, **budgets)
    with Engine(model, options) as engine:
        prefill(engine, min(n, 2 * chunk), m.args.vocab_size)
        r = prefill(engine, n, m.args.vocab_size)
    weights, context = prompt_flops(m, n)
    flops = weights + float(context.sum())
    r |= {"tokens": n, "tok_s": n / r["prefill_s"], "tflop_s": flops / r["prefill_s"] / 1e12}
    r["share_of_peak"] = flops / r["prefill_s"] / peak
    r |= {"weights_flops": weights, "attention_flops": float(context.sum())}
    r["expansion_flops"] = expansion_flops(m, n, chunk)
    return r


def expansion_flops(m: Manifest, n: int, attend: int) -> float:
    """FLOPs of expanding the cached keys for a prompt of n tokens from position 0, attend tokens a call."""
    a = m.args
    return sum(min(i + attend, n) for i in range(0, n, attend)) * a.family_spec.key_expansion_flops(a)


def streamed(
    model: Path, trace: Path, n: int, chunk: int, m: Manifest, machine: str, family: str, c: Ceilings, rate: float
) -> dict:
    """The bench model at the whole model's share of `machine`, the prompt of n tokens from cold tiers, measured and
    simulated (compute at `rate` FLOP/s, the resident prefill's)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = RunOptions(device=device, max_context=n + SLACK, routing=trace, prefill_chunk=chunk)
    plan = whole_model_share(plan_engine(model, options), m, family, machine)
    with Engine(model, options, plan=plan) as engine:
        r = prefill(engine, n, m.args.vocab_size)
    ids = spread(read_trace(trace).ids, n_moe_layers(m))
    rows = ids[np.arange(n) % len(ids)]  # [n, L, K]: the trace's rows from the cursor's start, wrapping
    attn, experts, other = step_flops(m)
    _, context = prompt_flops(m, n)
    costs = StepCosts(attn / rate, experts / rate, other / rate, wave_s=WAVE_HOST_S)
    links = Links(c.random_read_gbps * 1e9, c.pinned_h2d_gbps * 1e9)

    def simulated(disk: Links) -> Projection:
        return simulate_prefill(
            rows,
            plan.gpu_slots,
            plan.ram_slots,
            m.record.nbytes,
            disk,
            costs,
            chunk,
            options.policy,
            host=host_stream(m, plan),
            group=plan.prefill_group,
            context_s=context / n_moe_layers(m) / rate,
        )

    sim = simulated(links)
    s = r["store"]
    # the disk as this run found it, beside the doctor's
    run_disk = disk_rate(s.get("ssd_bytes", 0), s.get("ssd_read_s", 0), options.io_threads)
    at_run = simulated(dataclasses.replace(links, ssd=run_disk)) if run_disk else None
    records = n_moe_layers(m) * m.args.n_routed_experts
    return r | {
        "tokens": n,
        "machine": machine,
        "gpu_slots": plan.gpu_slots,
        "ram_slots": plan.ram_slots,
        "prefill_group": plan.prefill_group,
        "simulated_s": sim.seconds,
        "error": sim.seconds / r["prefill_s"] - 1,
        "run_disk_gbps": run_disk / 1e9,
        "simulated_at_run_disk_s": at_run.seconds if at_run else None,
        "error_at_run_disk": at_run.seconds / r["prefill_s"] - 1 if at_run else None,
        "ssd_reads_per_record": s.get("ssd_reads", 0) / records,
        "simulated_ssd_reads_per_record": sim.ssd_bytes / m.record.nbytes / records,
        "simulation": sim.to_dict(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--routing", type=Path, required=True)
    p.add_argument("--ceilings", type=Path, required=True, help="the doctor's JSON")
    p.add_argument("--streamed", default="2048,8192", help="prompt lengths at the machine's share")
    p.add_argument("--resident", default="8192,32768", help="prompt lengths with every record on the device")
    p.add_argument("--machine", default="16g")
    p.add_argument("--family", default="v3")
    p.add_argument("--chunk", type=int, default=RunOptions.prefill_chunk)
    p.add_argument("--peak", type=float, default=HOPPER_BF16, help="the GPU's dense BF16 FLOP/s")
    p.add_argument("--out", type=Path, default=Path("bench_prefill"))
    p.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (a tiny model; its figures mean nothing)")
    p.add_argument(
        "--absorbed",
        action="store_true",
        help="resident prefill only, its attention in the absorbed form at every chunk size (as before the "
        "decompressed form: the 'before' of a before and after)",
    )
    a = p.parse_args()
    if a.absorbed:
        from dsfp4.runtime.models.v3 import attention

        attention.DECOMPRESS_TOKENS = 1 << 30
        a.streamed = ""
    if not (torch.cuda.is_available() or a.cpu):
        sys.exit("bench_prefill.py: needs a CUDA GPU (or --cpu for a smoke run)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m, c = Manifest.read(a.model), Ceilings.from_dict(json.loads(a.ceilings.read_text()))
    streamed_n, resident_n = _lengths(a.streamed), _lengths(a.resident)
    res = {n: resident(a.model, a.routing, n, a.chunk, m, a.peak, device) for n in sorted({*resident_n, *streamed_n})}
    rows = []
    for n in streamed_n:
        rate = res[n]["tflop_s"] * 1e12
        rows.append(streamed(a.model, a.routing, n, a.chunk, m, a.machine, a.family, c, rate))
    a.out.mkdir(parents=True, exist_ok=True)
    out = {"resident": list(res.values()), "streamed": rows}
    (a.out / "bench_prefill.json").write_text(json.dumps(out, indent=1))
    print("resident: tokens  prefill s  tok/s  TFLOP/s  share of BF16 peak")
    for r in res.values():
        rate = f"{r['tok_s']:6.0f}  {r['tflop_s']:7.1f}  {r['share_of_peak']:.1%}"
        print(f"  {r['tokens']:>6}  {r['prefill_s']:9.3f}  {rate}")
    print(
        f"streamed at {a.machine}'s share: tokens  slots gpu/ram  group  TTFT s  simulated s  error  SSD reads/record"
        "  at the run's disk: GB/s  simulated s  error"
    )
    for r in rows:
        at_run = (
            f"  {r['run_disk_gbps']:.2f}  {r['simulated_at_run_disk_s']:.2f}  {r['error_at_run_disk']:+.1%}"
            if r["simulated_at_run_disk_s"] is not None
            else "  -"
        )
        print(
            f"  {r['tokens']:>6}  {r['gpu_slots']}/{r['ram_slots']}  {r['prefill_group']}  {r['prefill_s']:.2f}  "
            f"{r['simulated_s']:.2f}  {r['error']:+.1%}  {r['ssd_reads_per_record']:.2f} "
            f"(simulated {r['simulated_ssd_reads_per_record']:.2f}){at_run}"
        )


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


if __name__ == "__main__":
    main()
