"""MTP speculative decoding on the GPU machine (docs/BENCHMARKS.md): greedy decode speed with and without
drafting, with every weight resident and with experts streamed from the SSD.

    python scripts/bench_mtp.py WORKDIR [--layers 3] [--tokens 64] [--stream-gpu-mem 12G] [--stream-cpu-mem 12G]

The model is scripts/bench_model.py's with an MTP layer (DeepSeek-V3 dimensions, random NVFP4 experts), so
the MTP module's drafts are as random as its weights and are nearly never accepted. Besides those natural
drafts, each case runs with every draft kept (the check patched to accept: the best case, an upper bound
for the 85-90% acceptance DeepSeek reports on real text; the tokens are then not the model's) and every
draft rejected (the worst case, through the engine's test hook), and once with the adaptive switch on.
A uniform hot.json warm-starts every engine, so the resident case starts with every expert on the device.
An fp32 case checks that greedy tokens with natural and rejected drafts equal plain decoding's on the GPU.
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

from dsfp4 import Engine, RunOptions
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.runtime.generate import speculative
from dsfp4.runtime.generate.sampling import check_draft
from dsfp4.synthetic.bench_model import bench_model_at
from dsfp4.tools.ceilings import model_ceilings as ceilings

PROMPT = "Which experts are hot?"


def run_case(path: Path, options: RunOptions, tokens: int, exactness_only: bool = False) -> list[dict]:
    rows = []
    with Engine(path, dataclasses.replace(options, mtp=False)) as plain:
        plain.generate(PROMPT, max_tokens=4)  # warm: Triton, cuBLAS
        plain.reset()
        ref = plain.generate(PROMPT, max_tokens=tokens)
        vocab = plain.model.args.vocab_size
    rows.append({"mode": "plain", "decode_tok_s": ref.stats.decode_tok_s, "same_tokens": True, **_mtp(ref)})
    seq = ref.prompt_ids + ref.token_ids
    modes = {
        "mtp natural drafts": None,
        "mtp drafts all kept": "kept",
        "mtp drafts all rejected": lambda pos, d: (seq[pos] + 1) % vocab if pos < len(seq) else d,
        "mtp adaptive (default)": "adaptive",
    }
    if exactness_only:
        modes = {k: v for k, v in modes.items() if v is None or callable(v)}
    with Engine(path, dataclasses.replace(options, mtp=True)) as engine:
        engine.generate(PROMPT, max_tokens=4)
        for mode, hook in modes.items():
            engine.reset()
            engine.speculator.adaptive = hook == "adaptive"
            engine.speculator.override = hook if callable(hook) else None
            speculative.check_draft = (lambda t, q, d, p, g: (d, True)) if hook == "kept" else check_draft
            g = engine.generate(PROMPT, max_tokens=tokens)
            same = g.token_ids == ref.token_ids
            rows.append({"mode": mode, "decode_tok_s": g.stats.decode_tok_s, "same_tokens": same, **_mtp(g)})
        speculative.check_draft = check_draft
    return rows


def _mtp(g) -> dict:
    d = g.stats.to_dict()
    keys = ("drafted", "accepted", "acceptance_rate", "tokens_per_verify", "verify_s", "plain_steps", "plain_s")
    out = {k: d[k] for k in keys}
    out["mtp_note"] = g.stats.mtp_note
    out["gpu_hit_rate"], out["ssd_bytes_per_token"] = d["gpu_hit_rate"], d["ssd_bytes_per_token"]
    return out


def _step_ratio(r: dict) -> str:
    """A verify step's time over a plain step's (both measured in the same generation)."""
    if not r["drafted"] or not r["plain_steps"]:
        return "-"
    return f"{(r['verify_s'] / r['drafted']) / (r['plain_s'] / r['plain_steps']):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--stream-gpu-mem", default="12G")
    ap.add_argument("--stream-cpu-mem", default="12G")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    path = a.workdir / "model"
    t0 = time.perf_counter()
    manifest = bench_model_at(path, n_layers=a.layers, with_tokenizer=True, mtp=True)
    res: dict = {"write_s": time.perf_counter() - t0, "ceilings": ceilings(path, manifest)}
    uniform = {layer: (1,) * manifest.args.n_routed_experts for layer in manifest.experts}
    HotProfile(manifest.exact_sha256(), 1, uniform).write(path / HOT_NAME)
    base = {"device": "cuda", "max_context": 1024, "temperature": 0.0, "io_threads": 8}
    cases = {
        "resident": (RunOptions(**base, gpu_mem="70G", cpu_mem="24G"), a.tokens),
        "streaming": (RunOptions(**base, gpu_mem=a.stream_gpu_mem, cpu_mem=a.stream_cpu_mem), a.tokens // 2),
        "resident fp32": (RunOptions(**base, dtype="fp32", gpu_mem="70G", cpu_mem="24G"), 24),
    }
    for name, (options, tokens) in cases.items():
        res[name] = run_case(path, options, tokens, exactness_only=name.endswith("fp32"))
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_mtp.json").write_text(json.dumps(res, indent=1))
    print(f"\nceilings (GB/s): { {k: round(v, 2) for k, v in res['ceilings'].items()} }")
    for name in cases:
        for r in res[name]:
            if r["mtp_note"]:
                print(f"{name}, {r['mode']}: {r['mtp_note']}")
    for name in cases:
        plain = res[name][0]["decode_tok_s"]
        print(
            f"\n{name}: {'mode':<26}{'tok/s':>8}{'vs plain':>9}{'kept':>10}{'tok/verify':>11}{'verify/plain':>13}  same"
        )
        for r in res[name]:
            kept = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
            print(
                f"{'':<{len(name) + 2}}{r['mode']:<26}{r['decode_tok_s']:>8.2f}{r['decode_tok_s'] / plain:>8.2f}x"
                f"{kept:>10}{r['tokens_per_verify']:>11.2f}{_step_ratio(r):>13}  {'yes' if r['same_tokens'] else 'NO'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
