"""A whole decode step of the bench model with every weight resident on the GPU (docs/BENCHMARKS.md): the
time of one token through every layer and the head, by CUDA-graph replay and by eager launches, against
the bytes a step must read divided by the HBM read ceiling measured in the same run.

    python scripts/bench_step.py WORKDIR [--layers 5] [--dense 1] [--steps 64] [--gpu-mem 76G] [--out DIR]

With a --gpu-mem below the model's size the records that do not fit are read in place from pinned RAM
(zero-copy): the step then reads them over PCIe, and the floor above counts them at HBM speed.

The model is bench_model.py's (DeepSeek-V3 dimensions, random NVFP4 experts, FP8 backbone, bf16 head).
Bytes per step: every backbone matrix in its stored format (the embedding: one row; routers: fp32, as the
runtime holds them), plus top-k expert records per MoE layer. Also reports end-to-end decode tok/s of
Engine.generate (sampling and detokenizing included) with and without graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from dsfp4 import Engine, RunOptions
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.plan.planner import expert_layers, token_bytes
from dsfp4.synthetic.bench_model import bench_model_at
from dsfp4.tools.ceilings import gpu_ceilings

PROMPT = "Count the ways a decode step can waste memory bandwidth"


def step_bytes(m: Manifest) -> int:
    """Bytes one decode step reads (weights only; the KV cache of a short context is noise)."""
    backbone, record = token_bytes(m)
    return backbone + len(expert_layers(m)) * m.args.n_activated_experts * record


def time_steps(engine: Engine, steps: int, graph: bool, warm: bool = True) -> float:
    """Seconds per decode step after the engine's cached prompt: graph replays or eager forwards. warm: run every
    position once untimed first, so that no kernel variant compiles inside the timing (a fresh machine's Triton
    cache is empty)."""
    model, pos, token = engine.model, len(engine.cached), engine.cached[-1]
    tokens = torch.tensor([[token]], device=engine.device)

    def one(i: int) -> None:
        if graph:
            engine.decoder.graphs.step(token, pos + i)
        else:
            model(tokens, pos + i, last_only=True)

    with torch.inference_mode():
        for i in range(steps if warm else 0):
            one(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            one(i)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def profile_step(engine: Engine, steps: int) -> list[tuple[str, float, int]]:
    """Device time per step of each kernel (name, us, launches per step) over `steps` eager steps (the
    graph replays the same kernels), every kernel, longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_steps(engine, steps, graph=False, warm=False)  # main() has run these positions: per step = / steps
    rows = [(e.key[:90], e.device_time_total / steps, e.count // steps) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--dense", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--profile", action="store_true", help="also print the kernels of a step by device time")
    ap.add_argument("--gpu-mem", default="76G", help="device budget (below the model: zero-copy)")
    a = ap.parse_args()
    path = a.workdir / "model"
    manifest = bench_model_at(path, n_layers=a.layers, n_dense=a.dense, with_tokenizer=True)
    lim = gpu_ceilings()
    nbytes = step_bytes(manifest)
    floor = nbytes / (lim["hbm_read_gbps"] * 1e9)
    res = {"ceilings": lim, "step_bytes": nbytes, "floor_ms": floor * 1e3, "layers": a.layers, "dense": a.dense}
    options = RunOptions(device="cuda", max_context=1024, gpu_mem=a.gpu_mem, cpu_mem="64G", io_threads=8)
    t0 = time.perf_counter()
    with Engine(path, options) as engine:
        res["load_s"] = time.perf_counter() - t0
        res["decode_mode"] = engine.decode_mode
        res["gpu_slots"], res["total_records"] = engine.plan.gpu_slots, engine.plan.total_records
        engine.generate(PROMPT, max_tokens=1, temperature=0)  # the prompt is cached; steps follow it
        for graph in (True, False):
            s = time_steps(engine, a.steps, graph)
            res["graph_ms" if graph else "eager_ms"] = s * 1e3
        if a.profile:
            res["kernels"] = profile_step(engine, a.steps)
        for graph in (True, False):
            engine.decoder.graphs = engine.decoder.graphs if graph else None
            g = engine.generate(PROMPT + " again", max_tokens=a.steps, temperature=0)
            res["generate_graph_tok_s" if graph else "generate_eager_tok_s"] = g.stats.decode_tok_s
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_step.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    for name, us, n in res.get("kernels", [])[:40]:
        print(f"{us:9.1f} us  x{n:<4} {name}")
    for key in ("graph_ms", "eager_ms"):
        print(f"{key}: {res[key]:.3f} ms = {res[key] / res['floor_ms']:.2f}x the floor of {res['floor_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
