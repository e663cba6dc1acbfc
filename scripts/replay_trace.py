"""Replay a routing trace through the expert tiers and print hit rates per tier against Belady's optimum.

    python scripts/replay_trace.py TRACE --gpu-slots 580 --ram-slots 3400 [--policy lru --policy lfu]
        [--global | --per-layer | --both]

TRACE: a routing trace, .npy or .npz (layout/routing_trace.py); `dsfp4 run --record-trace`,
`dsfp4 profile-hot --trace` and scripts/synthetic_trace.py write one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dsfp4.errors import DsfpError
from dsfp4.layout.routing_trace import read_trace
from dsfp4.projection.replay import compare, table
from dsfp4.runtime.store.policy import TIER_POLICIES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--gpu-slots", type=int, required=True, help="expert slots on the GPU (all layers together)")
    p.add_argument("--ram-slots", type=int, required=True, help="expert slots in the RAM cache (all layers together)")
    p.add_argument("--policy", action="append", choices=sorted(TIER_POLICIES), help="repeat for several (default: all)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--global", dest="modes", action="store_const", const=(False,), help="one pool per tier")
    mode.add_argument("--per-layer", dest="modes", action="store_const", const=(True,), help="pools per layer")
    mode.add_argument("--both", dest="modes", action="store_const", const=(False, True), help="both (default)")
    a = p.parse_args(argv)
    policies = tuple(dict.fromkeys(a.policy or sorted(TIER_POLICIES)))
    start = time.perf_counter()
    try:
        trace = read_trace(a.trace).ids
        rows = compare(trace, a.gpu_slots, a.ram_slots, policies, a.modes or (False, True))
    except (DsfpError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens, layers, top_k = trace.shape
    print(f"{a.trace}: {tokens} tokens x {layers} layers x top-{top_k}; GPU {a.gpu_slots} slots, RAM {a.ram_slots}")
    print(table(rows))
    print(f"replayed in {time.perf_counter() - start:.1f} s")
    return 0 if any(row.hits is not None for row in rows) else 2  # no mode fitted the budgets


if __name__ == "__main__":
    sys.exit(main())
