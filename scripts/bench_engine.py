"""Engine lifecycle on the GPU machine (docs/BENCHMARKS.md): create an Engine, generate, close it, 20 times,
and watch whether device memory (torch's and the driver's view) or the process's RSS (which holds the
pinned RAM cache) grows.

    python scripts/bench_engine.py WORKDIR [--layers 3] [--cycles 20] [--gpu-mem 8G] [--cpu-mem 24G]

The model is scripts/bench_model.py's (DeepSeek-V3 dimensions, random NVFP4 experts, a small BPE tokenizer);
the RAM budget makes the pinned record cache several GB, so a cache left behind would show at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `dsfp4` itself sets

import torch

from dsfp4 import Engine, RunOptions
from dsfp4.runtime.plan.budget import process_rss
from dsfp4.synthetic.bench_model import bench_model_at
from dsfp4.tools.ceilings import model_ceilings as ceilings
from dsfp4.units import format_bytes

DEV = torch.device("cuda")


def snapshot() -> dict[str, int]:
    free, total = torch.cuda.mem_get_info(DEV)
    return {
        "allocated": torch.cuda.memory_allocated(DEV),
        "reserved": torch.cuda.memory_reserved(DEV),
        "driver_used": total - free,  # everything on the device, torch's cache or not
        "rss": process_rss(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--gpu-mem", default="8G")
    ap.add_argument("--cpu-mem", default="24G")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    path = a.workdir / "model"
    limits = ceilings(path, bench_model_at(path, n_layers=a.layers, with_tokenizer=True))
    options = RunOptions(device="cuda", max_context=1024, gpu_mem=a.gpu_mem, cpu_mem=a.cpu_mem, io_threads=8)
    torch.cuda.init()
    rows, tokens = [{"cycle": 0, **snapshot()}], None
    for cycle in range(1, a.cycles + 1):
        t0 = time.perf_counter()
        engine = Engine(path, options)
        t1 = time.perf_counter()
        loaded, plan = snapshot(), engine.plan
        g = engine.generate("Which experts are hot?", max_tokens=8, temperature=0)
        t2 = time.perf_counter()
        engine.close()
        t3 = time.perf_counter()
        assert tokens is None or g.token_ids == tokens, "the same greedy tokens every cycle"
        tokens = g.token_ids
        rows.append(
            {
                "cycle": cycle,
                **snapshot(),
                "loaded_rss": loaded["rss"],
                "loaded_driver_used": loaded["driver_used"],
                "create_s": t1 - t0,
                "generate_s": t2 - t1,
                "close_s": t3 - t2,
                "gpu_slots": plan.gpu_slots,
                "ram_slots": plan.ram_slots,
                "ssd_bytes": g.stats.store.get("ssd_bytes", 0),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_engine.json").write_text(json.dumps({"rows": rows, "tokens": tokens, "ceilings": limits}, indent=1))
    first, last = rows[1], rows[-1]
    print(f"\n{'after close':<14}{'allocated':>12}{'reserved':>12}{'driver used':>13}{'RSS':>12}")
    for r in (rows[0], first, rows[len(rows) // 2], last):
        print(
            f"cycle {r['cycle']:<8}{format_bytes(r['allocated']):>12}{format_bytes(r['reserved']):>12}"
            f"{format_bytes(r['driver_used']):>13}{format_bytes(r['rss']):>12}"
        )
    print(
        f"while loaded: RSS {format_bytes(first['loaded_rss'])}, device {format_bytes(first['loaded_driver_used'])}; "
        f"create {sum(r['create_s'] for r in rows[1:]) / a.cycles:.2f} s, close "
        f"{sum(r['close_s'] for r in rows[1:]) / a.cycles:.2f} s on average"
    )
    grow = {k: last[k] - first[k] for k in ("allocated", "reserved", "driver_used", "rss")}
    print("growth from cycle 1 to cycle", a.cycles, {k: format_bytes(v) for k, v in grow.items()})
    print("ceilings (GB/s):", {k: round(v, 2) for k, v in limits.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
