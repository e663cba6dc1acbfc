"""How close can any online eviction policy come to Belady on the calibrated DeepSeek-V3 traces?

Belady knows the future; no policy does. The bound an online policy can reach is set by what it could know: here
the generator itself (scripts/synthetic_trace.py's: per-expert log weights and AR(1) noise). The "informed" policy
knows the generator's parameters and every expert's noise state after the last token, and evicts the record least
likely to be chosen within the next H tokens; no online policy can rank records better than their true chances.
Beside it the store's `hot` policy (the default: the profile's hottest 3/4 of RAM held, LRU on the rest) and Belady,
at the whole V3's RAM share on a machine (projection.full_plan). Counted: share of uses read from the SSD, the
trace's second half, warm from a profile of its first half (as `bench --project` does).

    python scripts/online_bound.py [--reuse low|mid|high] [--machine 16g] [--tokens 4000] [--horizons 1 4 16]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from dsfp4.projection.machines import MACHINES
from dsfp4.projection.replay import belady
from dsfp4.projection.whole_model import full_plan, warm_order
from dsfp4.runtime.store.placement import hold_hottest
from dsfp4.runtime.store.slots import SlotPool
from dsfp4.synthetic.routing_trace import (
    Noise,
    RouterShape,
    figures,
    fit_generator,
    gumbel,
    route,
    trace_rng,
    v3_shares,
)

SHAPE = RouterShape(256, 8, 8, 4)  # DeepSeek-V3's router


def draw(logws: np.ndarray, rho: float, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The trace synthetic_trace draws -> (ids [N, L, K], the noise's Gaussians [N, L, E])."""
    noise, ids, zs = Noise(trace_rng(seed), *logws.shape, rho), [], []
    for _ in range(tokens):
        z = noise.gaussians(1)  # [1, L, E]
        scores = logws[None] + gumbel(z)
        ids.append(route(scores[0], SHAPE)[None])
        zs.append(z)
    return np.concatenate(ids), np.concatenate(zs)


def chances(logws: np.ndarray, rho: float, z_sample: np.ndarray, horizon: int):
    """-> f(z [L, E]) = each expert's expected uses in the next `horizon` tokens given its noise state z: chosen when
    its score passes the layer's usual k-th best score (groups ignored)."""
    scores = logws[None] + gumbel(z_sample)  # [n, L, E]
    kth = np.sort(scores, axis=2)[:, :, -SHAPE.top_k].mean(0)  # [L]
    gumbel_cdf = np.exp(-np.exp(-(kth[:, None] - logws))).clip(1e-9, 1 - 1e-9)
    cut = torch.special.ndtri(torch.from_numpy(gumbel_cdf)).numpy()  # [L, E] the Gaussian a choice needs

    def f(z: np.ndarray) -> np.ndarray:
        out = np.zeros_like(z, dtype=np.float64)
        for d in range(1, horizon + 1):
            r = rho**d
            out += 1 - torch.special.ndtr(torch.from_numpy((cut - r * z) / math.sqrt(1 - r * r))).numpy()
        return out

    return f


def informed(ids: np.ndarray, zs: np.ndarray, start: int, slots: int, warm: list, score) -> float:
    """SSD share of uses from `start` on, with `slots` records evicted by least `score` (warm start as the store)."""
    cached = np.zeros(zs.shape[1:], dtype=bool)
    for key in warm[:slots]:
        cached[key] = True
    misses = uses = 0
    for t in range(start, len(ids)):
        chance = score(zs[t - 1])  # [L, E] what is known before token t
        for layer in range(ids.shape[1]):
            chosen = ids[t, layer]
            for e in chosen:
                uses += 1
                if not cached[layer, e]:
                    misses += 1
                    masked = np.where(cached, chance, np.inf)
                    masked[layer, chosen] = np.inf
                    cached[np.unravel_index(np.argmin(masked), masked.shape)] = False
                    cached[layer, e] = True
    return misses / uses


def hot(ids: np.ndarray, start: int, slots: int, warm: list) -> float:
    """SSD share of uses under the store's `hot` RAM policy (placement.hold_hottest, as a warm start holds)."""
    pool = SlotPool(slots, "hot")
    for key in reversed(warm[:slots]):
        pool.allocate(key, ())
    hold_hottest(pool, warm, SHAPE.top_k)
    misses = uses = 0
    for t in range(start, len(ids)):
        for layer in range(ids.shape[1]):
            keys = [(layer, int(e)) for e in ids[t, layer]]
            for key in keys:
                uses += 1
                if pool.lookup(key) is None:
                    misses += 1
                    pool.allocate(key, set(keys))
    return misses / uses


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reuse", default="mid", choices=("low", "mid", "high"))
    p.add_argument("--machine", default="16g", choices=sorted(MACHINES))
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--horizons", type=int, nargs="+", default=[1, 4, 16])
    a = p.parse_args(argv)
    target = figures()["deepseek-v3"]["next_token_reuse"][a.reuse]
    logws, rho = fit_generator(v3_shares(), SHAPE, target, a.seed)
    ids, zs = draw(logws, rho, a.tokens, a.seed)
    _, plan = full_plan("v3", MACHINES[a.machine])
    half = a.tokens // 2
    warm = warm_order(ids[:half], SHAPE.experts)
    rows = [("hot (the store's default)", hot(ids, half, plan.ram_slots, warm))]
    for h in a.horizons:
        f = chances(logws, rho, zs[:500], h)
        rows.append((f"informed, next {h} tokens", informed(ids, zs, half, plan.ram_slots, warm, f)))
    opt = belady(ids[half:], plan.gpu_slots, plan.ram_slots)
    rows.append(("Belady (knows the future)", opt.ssd_rate))
    print(f"V3 {a.reuse} reuse (rho {rho:.3f}), {a.machine}: {plan.ram_slots} RAM slots of {plan.total_records}")
    for name, share in rows:
        print(f"  {name:<28} SSD share {100 * share:5.1f}%")


if __name__ == "__main__":
    main()
