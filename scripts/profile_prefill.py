"""A long prompt's resident prefill on the GPU machine in both orders the decoder knows (docs/BENCHMARKS.md): a chunk
through every block after another (what the decoder does where every record is resident) and layer by layer (what
users' streamed prefill runs, forced here), each repeated, the last of each under torch's profiler.

    python scripts/profile_prefill.py MODEL [--tokens 8192,32768] [--reps 3] [--orders chunk,layer] [--profile]
        [--fp8-attention] [--out DIR]

MODEL is scripts/bench_model.py's. Every record on the device (`--preset 80g`), the model's own routers; each run a new
prompt, so nothing is reused; --fp8-attention runs the engine with that lever. Prints each run's prefill seconds and,
with --profile, the kernels by CUDA time; writes profile_prefill.json (and profile_<order>_<tokens>.txt) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `dsfp4` itself sets

import torch
from torch.profiler import ProfilerActivity, profile

from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate import decoder
from dsfp4.runtime.options import RunOptions

ORDERS = {"chunk": decoder.by_layer, "layer": lambda tokens, chunk, visible: tokens > chunk}
# rows of the profile's table
TOP_KERNELS = 28


def run(engine: Engine, order: str, tokens: int, seed: int) -> float:
    """One prompt of `tokens` new ids in `order` -> its prefill seconds."""
    decoder.by_layer = ORDERS[order]
    ids = [10 + (i * 7 + seed * 13) % 5000 for i in range(tokens)]
    return engine.generate(ids, max_tokens=1, temperature=0).stats.prefill_s


def main() -> None:
    try:
        measure()
    finally:
        decoder.by_layer = ORDERS["chunk"]


def measure() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--orders", default=",".join(ORDERS), help="the orders to run, a comma list")
    p.add_argument("--profile", action="store_true", help="profile each order's last run")
    p.add_argument("--fp8-attention", action="store_true", help="run --fp8-attention's lever")
    p.add_argument("--out", type=Path, default=Path("profile_prefill"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = [int(t) for t in args.tokens.split(",")]
    rows, seed = [], 0
    options = RunOptions(device="cuda", max_context=max(lengths) + 16, preset="80g", fp8_attention=args.fp8_attention)
    with Engine(args.model, options) as engine:
        for tokens in lengths:
            for rep in range(args.reps):
                for order in args.orders.split(","):
                    seed += 1
                    if args.profile and rep == args.reps - 1:
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            seconds = run(engine, order, tokens, seed)
                            torch.cuda.synchronize()
                        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=TOP_KERNELS)
                        (args.out / f"profile_{order}_{tokens}.txt").write_text(table)
                        print(table)
                    else:
                        seconds = run(engine, order, tokens, seed)
                    row = {"order": order, "tokens": tokens, "rep": rep, "prefill_s": seconds}
                    rows.append(row | {"fp8_attention": args.fp8_attention})
                    print(json.dumps(rows[-1]), flush=True)
    (args.out / "profile_prefill.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
