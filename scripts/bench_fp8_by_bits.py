"""The FP8 backbone by bits (the path of an A100 or RTX 3090: kernels/backend.py BY_BITS) against the native path, on
one GPU that converts e4m3 in hardware (an H100/H200): the by-bits path is forced there by DSFP4_FP8_BY_BITS=1 for
the model runs and by the kernels' by_bits argument for the kernel times.

    python scripts/bench_fp8_by_bits.py MODEL [--preset 80g] [--prompts 4] [--max-tokens 64] [--out DIR]
    python scripts/bench_fp8_by_bits.py --kernels-only

Model: `dsfp4 bench MODEL --preset P` twice, in a process each (the path is read once per process), resident decode
and prefill tok/s of each and their ratio. Kernels: DeepSeek-V3's FP8 shapes, the decode GEMV at 1, 4, 16 tokens
and the prefill GEMM at --gemm-tokens, each captured in a CUDA graph over distinct copies of the matrix (no L2 reuse
flatters it); the by-bits GEMM also with the tiles an A100 and a 3090 would take (their shared memory), and the
other way by bits, which the by-bits path takes from WIDEN_GEMM_TOKENS tokens: W widened to bf16 in pieces and
multiplied by cuBLAS (kernels/fp8/widened_gemm.py). --gemm-tokens takes a list (the two ways' crossover). Prints a
table; writes bench_fp8_by_bits.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch

# run as a script, scripts/ is on the path: its graph timer, not a copy
from bench_kernels import graph_time

from dsfp4.kernels.backend import FP8_BY_BITS_ENV, Card, card
from dsfp4.kernels.fp8.gemm import fp8_gemm, gemm_plan
from dsfp4.kernels.fp8.linear import fp8_gemv
from dsfp4.kernels.fp8.widened_gemm import fp8_widened_gemm
from dsfp4.layout.fp8 import fp8_block_quantize

# DeepSeek-V3's FP8 matrices (N, K)
SHAPES = {
    "q_a": (1536, 7168),
    "kv_a": (576, 7168),
    "q_b": (24576, 1536),
    "o": (7168, 16384),
    "shared_w13": (4096, 7168),
    "shared_w2": (7168, 2048),
    "dense_w13": (36864, 7168),
    "dense_w2": (7168, 18432),
}
GEMV_TOKENS = (1, 4, 16)
# the cards whose tiles the by-bits GEMM also runs with: their capability, SMs, shared memory per block
AS_CARDS = {"A100": Card((8, 0), 108, 166912), "RTX 3090": Card((8, 6), 82, 101376)}
# matrices' copies a graph cycles through: more bytes than an H200's 60 MB L2
L2_BYTES = 128 << 20


def _copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    q, s = fp8_block_quantize(torch.randn(n, k, device="cuda") * 1e-2)
    count = max(2, -(-L2_BYTES // q.numel()))
    return [(q.clone(), s.clone()) for _ in range(count)]


def kernel_rows(gemm_tokens: int, gemv: bool = True) -> list[dict]:
    """Per shape: GEMV (unless `gemv` is False) and GEMM seconds native and by bits (and the by-bits GEMM with
    AS_CARDS' tiles, and widened)."""
    rows = []
    for name, (n, k) in SHAPES.items():
        mats = _copies(n, k)
        row = {"shape": name, "n": n, "k": k, "gemm_tokens": gemm_tokens}
        for t in GEMV_TOKENS if gemv else ():
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            for by_bits in (False, True):
                key = f"gemv{t}_{'bits' if by_bits else 'native'}_us"
                calls = [partial(fp8_gemv, x, q, s, by_bits=by_bits) for q, s in mats]
                row[key] = graph_time(calls) * 1e6
        x = torch.randn(gemm_tokens, k, device="cuda", dtype=torch.bfloat16)
        here = card(x.device)
        plans = {"native": (False, gemm_plan(gemm_tokens, n, here, False)), "bits": (True, None)}
        plans |= {f"bits_as_{c}": (True, gemm_plan(gemm_tokens, n, cc, True)) for c, cc in AS_CARDS.items()}
        for label, (by_bits, plan) in plans.items():
            calls = [partial(fp8_gemm, x, q, s, by_bits=by_bits, plan=plan) for q, s in mats[:2]]
            row[f"gemm_{label}_us"] = graph_time(calls) * 1e6
        calls = [partial(fp8_widened_gemm, x, q, s) for q, s in mats[:2]]
        row["gemm_bits_widened_us"] = graph_time(calls) * 1e6
        rows.append(row)
        del mats
        torch.cuda.empty_cache()
    return rows


def model_runs(model: Path, preset: str, prompts: int, max_tokens: int, out: Path) -> dict:
    """`dsfp4 bench` natively and by bits, a process each -> {path: its bench.json result}."""
    results = {}
    for label, forced in (("native", "0"), ("by bits", "1")):
        folder = out / label.replace(" ", "_")
        cmd = [sys.executable, "-m", "dsfp4.cli.main", "bench", str(model), "--preset", preset]
        cmd += ["--prompts", str(prompts), "--max-tokens", str(max_tokens), "--out", str(folder)]
        subprocess.run(cmd, env={**os.environ, FP8_BY_BITS_ENV: forced}, check=True)
        results[label] = json.loads((folder / "bench.json").read_text())["results"][0]
    return results


def _print_model(results: dict) -> None:
    native, bits = results["native"], results["by bits"]
    print(f"{'path':<10} {'decode tok/s':>13} {'prefill tok/s':>14} {'efficiency':>11}")
    for label, r in results.items():
        eff = f"{r['efficiency']:.0%}" if r.get("efficiency") is not None else "-"
        print(f"{label:<10} {r['decode_tok_s']:>13.1f} {r['prefill_tok_s']:>14.1f} {eff:>11}")
    for key in ("decode_tok_s", "prefill_tok_s"):
        print(f"by bits / native, {key}: {bits[key] / native[key]:.0%}" if native[key] else f"{key}: none")


def _print_kernels(rows: list[dict]) -> None:
    keys = [k for k in rows[0] if k.endswith("_us")]
    print(f"{'shape':<11}" + "".join(f"{k[:-3]:>20}" for k in keys))
    for r in rows:
        print(f"{r['shape']:<11}" + "".join(f"{r[k]:>20.1f}" for k in keys))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, nargs="?", help="a converted model with an FP8 backbone (the bench model)")
    p.add_argument("--preset", default="80g", help="the budget preset (default 80g: every record resident)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gemm-tokens", default="4096", help="tokens of the prefill GEMM's x, a comma list (default 4096)")
    p.add_argument("--kernels-only", action="store_true", help="only the kernel times")
    p.add_argument("--out", type=Path, default=Path("bench_fp8_by_bits"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if a.model is None and not a.kernels_only:
        p.error("MODEL, or --kernels-only")
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability()}
    if not a.kernels_only:
        report["model"] = model_runs(a.model, a.preset, a.prompts, a.max_tokens, a.out)
        _print_model(report["model"])
    report["kernels"] = []
    for i, t in enumerate(int(x) for x in a.gemm_tokens.split(",")):
        rows = kernel_rows(t, gemv=i == 0)
        print(f"GEMM of {t} tokens (microseconds)")
        _print_kernels(rows)
        report["kernels"] += rows
    (a.out / "bench_fp8_by_bits.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
