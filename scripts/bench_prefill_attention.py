"""MLA's prefill attention at DeepSeek-V3's shapes, the absorbed form against the decompressed one
(runtime/models/v3/attention.py), on the GPU machine: the crossover kernels/token_bounds.py's DECOMPRESS_TOKENS names.

    python scripts/bench_prefill_attention.py [--tokens 64,128,256,512,1024] [--context 2048,8192,32768] [--sweep]
        [--profile] [--out DIR]
    python scripts/bench_prefill_attention.py --cpu --small    # a smoke check of the script (its figures mean nothing)

A case is a chunk of T tokens at start_pos S (S cached rows before it, S + T keys), both forms from the rotated
queries and the latent cache to the heads' outputs [T, H, V] on a dense wkv_b (each form dequantizes it once per
call; not timed). TFLOP/s counts the decompressed form's products for both, 2 (N + R + V) per head and causal pair
(T S + T (T + 1) / 2 pairs), so the two rates compare as their times do; `expand` is the decompressed form's share
spent expanding the key blocks through wkv_b. `fp8` is the decompressed form's FP8 variant (mla_prefill's fp8: the
nope scores and the values in e4m3 on FP8 tensor cores, sm_89 on; the torch formula on the CPU), its TFLOP/s counted
the same way, its max abs and relative error (max abs over the largest |o|) against the exact decompressed form of the
same case; its columns are empty on GPUs without FP8 tensor cores. --sweep also times the block kernel's tile
configurations at the largest case; --profile runs torch's profiler over one call of each decompressed form there
(where the time goes: the kernel, the expansion, the FP8 roundings). Prints a table; writes
bench_prefill_attention.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from dsfp4.kernels.backend import use_kernels
from dsfp4.kernels.mla import prefill
from dsfp4.kernels.mla import prefill_jit as jit
from dsfp4.kernels.mla.prefill import FP8_DEFAULT, MLAPrefillConfig, fp8_kernel_runs, mla_prefill
from dsfp4.kernels.token_bounds import DECODE_TOKENS, DECOMPRESS_TOKENS
from dsfp4.runtime.models.v3.attention import absorbed_attention
from dsfp4.runtime.plan.limits import SCORE_ELEMENTS

# DeepSeek-V3: heads, kv_lora_rank, rope, nope and value dims
V3 = dict(h=128, c=512, r=64, n=128, v=128)
SMALL = dict(h=4, c=64, r=16, n=32, v=32)
# rows of --profile's tables
PROFILE_ROWS = 12
# a case's timed calls run at least this long (short ones repeat), at most MAX_REPS of them
MIN_SECONDS, MAX_REPS = 0.2, 1000
# the table's columns: (key of a case, heading, width, format)
COLUMNS = (
    ("tokens", "T", 5, "d"),
    ("context", "S", 6, "d"),
    ("absorbed_ms", "absorbed ms", 12, ".3f"),
    ("decompressed_ms", "decomp. ms", 11, ".3f"),
    ("expand_ms", "expand ms", 10, ".3f"),
    ("fp8_ms", "fp8 ms", 9, ".3f"),
    ("absorbed_tflops", "abs. TF/s", 10, ".1f"),
    ("decompressed_tflops", "dec. TF/s", 10, ".1f"),
    ("fp8_tflops", "fp8 TF/s", 9, ".1f"),
    ("fp8_max_abs", "fp8 abs err", 12, ".2e"),
    ("fp8_rel", "fp8 rel err", 12, ".2e"),
)
# --sweep's tile configurations (rows, keys, warps, stages), run as given (not fitted to the GPU's shared memory)
SWEEP = [
    MLAPrefillConfig(),
    FP8_DEFAULT,
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


def case(
    d: dict, t: int, s: int, device: torch.device, dtype: torch.dtype, reps: int, cfg: MLAPrefillConfig | None = None
) -> dict:
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
        **fp8_case(q, s, scale, rows, kernel, cfg, device, reps, flops),
    )


def fp8_case(
    q: tuple,
    s: int,
    scale: float,
    rows: int,
    kernel: bool,
    cfg: MLAPrefillConfig | None,
    device: torch.device,
    reps: int,
    flops: int,
) -> dict:
    """The FP8 variant's columns at a case: ms, TFLOP/s, and its max abs and relative error against the exact
    decompressed form's output (the kernel's on the GPU, the formula's on the CPU); None where it cannot run."""
    if kernel and not fp8_kernel_runs(device):
        return dict(fp8_ms=None, fp8_tflops=None, fp8_max_abs=None, fp8_rel=None)
    seconds = timed(lambda: mla_prefill(*q, s, scale, rows, kernel, cfg, fp8=True), device, reps)
    exact = mla_prefill(*q, s, scale, rows, kernel, cfg).float()
    err = (mla_prefill(*q, s, scale, rows, kernel, cfg, fp8=True).float() - exact).abs().max().item()
    return dict(
        fp8_ms=seconds * 1e3, fp8_tflops=flops / seconds / 1e12, fp8_max_abs=err, fp8_rel=err / exact.abs().max().item()
    )


def shared_bytes() -> list[int]:
    """The shared memory of each compiled variant of the block kernel, from Triton's cache ([] where it keeps none)."""
    try:
        return sorted({k.metadata.shared for c in jit.block_kernel.device_caches.values() for k in c[0].values()})
    except (AttributeError, TypeError, IndexError, KeyError):
        return []


def sweep(d: dict, t: int, s: int, device: torch.device, dtype: torch.dtype, reps: int) -> list[dict]:
    """The decompressed form's time at each of SWEEP's tile configurations, the exact and the FP8 variant's (which
    takes at least 32 keys a tile: prefill.FP8_MIN_K); one that does not fit is skipped."""
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
            ms, tflops, fp8 = r["decompressed_ms"], r["decompressed_tflops"], r["fp8_ms"]
            out.append(dict(config=vars(cfg), decompressed_ms=ms, tflops=tflops, fp8_ms=fp8, shared_bytes=smem))
            fp8_ms = "-" if fp8 is None else f"{fp8:.3f}"
            print(f"  {cfg}: {ms:.3f} ms, {tflops:.1f} TFLOP/s, fp8 {fp8_ms} ms, shared memory {smem}")
    finally:
        prefill.fitted = fitted
    return out


def profiled(d: dict, t: int, s: int, device: torch.device, dtype: torch.dtype) -> dict:
    """torch's profiler over one warm decompressed call of each form (exact, FP8 where it runs) at a case: the
    kernels by CUDA time, printed -> {form: table}."""
    from torch.profiler import ProfilerActivity, profile

    x, h = inputs(d, t, s, device, dtype), d["h"]
    scale, kernel = (d["n"] + d["r"]) ** -0.5, use_kernels(device)
    rows = max(1, SCORE_ELEMENTS // (h * (d["n"] + d["v"])))
    q = (x["q_nope"], x["q_pe"], x["kv"], x["pe"], x["wkv_b"])
    tables = {}
    for fp8 in (False, True) if fp8_kernel_runs(device) or not kernel else (False,):
        call = functools.partial(mla_prefill, *q, s, scale, rows, kernel, fp8=fp8)
        call()
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
        with profile(activities=activities) as prof:
            call()
            if device.type == "cuda":
                torch.cuda.synchronize()
        order = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        tables["fp8" if fp8 else "exact"] = prof.key_averages().table(sort_by=order, row_limit=PROFILE_ROWS)
        print(f"{'fp8' if fp8 else 'exact'}, T {t}, S {s}\n{tables['fp8' if fp8 else 'exact']}")
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,128,256,512,1024", help="chunk lengths T")
    ap.add_argument("--context", default="2048,8192,32768", help="cached rows S before the chunk")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also time the block kernel's tile configurations")
    ap.add_argument("--profile", action="store_true", help="also profile each form's call at the largest case")
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
    print(" ".join(f"{head:>{w}}" for _, head, w, _ in COLUMNS) + "  faster")
    rows = []
    for s in contexts:
        for t in tokens:
            r = case(d, t, s, device, dtype, args.reps)
            rows.append(r)
            cells = ("-" if r[k] is None else format(r[k], f) for k, _, _, f in COLUMNS)
            print(" ".join(f"{x:>{w}}" for x, (_, _, w, _) in zip(cells, COLUMNS, strict=True)) + f"  {r['faster']}")
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", shapes=d, cases=rows)
    if args.sweep:
        result["sweep"] = sweep(d, max(tokens), max(contexts), device, dtype, args.reps)
    if args.profile:
        result["profile"] = profiled(d, max(tokens), max(contexts), device, dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_prefill_attention.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
