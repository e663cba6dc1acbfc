"""The check of the simulation that every whole-model projection rests on, repeated (docs/BENCHMARKS.md; issue 51,
item 4): the bench model's decode at the whole model's share of a machine's budgets under each routing trace, RUNS
times, measured beside the store's simulation of the same plan, trace rows and links, once at the doctor's disk rate
and once at the rate the run's own reads took (the disk's moods between the two moments apart from the model's
error). The compute model is one resident decode, as `dsfp4 bench --project` measures it.

    python scripts/bench_sim_check.py MODEL --routing T1.npy [--routing T2.npy] --ceilings DOCTOR.json
        [--runs 5] [--machine 16g] [--family v3] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `dsfp4` itself sets

from dsfp4.layout.manifest import Manifest
from dsfp4.projection.bench_check import compute_model, validate
from dsfp4.runtime.options import RunOptions
from dsfp4.tools.bench import prompt_set
from dsfp4.tools.doctor import Ceilings

# the share of runs the issue holds the simulation to, and the error it allows
WITHIN = 0.15


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--routing", type=Path, action="append", required=True, help="a trace (repeat for several)")
    p.add_argument("--ceilings", type=Path, required=True, help="the doctor's JSON")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--machine", default="16g")
    p.add_argument("--family", default="v3")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--json", type=Path, default=Path("sim_check.json"))
    a = p.parse_args()
    manifest, c = Manifest.open(a.model), Ceilings.from_dict(json.loads(a.ceilings.read_text()))
    options = RunOptions(routing=a.routing[0])
    resident, eff, costs, links = compute_model(a.model, manifest, c, options, prompt_set(2))
    print(f"resident decode {resident['decode_tok_s']:.1f} tok/s: {eff:.0%} of HBM", flush=True)
    rows = []
    for trace in a.routing:
        for run in range(a.runs):
            check = validate(
                a.model,
                manifest,
                trace,
                a.machine,
                a.family,
                dataclasses.replace(options, routing=trace),
                links,
                costs,
                a.prompt_tokens,
                a.decode_tokens,
            )
            rows.append({"trace": str(trace), "run": run, **check})
            print(
                f"{trace.name} run {run}: measured {check['measured_tok_s']:.2f} tok/s, simulated "
                f"{check['simulated_tok_s']:.2f} ({check['error']:+.1%}); at the run's disk "
                f"({check['run_disk_gbps']:.2f} GB/s) {check['simulated_at_run_disk_tok_s'] or 0:.2f} "
                f"({(check['error_at_run_disk'] or 0):+.1%}); SSD GB/token measured "
                f"{check['measured_ssd_bytes_per_token'] / 1e9:.3f}, simulated "
                f"{check['simulated_ssd_bytes_per_token'] / 1e9:.3f}",
                flush=True,
            )
    a.json.write_text(json.dumps({"resident": resident, "efficiency": eff, "checks": rows}, indent=1) + "\n")
    print(f"\n{'trace':<14}{'runs':>5}{'within 15%':>12}{'at run disk':>13}{'median error':>14}{'at run disk':>13}")
    for trace in a.routing:
        mine = [r for r in rows if r["trace"] == str(trace)]
        errors = [r["error"] for r in mine]
        at_run = [r["error_at_run_disk"] for r in mine if r["error_at_run_disk"] is not None]
        print(
            f"{trace.name:<14}{len(mine):>5}{sum(abs(e) <= WITHIN for e in errors):>12}"
            f"{sum(abs(e) <= WITHIN for e in at_run):>13}{statistics.median(errors):>+14.1%}"
            f"{statistics.median(at_run) if at_run else 0:>+13.1%}"
        )


if __name__ == "__main__":
    main()
