"""Benchmark of `dsfp4 profile-hot` on the GPU machine (docs/BENCHMARKS.md): the layer-wise pass against
ordinary prefill of the same sequences under the same budgets, then the warm start before and after a
hot-first repack, and the repack itself.

    python scripts/bench_profile.py WORKDIR [--layers 5] [--tokens 8192] [--gpu-mem 16G] [--cpu-mem 16G]

The model is scripts/bench_model.py's (DeepSeek-V3 dimensions, random NVFP4 experts, a small BPE
tokenizer), so routing is near-uniform: the numbers measure the mechanics (bytes read, read pattern,
seconds), not a real model's skew. The warm start's budgets emulate the 16g preset's share of the full V3.
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

from dsfp4.layout.direct_io import RecordFile
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.repack import repack
from dsfp4.projection.full_model import preset_shares
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.budget import peak_memory
from dsfp4.runtime.profile.calibration import calibration
from dsfp4.runtime.profile.profiler import profile_model
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.placement import warm_start
from dsfp4.synthetic.bench_model import bench_model_at
from dsfp4.tools.ceilings import model_ceilings as ceilings
from dsfp4.tools.ceilings import odirect_write_gbps

READS: list[int] = []  # bytes of each RecordFile.read_into call

DEV = torch.device("cuda")
GB = 1e9


def _count_reads() -> None:
    real = RecordFile.read_into

    def spy(self, bufs, offset):
        READS.append(sum(len(b) for b in bufs))
        return real(self, bufs, offset)

    RecordFile.read_into = spy


def _answer(path: Path, options: RunOptions) -> list[int]:
    with Engine(path, options) as engine:
        return engine.generate("Which experts are hot?", max_tokens=16, temperature=0).token_ids


def per_sequence(path: Path, options: RunOptions, sequences: list[list[int]]) -> dict:
    """Ordinary prefill of each sequence (as `dsfp4 run` would), under the same budgets."""
    engine = Engine(path, dataclasses.replace(options, max_context=options.max_context + 1))
    store = engine.model.experts
    before, t0 = store.counters.snapshot(), time.perf_counter()
    for seq in sequences:
        engine.reset()
        engine.generate(seq, max_tokens=1, temperature=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    c = {k: v - before[k] for k, v in store.counters.snapshot().items()}
    engine.close()
    return {
        "seconds": dt,
        "ssd_reads": c["ssd_reads"],
        "ssd_bytes": c["ssd_bytes"],
        "tok_s": sum(map(len, sequences)) / dt,
    }


def warm(path: Path, profile: HotProfile, gpu_slots: int, ram_slots: int) -> dict:
    manifest = Manifest.read(path)
    plan = plan_run(manifest, DEV, torch.bfloat16, 4096, RunOptions(device="cuda", io_threads=8), False)
    plan = dataclasses.replace(plan, gpu_slots=gpu_slots, ram_slots=ram_slots, staging=8)
    store = ExpertStore(path, manifest, DEV, plan, io_threads=8)
    READS.clear()
    warm_start(store, profile)
    c, seconds, records = store.counters, store.warm_s, store.warm_records
    store.close()
    return {"seconds": seconds, "records": records, "reads": len(READS), "gb_s": c.ssd_bytes / seconds / GB}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--gpu-mem", default="16G")
    ap.add_argument("--cpu-mem", default="16G")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    path = a.workdir / "model"
    t0 = time.perf_counter()
    manifest = bench_model_at(path, n_layers=a.layers, with_tokenizer=True)
    n_rec = len(manifest.experts) * manifest.args.n_routed_experts
    res: dict = {"write_s": time.perf_counter() - t0, "records": n_rec, "record_bytes": manifest.record.nbytes}
    res["ceilings"] = c = ceilings(path, manifest)
    c["odirect_write_gb_s"] = odirect_write_gbps(path / "experts")
    _count_reads()
    options = RunOptions(
        device="cuda", max_context=2048, prefill_chunk=2048, gpu_mem=a.gpu_mem, cpu_mem=a.cpu_mem, io_threads=8
    )
    torch.cuda.reset_peak_memory_stats(DEV)
    READS.clear()
    run = profile_model(path, options, None, False, a.tokens)
    gpu_peak, rss_peak = peak_memory(DEV)
    p = run.counters
    res["layer_wise"] = {
        "seconds": run.seconds,
        "tokens": run.profile.tokens,
        "ssd_reads": p["ssd_reads"],
        "ssd_bytes": p["ssd_bytes"],
        "read_calls": len(READS),
        "gpu_slots": run.plan.gpu_slots,
        "ram_slots": run.plan.ram_slots,
        "peak_gpu": gpu_peak,
        "peak_rss": rss_peak,
        "notes": run.notes,
    }
    sequences = calibration(ChatTokenizer(path), None, False, a.tokens, options.max_context).sequences
    res["per_sequence"] = per_sequence(path, options, sequences)
    before = _answer(path, options)
    run.profile.write(path / HOT_NAME)
    g, r, _ = preset_shares()["16g"]
    gs, rs = max(int(g * n_rec), 8), max(int(r * n_rec), 8)
    res["warm_before"] = warm(path, run.profile, gs, rs)
    rp = repack(path, run.profile)
    ideal = rp.nbytes / GB / c["odirect_gb_s"] + rp.nbytes / GB / c["odirect_write_gb_s"]  # read, then write
    res["repack"] = {"seconds": rp.seconds, "bytes": rp.nbytes, "gb_s": rp.nbytes / rp.seconds / GB, "ideal_s": ideal}
    res["warm_after"] = warm(path, run.profile, gs, rs)
    res["same_tokens_after_repack"] = _answer(path, options) == before
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_profile.json").write_text(json.dumps(res, indent=1))

    lw, ps = res["layer_wise"], res["per_sequence"]
    print(
        f"ceilings: HBM {c['hbm_gb_s']:.0f} GB/s, pinned H2D {c['h2d_gb_s']:.1f} GB/s, "
        f"O_DIRECT read {c['odirect_gb_s']:.2f} GB/s, write {c['odirect_write_gb_s']:.2f} GB/s"
    )
    print(
        f"model: {n_rec} records of {manifest.record.nbytes / 2**20:.2f} MiB; budgets {a.gpu_mem} / {a.cpu_mem}: "
        f"{lw['gpu_slots']} device slots, {lw['ram_slots']} RAM slots; {len(sequences)} sequences, "
        f"{lw['tokens']} tokens"
    )
    print(f"{'pass':<34} {'seconds':>8} {'records read':>13} {'GB read':>8} {'GB/s':>6} {'of O_DIRECT':>11}")
    for name, d in (("layer-wise (profile-hot)", lw), ("per sequence (ordinary prefill)", ps)):
        gbs = d["ssd_bytes"] / d["seconds"] / GB
        print(
            f"{name:<34} {d['seconds']:8.1f} {int(d['ssd_reads']):13d} {d['ssd_bytes'] / GB:8.1f} {gbs:6.2f} "
            f"{gbs / c['odirect_gb_s']:11.0%}"
        )
    print(
        f"layer-wise peaks: device {gpu_peak / 2**30:.2f} GiB (budget {a.gpu_mem}), RSS {rss_peak / 2**30:.2f} GiB "
        f"(budget {a.cpu_mem}); read calls {lw['read_calls']}"
    )
    for name in ("warm_before", "warm_after"):
        w = res[name]
        print(
            f"{name:<12} {w['records']} records ({gs} device, {rs} RAM) in {w['reads']} reads, {w['seconds']:.2f} s, "
            f"{w['gb_s']:.2f} GB/s ({w['gb_s'] / c['odirect_gb_s']:.0%} of O_DIRECT)"
        )
    rp_ = res["repack"]
    print(
        f"repack: {rp_['bytes'] / GB:.1f} GB in {rp_['seconds']:.1f} s ({rp_['gb_s']:.2f} GB/s); reading then "
        f"writing it at the ceilings takes {rp_['ideal_s']:.1f} s ({rp_['ideal_s'] / rp_['seconds']:.0%} of that "
        f"pace); same tokens after: {res['same_tokens_after_repack']}"
    )
    return 0 if res["same_tokens_after_repack"] else 1


if __name__ == "__main__":
    sys.exit(main())
