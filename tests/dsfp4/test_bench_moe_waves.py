"""scripts/bench_moe_waves.py --cpu: the compacted waves against the per-piece calls at tiny shapes (its figures mean
nothing on a CPU; what is checked is that every case runs both ways, agrees and is written)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_moe_waves.py"


def test_every_case_runs_both_ways_to_the_same_sum_and_is_written(tmp_path):
    args = [sys.executable, str(SCRIPT), "--cpu", "--reps", "1", "--groups", "40,64", "--present", "3,9"]
    printed = subprocess.run([*args, "--out", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    out = json.loads((tmp_path / "bench_moe_waves.json").read_text())
    rows = out["rows"]
    assert [(r["fmt"], r["G"], r["S"]) for r in rows] == [
        (f, g, s) for f in ("nvfp4", "mxfp4") for g in (40, 64) for s in (3, 9)
    ]
    for r in rows:
        assert 0 < r["pairs"] < r["G"] * out["shapes"]["top_k"] and r["runs"] >= 1
        assert r["old_ms"] > 0 and r["compact_ms"] > 0 and r["compact_TFLOPs"] > 0
        # bf16: the old wave rounds each piece's sums, the compacted one each pair's output
        assert r["rel_err"] < 1e-2
    assert printed.count("nvfp4") == 4 and "compact ms" in printed
