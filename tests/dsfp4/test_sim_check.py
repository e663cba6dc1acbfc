"""scripts/bench_sim_check.py: the check of the simulation, repeated per trace, on the tiny model (CPU: its figures
mean nothing; what is checked is that every run is measured beside both simulations and the table counts them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from dsfp4.layout.manifest import Manifest
from dsfp4.tools.doctor import Ceilings

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sim_check.py"


def test_each_trace_is_checked_runs_times_beside_the_simulation_at_both_disk_rates(converted, tmp_path):
    ceil = tmp_path / "doctor.json"
    Ceilings(gpu="cpu", hbm_read_gbps=100.0, pinned_h2d_gbps=10.0, random_read_gbps=1.0, disk="/nvme").save(ceil)
    m = Manifest.read(converted)
    rng = np.random.default_rng(0)
    layers, k, e = len(m.experts), m.args.n_activated_experts, m.args.n_routed_experts
    traces = []
    for name in ("a", "b"):
        ids = np.stack([rng.permutation(e)[:k] for _ in range(40 * layers)]).reshape(40, layers, k)
        np.save(tmp_path / f"{name}.npy", ids.astype(np.int32))
        traces += ["--routing", str(tmp_path / f"{name}.npy")]
    out = tmp_path / "check.json"
    args = [sys.executable, str(SCRIPT), str(converted), *traces, "--ceilings", str(ceil), "--runs", "2"]
    args += ["--prompt-tokens", "4", "--decode-tokens", "6", "--json", str(out)]
    printed = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out.read_text())["checks"]
    assert [(Path(r["trace"]).name, r["run"]) for r in rows] == [("a.npy", 0), ("a.npy", 1), ("b.npy", 0), ("b.npy", 1)]
    assert all(r["measured_tok_s"] > 0 and r["simulated_tok_s"] > 0 for r in rows)
    assert "within 15%" in printed and printed.count("a.npy run") == 2
