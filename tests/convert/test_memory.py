"""Conversion streams: peak RSS grows by a bounded amount, far less than the checkpoint it converts.

Bound (README): peak RSS <= RSS after imports + 64 MiB copy chunk + workers x (~96 MiB allocator slack per
thread + 2 jobs in flight x ~30 bytes per element of the largest expert's gate+up matrix). For this
checkpoint (2 workers, 0.5 M-element gate+up) that is 224 MiB, measured ~145 MiB, while the checkpoint is
over 300 MiB; the growth does not depend on the checkpoint's size (docs/BENCHMARKS.md: 2 GB measurement).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsfp4.synthetic.hf_v3 import build_synthetic_checkpoint

RSS_PROBE = Path(__file__).resolve().parents[2] / "scripts" / "convert_rss.py"


BOUND_MIB = 224
DIMS = dict(
    hidden_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=64,
    num_hidden_layers=6,
    intermediate_size=1024,
    q_lora_rank=256,
    kv_lora_rank=256,
    num_attention_heads=8,
    vocab_size=4096,
    n_group=8,
    topk_group=4,
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status (Linux)")
def test_peak_rss_is_bounded_below_the_checkpoint_size(tmp_path):
    src = build_synthetic_checkpoint(tmp_path / "src", DIMS, "fp8", n_shards=4)
    size_mib = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 2**20
    assert size_mib > 1.2 * BOUND_MIB
    # the benchmark's probe: one conversion in a fresh process, RSS read from /proc/self/status
    out = subprocess.run(
        [sys.executable, str(RSS_PROBE), str(src), str(tmp_path / "out"), "2", "cpu"],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout)
    growth_mib = (r["peak_kib"] - r["base_kib"]) / 1024
    assert growth_mib < BOUND_MIB, f"peak RSS grew {growth_mib:.0f} MiB converting {size_mib:.0f} MiB"
