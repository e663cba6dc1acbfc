"""Where a decode token's time goes on the GPU: torch's profiler over the answer of Engine.generate after a
cached prompt, on any converted model (V3 or V4), every kernel by device time per token, and the launches
per token (an eager step is bound by them when its kernels are short).

    python scripts/profile_decode.py MODEL [--tokens 8] [--preset 24g] [--gpu-mem 6G --cpu-mem 8G] [--no-zero-copy]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dsfp4 import Engine, RunOptions

PROMPT = "Explain, step by step, why a model that does not fit in memory runs slowly"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--preset")
    ap.add_argument("--gpu-mem")
    ap.add_argument("--cpu-mem")
    ap.add_argument("--no-zero-copy", dest="zero_copy", action="store_false", help="stream experts (graph pieces)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    budgets = dict(preset=a.preset, gpu_mem=a.gpu_mem, cpu_mem=a.cpu_mem, zero_copy=a.zero_copy)
    options = RunOptions(device="cuda", max_context=1024, **budgets)
    with Engine(a.model, options) as engine:
        ids = engine.encode(PROMPT)
        engine.generate(ids[:-1], max_tokens=1, temperature=0)  # the answer follows a cached prompt
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            g = engine.generate(ids, max_tokens=a.tokens + 1, temperature=0)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        n = g.stats.generated_tokens  # passes: the last prompt token, then each answer token but the last
        rows = sorted(
            ((e.key[:100], e.device_time_total / n, e.count / n) for e in prof.key_averages() if e.device_time_total),
            key=lambda r: -r[1],
        )
        res = {
            "model": str(a.model),
            "decode_mode": engine.decode_mode,
            "wall_ms_per_pass": wall / n * 1e3,
            "device_ms_per_pass": sum(r[1] for r in rows) / 1e3,
            "launches_per_pass": sum(r[2] for r in rows),
            "store": {k: v / n for k, v in g.stats.store.items() if isinstance(v, (int, float))},  # per pass
            "kernels": rows[:40],
        }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profile_decode.json").write_text(json.dumps(res, indent=1))
    print({k: v for k, v in res.items() if k not in ("kernels", "store")})
    print("store per pass:", {k: round(v, 4) for k, v in res["store"].items() if v})
    for name, us, count in res["kernels"][:30]:
        print(f"{us:9.1f} us  x{count:<6.1f} {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
