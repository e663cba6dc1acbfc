"""Write a random benchmark model straight into dsfp4 layout v1, at DeepSeek-V3's or V4-Flash's full width
(dsfp4/synthetic/bench_model.py says how).

    python scripts/bench_model.py OUT --layers 6 --dense 1 [--seed 0] [--backbone nvfp4] [--tokenizer]
                                      [--dims hidden_size=1024 n_routed_experts=64 ...]
    python scripts/bench_model.py OUT --family v4 --layers 4 [--tokenizer] [--mtp]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dsfp4.runtime.plan.budget import proc_status_bytes
from dsfp4.synthetic.bench_model import BACKBONES, write_bench_model, written_bytes
from dsfp4.synthetic.releases import RELEASES
from dsfp4.units import format_bytes


def _dim_value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="new folder for the model")
    p.add_argument("--layers", type=int, default=6, help="decoder blocks (default 6)")
    p.add_argument("--family", choices=sorted(RELEASES), default="v3", help="DeepSeek-V3 or V4-Flash")
    p.add_argument("--dense", type=int, help="leading blocks with a dense MLP (default: V3 1, V4 none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backbone", choices=sorted(BACKBONES), default="fp8_e4m3_b128")
    p.add_argument("--experts", choices=["nvfp4", "mxfp4"], help="the experts' format (default: the family's)")
    p.add_argument("--tokenizer", action="store_true", help="also write tokenizer.json and its config")
    p.add_argument("--mtp", action="store_true", help="also write an MTP layer (block N, with its experts)")
    p.add_argument("--dims", nargs="*", default=[], metavar="KEY=VALUE", help="config.json keys overriding the model's")
    a = p.parse_args(argv)
    dims = {k: _dim_value(v) for k, v in (d.split("=", 1) for d in a.dims)}
    t = time.perf_counter()
    m = write_bench_model(a.out, a.layers, a.dense, a.seed, dims, a.backbone, a.tokenizer, a.mtp, a.family, a.experts)
    seconds = time.perf_counter() - t
    peak = proc_status_bytes("VmHWM")
    n = written_bytes(m)
    print(
        f"{a.out}: {format_bytes(n)} in {seconds:.1f} s ({n / seconds / 1e9:.2f} GB/s), "
        f"{m.args.n_layers} layers ({len(m.experts)} MoE, {m.args.n_routed_experts} experts each), "
        f"peak RSS {format_bytes(peak)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
