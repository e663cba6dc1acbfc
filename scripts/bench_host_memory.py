"""What `dsfp4 run`'s process holds in RAM besides its record cache, measured in this fresh process against what
the planner reserved for it (the plan's "process" row): RSS after the imports, after the model loads and after a
generation, and the peak (VmHWM), each from /proc/self/status. Prints one JSON line.

    python scripts/bench_host_memory.py MODEL [--preset 16g | --gpu-mem 8G --cpu-mem 24G] [--tokens 32]

The planner's process share is RSS at plan time plus a reserve for the CUDA libraries loaded after it
(runtime/plan/planner.py CUDA_HOST_RESERVE); `beside_cache_peak` is what the run really needed past its cache.
"""

from __future__ import annotations

import argparse
import json

from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.budget import proc_status_bytes

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--cpu-mem", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    imported = proc_status_bytes("VmRSS")
    options = RunOptions(preset=args.preset, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem)
    m = Manifest.read(args.model)
    largest = max((m.files[rel].nbytes for rel in m.backbone_files()), default=0)
    with Engine(args.model, options) as engine:
        plan = engine.plan
        loaded = proc_status_bytes("VmRSS")
        engine.generate("The store reads records from the SSD.", max_tokens=args.tokens, temperature=0)
        after, peak = proc_status_bytes("VmRSS"), proc_status_bytes("VmHWM")
        anon, mapped = proc_status_bytes("RssAnon"), proc_status_bytes("RssFile")  # the cache is anonymous
    cache = plan.record_cache
    r = {
        "device": plan.device,
        "rss_imports": imported,
        "planned_process": plan.host_base,
        "largest_backbone_file": largest,
        "record_cache": cache,
        "rss_loaded": loaded,
        "rss_after_generation": after,
        "peak_rss": peak,
        "cpu_budget": plan.budgets.cpu,
        "rss_anon_after": anon,
        "rss_file_after": mapped,
        "beside_cache_after": after - cache,
        "beside_cache_peak": peak - cache,
    }
    print(json.dumps(r))
    print(
        f"planned process {plan.host_base / GiB:.2f} GiB; beside the {cache / GiB:.2f} GiB cache the run held "
        f"{(after - cache) / GiB:.2f} GiB after a generation ({(anon - cache) / GiB:.2f} anonymous, "
        f"{mapped / GiB:.2f} mapped files), peak {(peak - cache) / GiB:.2f} GiB; peak RSS "
        f"{peak / GiB:.2f} of the {plan.budgets.cpu / GiB:.2f} GiB budget"
    )


if __name__ == "__main__":
    main()
