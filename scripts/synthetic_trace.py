"""Write a SYNTHETIC DeepSeek-like routing trace [tokens, layers, top_k] (.npy) for the replay tool; what it
imitates is dsfp4/synthetic/routing_trace.py's docstring.

    python scripts/synthetic_trace.py OUT.npy [--tokens 2000 --layers 58 --experts 256 --top-k 8
        --groups 8 --topk-groups 4 --seed 0 --reuse 0.56 --skew 1.1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dsfp4.synthetic.routing_trace import overlap, synthetic_trace, top_share


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", type=float, default=0.56, help="target overlap with the previous token's experts")
    p.add_argument("--skew", type=float, default=1.1, help="Zipf exponent of per-layer expert popularity")
    p.add_argument("--drift", type=float, default=0.9, help="AR(1) coefficient of the per-token topic noise")
    p.add_argument("--noise", type=float, default=4.0, help="std of the score noise (against log popularity)")
    a = p.parse_args(argv)
    trace = synthetic_trace(
        a.tokens, a.layers, a.experts, a.top_k, a.groups, a.topk_groups, a.seed, a.reuse, a.skew, a.drift, a.noise
    )
    np.save(a.out, trace)
    print(f"wrote {a.out}: SYNTHETIC trace {list(trace.shape)} (tokens, layers, top_k), seed {a.seed}")
    print(f"overlap with previous token: {overlap(trace):.3f} (target {a.reuse})")
    print(f"routing share of the top 10% experts per layer: {top_share(trace, a.experts):.3f}")


if __name__ == "__main__":
    main()
