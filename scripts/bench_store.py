"""Benchmark of the expert store on the GPU machine (docs/BENCHMARKS.md): the machine's ceilings, then
SSD -> RAM and RAM -> GPU rates through the store, decode speed under budgets that emulate the 16g and
24g presets, and how much of the expert loading hides behind compute.

    python scripts/bench_store.py WORKDIR [--layers 5] [--tokens 24] [--out DIR]
    python scripts/bench_store.py WORKDIR --budget-check --gpu-mem 12G --cpu-mem 40G

The model is written by scripts/bench_model.py: DeepSeek-V3 dimensions, a few layers, random NVFP4
experts. Presets are emulated by giving this model the share of all experts that the planner gives
the full 61-layer V3 under that preset (the device tier and the RAM cache), so hit rates and bytes
per MoE layer match; seconds per token scale with the number of MoE layers (58 in V3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `dsfp4` itself sets

import torch

from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.projection.full_model import preset_shares
from dsfp4.runtime.models.load import load_model, plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.placement import warm_start
from dsfp4.synthetic.bench_model import bench_model_at
from dsfp4.tools.ceilings import model_ceilings

DEV = torch.device("cuda")
GB = 1e9


def decode(model, tokens: int, prompt: int = 8) -> dict:
    """Prefill a random prompt, then greedy-decode `tokens` tokens; store counters over the decode."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (1, prompt), device=DEV)
    store = model.experts
    with torch.inference_mode():
        logits = model(ids, 0, last_only=True)[0]
        torch.cuda.synchronize()
        before = store.counters.snapshot()
        t0 = time.perf_counter()
        for i in range(tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(nxt, prompt + i, last_only=True)[0]
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    s = {k: v - before[k] for k, v in store.counters.snapshot().items()}
    uses = max(s["expert_uses"], 1)
    return {
        "tok_s": tokens / dt,
        "ms_token": 1000 * dt / tokens,
        "gpu_hit": s["gpu_hits"] / uses,
        "ram_hit": s["ram_hits"] / uses,
        "ssd_miss": s["ssd_misses"] / uses,
        "ssd_gb_s": s["ssd_bytes"] / dt / GB,
        "ssd_bytes_token": s["ssd_bytes"] / tokens,
        "h2d_bytes_token": s["h2d_bytes"] / tokens,
        "stall_s": s["stall_s"],
        "decode_s": dt,
        "precision": s["predicted_used"] / s["predicted"] if s["predicted"] else 0.0,
        "recall": s["predicted_used"] / s["actual"] if s["actual"] else 0.0,
        "peak_reserved": torch.cuda.max_memory_reserved(DEV),
    }


def open_model(path: Path, manifest: Manifest, gpu_slots: int, ram_slots: int, **knobs):
    options = RunOptions(device="cuda", max_context=256, gpu_mem="70G", cpu_mem="100G", io_threads=8, **knobs)
    plan = plan_run(manifest, DEV, torch.bfloat16, 256, options, False)
    plan = dataclasses.replace(plan, gpu_slots=gpu_slots, ram_slots=ram_slots, staging=min(8, ram_slots))
    return load_model(path, DEV, torch.bfloat16, 256, manifest=manifest, options=options, plan=plan)


def warm_all(model, manifest: Manifest) -> float:
    """Warm start that fills the device slots, then RAM, with every record (file order): SSD -> RAM GB/s
    through the store."""
    store = model.experts
    counts = {layer: (1,) * manifest.args.n_routed_experts for layer in manifest.experts}
    warm_start(store, HotProfile("", 0, counts))
    return store.counters.ssd_bytes / store.warm_s / GB


def upload_rate(model, manifest: Manifest) -> float:
    """RAM -> device through the store's copy path: every record of one layer, in waves of the slots."""
    store, layer = model.experts, max(manifest.experts)  # the warm start put layer 1's first on the device
    n, waves = manifest.args.n_routed_experts, store.plan.gpu_slots
    torch.cuda.synchronize()
    before, t0 = store.counters.h2d_bytes, time.perf_counter()
    for start in range(0, n, waves):
        for _ in store.load(layer, list(range(start, min(start + waves, n)))):
            pass
    torch.cuda.synchronize()
    return (store.counters.h2d_bytes - before) / (time.perf_counter() - t0) / GB


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--budget-check", action="store_true")
    ap.add_argument("--gpu-mem", default="12G")
    ap.add_argument("--cpu-mem", default="40G")
    a = ap.parse_args()
    path = a.workdir / "model"
    if a.budget_check:
        return budget_check(path, a.gpu_mem, a.cpu_mem, a.tokens)
    t0 = time.perf_counter()
    manifest = bench_model_at(path, n_layers=a.layers)
    n_moe, n_rec = len(manifest.experts), len(manifest.experts) * manifest.args.n_routed_experts
    res: dict = {"write_s": time.perf_counter() - t0, "moe_layers": n_moe, "records": n_rec}
    res["ceilings"] = c = model_ceilings(path, manifest)
    shares = preset_shares()
    res["presets"] = {k: {"gpu_share": g, "ram_share": r, "plan": t} for k, (g, r, t) in shares.items()}
    runs = {}
    m = open_model(path, manifest, n_rec, n_rec)
    res["ssd_to_gpu_warm_gb_s"] = warm_all(m, manifest)
    runs["resident"] = decode(m, a.tokens)
    m.experts.close()
    for verify in (True, False):
        m = open_model(path, manifest, 16, n_rec, verify=verify)
        res[f"ssd_to_ram_gb_s_verify_{verify}"] = warm_all(m, manifest)
        if verify:
            res["h2d_store_gb_s"] = upload_rate(m, manifest)
            runs["ram_resident, 16 slots"] = decode(m, a.tokens)
            m.experts.close()
            m = open_model(path, manifest, 16, n_rec, prefetch=False)
            warm_all(m, manifest)
            runs["ram_resident, 16 slots, no prefetch"] = decode(m, a.tokens)
        m.experts.close()
    for preset, (g, r, _) in shares.items():
        gs, rs = max(int(g * n_rec), manifest.args.n_activated_experts), max(int(r * n_rec), 8)
        for policy, prefetch in (("mix", True), ("mix", False), ("lru", True)):
            m = open_model(path, manifest, gs, rs, policy=policy, prefetch=prefetch)
            decode(m, 4)  # warm the caches a little, as a running chat would be
            runs[f"{preset} ({gs} dev, {rs} RAM slots), {policy}, prefetch {prefetch}"] = decode(m, a.tokens)
            m.experts.close()
    compute = runs["resident"]["decode_s"] / a.tokens
    for r in runs.values():
        load = r["ssd_bytes_token"] / GB / c["odirect_gb_s"] + r["h2d_bytes_token"] / GB / c["h2d_gb_s"]
        extra = r["decode_s"] / a.tokens - compute
        r["hidden_share"] = 1 - extra / load if load > 0 else 1.0
        r["ms_per_moe_layer"] = r["ms_token"] / n_moe
    res["runs"] = runs
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_store.json").write_text(json.dumps(res, indent=1))
    print(f"ceilings: HBM {c['hbm_gb_s']:.0f} GB/s, pinned H2D {c['h2d_gb_s']:.1f} GB/s, ", end="")
    print(f"O_DIRECT {c['odirect_gb_s']:.2f} GB/s")
    print(
        f"store: SSD->RAM {res['ssd_to_ram_gb_s_verify_True']:.2f} GB/s (verify), "
        f"{res['ssd_to_ram_gb_s_verify_False']:.2f} GB/s (--no-verify); RAM->GPU {res['h2d_store_gb_s']:.1f} GB/s"
    )
    for k, v in res["presets"].items():
        print(f"preset {k}: full V3 gets {v['gpu_share']:.2%} of experts on the device, {v['ram_share']:.1%} in RAM")
    cols = ("tok/s", "ms/MoE", "dev%", "RAM%", "SSD%", "SSD GB/s", "hidden", "P/R")
    print(f"{'run':<58} " + " ".join(f"{h:>8}" for h in cols))
    for k, r in runs.items():
        print(
            f"{k:<58} {r['tok_s']:8.2f} {r['ms_per_moe_layer']:8.2f} {r['gpu_hit']:8.0%} {r['ram_hit']:8.0%} "
            f"{r['ssd_miss']:8.0%} {r['ssd_gb_s']:8.2f} {r['hidden_share']:8.0%} "
            f"{r['precision']:.0%}/{r['recall']:.0%}"
        )
    return 0


def budget_check(path: Path, gpu_mem: str, cpu_mem: str, tokens: int) -> int:
    """Open through the planner with these budgets, decode, and compare the peaks with the budgets."""
    from dsfp4.runtime.plan.budget import parse_size, peak_memory

    options = RunOptions(device="cuda", max_context=4096, gpu_mem=gpu_mem, cpu_mem=cpu_mem)
    torch.cuda.reset_peak_memory_stats(DEV)
    model = load_model(path, DEV, torch.bfloat16, 4096, options=options)
    print(model.experts.plan.table())
    decode(model, tokens, prompt=512)
    gpu, rss = peak_memory(DEV)
    g, c = parse_size(gpu_mem, "--gpu-mem"), parse_size(cpu_mem, "--cpu-mem")
    print(
        f"peak device (max reserved) {gpu / 2**30:.2f} GiB of {g / 2**30:.2f}; max allocated "
        f"{torch.cuda.max_memory_allocated(DEV) / 2**30:.2f} GiB; peak RSS {rss / 2**30:.2f} GiB of {c / 2**30:.2f}"
    )
    model.experts.close()
    return 0 if gpu <= g and rss <= c else 1


if __name__ == "__main__":
    sys.exit(main())
