"""Write a SYNTHETIC routing trace of a DeepSeek model (.npy, [tokens, layers, top_k]) fitted to published figures
(dsfp4/synthetic/data/routing-figures.json), and print its statistics beside them. The model of routing is
dsfp4/synthetic/routing_trace.py's docstring.

    python scripts/synthetic_trace.py OUT.npy --model v3 [--reuse low|mid|high|0.2] [--tokens 4000] [--seed 0]
    python scripts/synthetic_trace.py OUT.npy --model v4-flash [--reuse 0.42] [--zipf 0.75]
    python scripts/synthetic_trace.py OUT.npy --model v3 --uniform      # no skew: what real skew is worth

v3: each of the 58 MoE layers' shares of uses are DeepSeek-V3's published counts (tt-metal); next-token reuse is
not published for V3, so --reuse picks a point of the bracket projected from DeepSeek-V2-Lite's measured reuse
(low 0.13, mid 0.18, high 0.23). v4-flash: 43 layers of Zipf-shaped shares (exponent 0.75: the top 10% of experts
take 0.45 of the uses, inside V4.1-Flash's published 0.35-0.55) and reuse 0.42, which gives a per-layer LRU cache
of 13% of the experts the published 0.61 hit rate. --uniform: every expert equally likely, tokens independent.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dsfp4.projection.replay import replay
from dsfp4.synthetic.routing_trace import RouterShape, figures, synthetic_trace, trace_stats, v3_shares, zipf_shares

V4_ZIPF, V4_REUSE = 0.75, 0.42  # fitted to V4.1-Flash's coverage figures (module docstring)
LRU_SHARES = (0.13, 0.30, 0.52)  # the cache sizes V4.1-Flash's LRU figures were published at


def _published(model: str) -> dict[str, str]:
    f = figures()
    if model == "v3":
        s, r = f["deepseek-v3"]["skew"], f["deepseek-v3"]["next_token_reuse"]
        out = {k: f"{s[k]:.3f}" for k in ("top10", "top25", "top50", "gini")}
        return {**out, "next_token_reuse": f"{r['low']}-{r['high']} (projected, not published)"}
    v4 = f["deepseek-v4-flash"]
    lru = dict(zip(v4["lru_hit"]["share_of_keys"], v4["lru_hit"]["lru"], strict=True))
    return {
        "top10": "-".join(map(str, v4["skew"]["top10"])),
        "top25": "-".join(map(str, v4["skew"]["top25"])),
        "gini": f"{v4['gini']['preview']} (preview) / {v4['gini']['v4-flash-0731']} (0731)",
        **{f"lru_{share:.2f}": f"{lru[share]}" for share in LRU_SHARES},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", choices=("v3", "v4-flash"), default="v3")
    p.add_argument("--reuse", default=None, help="next-token reuse: low, mid, high (V3's bracket) or a share")
    p.add_argument("--zipf", type=float, default=V4_ZIPF, help="v4-flash: the Zipf exponent of the shares")
    p.add_argument("--uniform", action="store_true", help="every expert equally likely, tokens independent")
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.model == "v3":
        shape, shares = RouterShape(256, 8, 8, 4), v3_shares()
        bracket = figures()["deepseek-v3"]["next_token_reuse"]
        target = bracket[a.reuse or "mid"] if (a.reuse or "mid") in bracket else float(a.reuse)
    else:
        shape, shares = RouterShape(256, 6), zipf_shares(43, 256, a.zipf, a.seed)
        target = float(a.reuse) if a.reuse else V4_REUSE
    if a.uniform:
        shares, target = np.full_like(shares, 1 / shares.shape[1]), shape.top_k / shape.experts
    trace, rho = synthetic_trace(shares, shape, a.tokens, target, a.seed)
    np.save(a.out, trace)
    stats = trace_stats(trace, shape.experts)
    layers = trace.shape[1]
    for share in LRU_SHARES:
        slots = round(share * shape.experts) * layers
        stats[f"lru_{share:.2f}"] = replay(trace, slots, slots, "lru", per_layer=True).gpu_rate
    published = {} if a.uniform else _published(a.model)
    kind = "uniform" if a.uniform else a.model
    print(f"wrote {a.out}: SYNTHETIC {kind} trace {list(trace.shape)} (tokens, layers, top_k), seed {a.seed}")
    print(f"noise persistence rho {rho:.3f}, fitted to next-token reuse {target:.3f}")
    print(f"{'statistic':<22}{'this trace':>12}  published (dsfp4/synthetic/data/routing-figures.json)")
    for k, v in stats.items():
        print(f"{k:<22}{v:>12.3f}  {published.get(k, '-')}")


if __name__ == "__main__":
    main()
