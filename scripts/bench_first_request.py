"""The first request of each prompt length in a fresh process (issue 50): its time to first token against the same
length's second request, and the Triton kernels compiled during it, found as the entries it adds to a Triton cache
folder of this run's own (TRITON_CACHE_DIR).

    python scripts/bench_first_request.py MODEL [--lengths 20,100,512,2000] [--gpu-mem 100G] [--cpu-mem 32G]
        [--cache DIR] [--json OUT]

Run it twice with the same --cache: the first run is a new install's (every kernel compiled), the second a later
process's (kernels read from Triton's disk cache). MODEL: any conversion (scripts/bench_model.py's for V3's shapes);
the prompts are random token ids, raw, one token generated each. Regime: whatever the budgets make it (resident with
every record on the device by default); the point is the compile cost, not the prefill speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def kernels_in(cache: Path) -> set[str]:
    """The kernel variants compiled into a Triton cache folder, as ENTRY/NAME: each entry (one per kernel and
    specialization) holds NAME.json beside its binaries."""
    return {f"{p.parent.name}/{p.stem}" for p in cache.glob("*/*.json") if not p.name.startswith("__grp__")}


def names(entries: set[str]) -> str:
    """Kernel names with their count of new variants: 'fp8_gemm_kernel x3, block_kernel'."""
    counts: dict[str, int] = {}
    for e in sorted(entries):
        counts[e.split("/", 1)[1]] = counts.get(e.split("/", 1)[1], 0) + 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items()) or "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--lengths", default="20,100,512,2000")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-mem", default="100G")
    ap.add_argument("--cpu-mem", default="32G")
    ap.add_argument("--cache", type=Path, default=None, help="Triton's cache folder (default: a new one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="triton-cache-"))
    cache.mkdir(parents=True, exist_ok=True)
    # before Triton is imported: where this process's compiles go
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    import torch

    from dsfp4 import Engine, RunOptions

    lengths = [int(n) for n in args.lengths.split(",")]
    t0 = time.perf_counter()
    before = kernels_in(cache)
    options = RunOptions(device=args.device, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, max_context=max(lengths) + 64)
    rows = []
    with Engine(args.model, options) as engine:
        start_s = time.perf_counter() - t0
        at_start = kernels_in(cache) - before
        vocab = engine.rules.spec.vocab_size
        gen = torch.Generator().manual_seed(0)
        for n in lengths:
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            seen = kernels_in(cache)
            first = engine.generate(ids, max_tokens=1, temperature=0).stats.ttft_s
            compiled = sorted(kernels_in(cache) - seen)
            engine.reset()
            again = engine.generate(ids, max_tokens=1, temperature=0).stats.ttft_s
            engine.reset()
            rows.append({"tokens": n, "first_ttft_s": first, "second_ttft_s": again, "compiled": compiled})
    out = {"cache": str(cache), "engine_start_s": start_s, "compiled_at_start": sorted(at_start), "requests": rows}
    print(f"engine start {start_s:.1f} s, {len(at_start)} kernel variants compiled then (cache {cache})")
    print(f"{'tokens':>7} {'first TTFT':>11} {'second':>8}  kernel variants compiled by the first")
    for r in rows:
        print(f"{r['tokens']:>7} {r['first_ttft_s']:>10.3f}s {r['second_ttft_s']:>7.3f}s  {names(set(r['compiled']))}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
