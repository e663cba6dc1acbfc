"""MLA's prefill attention at DeepSeek-V3's shapes, the absorbed form against the decompressed one
(runtime/models/v3/attention.py), on the GPU machine: the crossover kernels/token_bounds.py's DECOMPRESS_TOKENS names.

    python scripts/bench_prefill_attention.py [--tokens 64,128,256,512,1024] [--context 2048,8192,32768] [--sweep]
        [--out DIR]
    python scripts/bench_prefill_attention.py --cpu --small    # a smoke check of the script (its figures mean nothing)

A case is a chunk of T tokens at start_pos S (S cached rows before it, S + T keys), both forms from the rotated
queries and the latent cache to the heads' outputs [T, H, V] on a dense wkv_b (each form dequantizes it once per
call; not timed). TFLOP/s counts the decompressed form's products for both, 2 (N + R + V) per head and causal pair
(T S + T (T + 1) / 2 pairs), so the two rates compare as their times do; `expand` is the decompressed form's share
spent expanding the key blocks through wkv_b. --sweep also times the block kernel's tile configurations at the largest
case. Prints a table; writes bench_prefill_attention.json under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dsfp4.kernels.backend import use_kernels
from dsfp4.kernels.mla import prefill
from dsfp4.kernels.mla import prefill_jit as jit
from dsfp4.kernels.mla.prefill import DEFAULT, MLAPrefillConfig, mla_prefill
from dsfp4.kernels.token_bounds import DECODE_TOKENS, DECOMPRESS_TOKENS
from dsfp4.runtime.models.v3.attention import absorbed_attention
from dsfp4.runtime.plan.limits import SCORE_ELEMENTS

# DeepSeek-V3: heads, kv_lora_rank, rope, nope and value dims
V3 = dict(h=128, c=512, r=64, n=128, v=128)
SMALL = dict(h=4, c=64, r=16, n=32, v=32)
# a case's timed calls run at least this long (short ones repeat), at most MAX_REPS of them
MIN_SECONDS, MAX_REPS = 0.2, 1000
# the table's columns after T and S, and every column's width
COLUMNS = ("absorbed_ms", "decompressed_ms", "expand_ms", "absorbed_tflops", "decompressed_tflops")
WIDTHS = (5, 6, 12, 11, 10, 10, 10)
# --sweep's tile configurations (rows, keys, warps, stages), run as given (not fitted to the GPU's shared memory)
SWEEP = [
    MLAPrefillConfig(),
    MLAPrefillConfig(keys=64, stages=4),
    MLAPrefillConfig(keys=128, stages=2),
    MLAPrefillConfig(keys=32, stages=3),
    MLAPrefillConfig(keys=32, stages=2),
    MLAPrefillConfig(keys=16, stages=3),
    MLAPrefillConfig(rows=64, keys=64, warps=4),
    MLAPrefillConfig(rows=64, keys=128, warps=4, stages=3),
]


def _seconds(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of fn over reps calls."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def timed(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of fn, after one warm call: at least `reps` calls, and as many as fill MIN_SECONDS."""
    fn()
    once = _seconds(fn, device, 1)
    return _seconds(fn, device, max(reps, min(MAX_REPS, int(MIN_SECONDS / max(once, 1e-6)))))


def inputs(d: dict, t: int, s: int, device: torch.device, dtype: torch.dtype) -> dict:
    """A chunk of t tokens at start_pos s: rotated queries, the latent cache through the chunk, wkv_b dense, the
    causal mask the absorbed form takes."""
    gen = torch.Generator(device).manual_seed(t + s)
    h, c, r, n, v = d["h"], d["c"], d["r"], d["n"], d["v"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    mask = torch.full((t, s + t), float("-inf"), device=device).triu_(s + 1)
    w = rand(h, n + v, c) * c**-0.5
    return dict(
        q_nope=rand(1, t, h, n), q_pe=rand(1, t, h, r), kv=rand(1, s + t, c), pe=rand(1, s + t, r), wkv_b=w, mask=mask
    )


def case(d: dict, t: int, s: int, device: torch.device, dtype: torch.dtype, reps: int, cfg=DEFAULT) -> dict:
    x, h, width = inputs(d, t, s, device, dtype), d["h"], d["n"] + d["v"]
    scale, kernel = (d["n"] + d["r"]) ** -0.5, use_kernels(device)
    # the key block runtime/models/v3/attention.py's decompressed_attention takes
    rows = max(1, SCORE_ELEMENTS // (h * (width if kernel else max(width, t))))
    q = (x["q_nope"], x["q_pe"], x["kv"], x["pe"], x["wkv_b"])
    # flash-decoding takes up to DECODE_TOKENS tokens, as in the model
    decode = kernel and t <= DECODE_TOKENS
    absorbed = timed(lambda: absorbed_attention(*q, scale, x["mask"], decode), device, reps)
    decompressed = timed(lambda: mla_prefill(*q, s, scale, rows, kernel, cfg), device, reps)
    w = x["wkv_b"].reshape(-1, d["c"])
    expand = timed(lambda: [x["kv"][0, k : k + rows] @ w.t() for k in range(0, s + t, rows)], device, reps)
    flops = 2 * (d["n"] + d["r"] + d["v"]) * h * (t * s + t * (t + 1) // 2)
    return dict(
        tokens=t,
        context=s,
        absorbed_ms=absorbed * 1e3,
        decompressed_ms=decompressed * 1e3,
        expand_ms=expand * 1e3,
        absorbed_tflops=flops / absorbed / 1e12,
        decompressed_tflops=flops / decompressed / 1e12,
        faster="decompressed" if decompressed < absorbed else "absorbed",
    )


def shared_bytes() -> list[int]:
    """The shared memory of each compiled variant of the block kernel, from Triton's cache ([] where it keeps none)."""
    try:
        return sorted({k.metadata.shared for c in jit.block_kernel.device_caches.values() for k in c[0].values()})
    except (AttributeError, TypeError, IndexError, KeyError):
        return []


def sweep(d: dict, t: int, s: int, device: torch.device, dtype: torch.dtype, reps: int) -> list[dict]:
    """The decompressed form's time at each of SWEEP's tile configurations; one that does not fit is skipped."""
    out, fitted, seen = [], prefill.fitted, shared_bytes()
    prefill.fitted = lambda cfg, *_: cfg
    try:
        for cfg in SWEEP:
            try:
                r = case(d, t, s, device, dtype, reps, cfg)
            except Exception as e:
                # Triton's out-of-resources error has no stable class across its versions
                print(f"  {cfg}: {type(e).__name__}")
                continue
            smem, seen = [b for b in shared_bytes() if b not in seen], shared_bytes()
            ms, tflops = r["decompressed_ms"], r["decompressed_tflops"]
            out.append(dict(config=vars(cfg), decompressed_ms=ms, tflops=tflops, shared_bytes=smem))
            print(f"  {cfg}: {ms:.3f} ms, {tflops:.1f} TFLOP/s, shared memory {smem}")
    finally:
        prefill.fitted = fitted
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,128,256,512,1024", help="chunk lengths T")
    ap.add_argument("--context", default="2048,8192,32768", help="cached rows S before the chunk")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also time the block kernel's tile configurations")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (the torch formulas)")
    ap.add_argument("--small", action="store_true", help="4 heads and narrow widths, short chunks and contexts")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("bench_prefill_attention needs a CUDA device (or --cpu for a smoke check)")
    device = torch.device("cpu" if args.cpu else "cuda")
    d = SMALL if args.small else V3
    tokens = [16, 32] if args.small else [int(x) for x in args.tokens.split(",")]
    contexts = [64, 128] if args.small else [int(x) for x in args.context.split(",")]
    dtype = torch.bfloat16
    print(f"T > {DECOMPRESS_TOKENS} attends decompressed; {d}, {dtype}, {device}")
    heads = ("T", "S", "absorbed ms", "decomp. ms", "expand ms", "abs. TF/s", "dec. TF/s")
    print(" ".join(f"{x:>{w}}" for x, w in zip(heads, WIDTHS, strict=True)) + "  faster")
    rows = []
    for s in contexts:
        for t in tokens:
            r = case(d, t, s, device, dtype, args.reps)
            rows.append(r)
            cells = (f"{t}", f"{s}", *(f"{r[k]:.3f}" for k in COLUMNS[:3]), *(f"{r[k]:.1f}" for k in COLUMNS[3:]))
            print(" ".join(f"{x:>{w}}" for x, w in zip(cells, WIDTHS, strict=True)) + f"  {r['faster']}")
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", shapes=d, cases=rows)
    if args.sweep:
        result["sweep"] = sweep(d, max(tokens), max(contexts), device, dtype, args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_prefill_attention.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
