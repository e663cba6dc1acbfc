"""Benchmark `dsfp4 convert` against this machine's ceilings; prints a table, writes JSON.

    python scripts/bench_convert.py WORKDIR [--devices cpu,cuda] [--workers 2,8] [--json out.json]

Builds (once) a ~2.6 GB synthetic checkpoint in DeepSeek-V3's official FP8 layout with V3's expert
shape (dim 7168, expert width 2048; 20 experts in each of 2 MoE blocks (one is MTP), one dense block,
V3 attention at 32 heads), measures the ceilings (HBM read, pinned host->GPU copy, O_DIRECT and cold
buffered reads of the shards, buffered write + fsync), then converts it cold (page cache dropped with
fadvise) once per device x workers, and once warm (source in the page cache) with the most workers,
each run in its own process so its peak RSS is its own, and checks that every run wrote the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsfp4.synthetic.hf_v3 import build_synthetic_checkpoint
from dsfp4.tools.ceilings import gpu_ceilings, odirect_read_gbps

V3_2G = dict(
    hidden_size=7168,
    moe_intermediate_size=2048,
    intermediate_size=18432,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=20,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    num_attention_heads=32,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=4096,
)
RSS_PROBE = Path(__file__).with_name("convert_rss.py")  # one conversion in a fresh process


def drop_cache(paths: list[Path]) -> None:
    """Evict the files from the page cache (no root needed), so reads come from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def buffered_cold_read_gbps(paths: list[Path], chunk: int = 16 << 20) -> float:
    drop_cache(paths)
    total, t = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while block := f.read(chunk):
                total += len(block)
    return total / (time.perf_counter() - t) / 1e9


def write_fsync_gbps(path: Path, nbytes: int = 1 << 30, chunk: int = 16 << 20) -> float:
    """Buffered writes then fsync, as the converter writes its output."""
    block = os.urandom(chunk)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for pos in range(0, nbytes, chunk):
        os.pwrite(fd, block, pos)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - t
    path.unlink()
    return nbytes / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", default="2")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    src = a.workdir / "src-v3-2g"
    if not (src / "config.json").exists():
        t = time.perf_counter()
        build_synthetic_checkpoint(src, V3_2G, "fp8", n_shards=4)
        print(f"built {src} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    shards = sorted(src.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    ceil = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "source_gb": size / 1e9,
        **gpu_ceilings(),
    }
    drop_cache(shards)
    ceil["odirect_read_gbps"] = odirect_read_gbps(shards)
    ceil["buffered_cold_read_gbps"] = buffered_cold_read_gbps(shards)
    ceil["write_fsync_gbps"] = write_fsync_gbps(a.workdir / "write-probe.bin")
    runs, shas = [], {}
    counts = [int(w) for w in a.workers.split(",")]
    for device in a.devices.split(","):
        for workers, cache in [(w, "cold") for w in counts] + [(max(counts), "warm")]:
            out = a.workdir / f"out-{device}-{workers}-{cache}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            if cache == "cold":
                drop_cache(shards)
            else:
                buffered_cold_read_gbps(shards)  # reads the shards into the page cache
            p = subprocess.run(
                [sys.executable, str(RSS_PROBE), str(src), str(out), str(workers), device],
                capture_output=True,
                text=True,
            )
            if p.returncode:
                print(p.stderr, file=sys.stderr)
                raise SystemExit(f"convert failed on {device} with {workers} workers")
            r = json.loads(p.stdout)
            m = json.loads((out / "manifest.json").read_text())
            shas[(device, workers, cache)] = (m["files"], m["experts"])
            subprocess.run(["rm", "-rf", str(out)], check=True)
            runs.append(
                {
                    "device": device,
                    "workers": workers,
                    "cache": cache,
                    "seconds": r["seconds"],
                    "source_gbps": r["bytes"] / r["seconds"] / 1e9,
                    "peak_rss_gib": r["peak_kib"] / 2**20,
                    "rss_after_imports_gib": r["base_kib"] / 2**20,
                    "quant_error": r["quant_error"],
                }
            )
    identical = len({json.dumps(v, sort_keys=True) for v in shas.values()}) == 1
    result = {"ceilings": ceil, "runs": runs, "outputs_identical": identical}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(ceil))
    print(f"{'device':<8}{'workers':>8}{'cache':>6}{'seconds':>9}{'src GB/s':>10}{'peak RSS GiB':>14}")
    for r in runs:
        print(
            f"{r['device']:<8}{r['workers']:>8}{r['cache']:>6}{r['seconds']:>9.1f}{r['source_gbps']:>10.3f}"
            f"{r['peak_rss_gib']:>14.2f}"
        )
    print(f"outputs identical across runs: {identical}")


if __name__ == "__main__":
    main()
