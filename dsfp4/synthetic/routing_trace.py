"""A SYNTHETIC DeepSeek-like routing trace [tokens, layers, top_k] for the replay tool (scripts/synthetic_trace.py
writes one).

This is not a real trace: no real DeepSeek routing trace is reachable offline, so this imitates what is
published about DeepSeek routing, to size tiers and compare eviction policies until a real one is
recorded. What it imitates:
  * skewed expert popularity per layer (Zipf-like, exponent --skew), a different random permutation
    of experts in every layer;
  * V3's group-limited routing: rank the --groups groups by the sum of their two best scores, keep the
    --topk-groups best groups, take the top_k experts inside them;
  * token-to-token correlation: consecutive tokens at one layer share about --reuse of their experts
    (home-seek measured 55.9% step-to-step coverage).
Each token's score per (layer, expert) is log popularity + noise, the noise a mix of a slowly drifting
per-token "topic" (AR(1), coefficient --drift) and fresh noise; the mix is calibrated by bisection on
a sample so the measured overlap lands near --reuse. --noise sets how much the popularity prior is
blurred: the default 4.0 spreads a layer's routing over nearly all 256 experts in a few hundred tokens,
with its top 10% of experts taking about a third of it, in line with third-party measurements of
fine-grained MoE routing (flat, with strong short-range reuse). The script prints both statistics.

"""

from __future__ import annotations

import math

import numpy as np


def route(scores: np.ndarray, groups: int, topk_groups: int, top_k: int) -> np.ndarray:
    """Group-limited top-k as V3's router: scores [n, experts] -> expert ids [n, top_k], best first."""
    n, n_experts = scores.shape
    g = scores.reshape(n, groups, n_experts // groups)  # [n, groups, per_group]
    best = min(2, g.shape[2])
    group_score = np.partition(g, -best, axis=2)[:, :, -best:].sum(2)  # [n, groups]
    keep = np.argpartition(-group_score, topk_groups - 1, axis=1)[:, :topk_groups]  # [n, topk_groups]
    mask = np.zeros((n, groups), dtype=bool)
    np.put_along_axis(mask, keep, True, axis=1)
    masked = np.where(mask[:, :, None], g, -np.inf).reshape(n, n_experts)
    idx = np.argpartition(-masked, top_k - 1, axis=1)[:, :top_k]  # [n, top_k], unordered
    order = np.argsort(-np.take_along_axis(masked, idx, 1), axis=1)
    return np.take_along_axis(idx, order, 1)


def _generate(
    rng: np.random.Generator, tokens: int, logpop: np.ndarray, mix: float, drift: float, noise: float, cfg: tuple
) -> np.ndarray:
    """Routing of `tokens` tokens over layers given log popularity [layers, experts] -> [tokens, layers, k]."""
    layers, experts = logpop.shape
    topic = rng.standard_normal((layers, experts))  # stationary AR(1), unit variance
    a, b = math.sqrt(mix), math.sqrt(1.0 - mix)
    out = np.empty((tokens, layers, cfg[2]), dtype=np.int32)
    for t in range(tokens):
        if t:
            topic = drift * topic + math.sqrt(1.0 - drift * drift) * rng.standard_normal((layers, experts))
        fresh = rng.standard_normal((layers, experts))
        out[t] = route(logpop + noise * (a * topic + b * fresh), *cfg)
    return out


def overlap(trace: np.ndarray) -> float:
    """Mean share of a token's experts that the previous token also used at the same layer."""
    same = (trace[1:, :, :, None] == trace[:-1, :, None, :]).any(-1)  # [tokens-1, layers, k]
    return float(same.mean())


def top_share(trace: np.ndarray, n_experts: int, frac: float = 0.1) -> float:
    """Share of the routing (mean over layers) that goes to each layer's most used `frac` of experts."""
    n_top = max(1, math.ceil(frac * n_experts))
    shares = []
    for layer in range(trace.shape[1]):
        counts = np.sort(np.bincount(trace[:, layer].ravel(), minlength=n_experts))[::-1]
        shares.append(counts[:n_top].sum() / counts.sum())
    return float(np.mean(shares))


def synthetic_trace(
    tokens: int = 2000,
    layers: int = 58,
    experts: int = 256,
    top_k: int = 8,
    groups: int = 8,
    topk_groups: int = 4,
    seed: int = 0,
    reuse: float = 0.56,
    skew: float = 1.1,
    drift: float = 0.9,
    noise: float = 4.0,
) -> np.ndarray:
    """A synthetic trace int32 [tokens, layers, top_k]; the same arguments give the same trace."""
    if experts % groups or topk_groups > groups or top_k > topk_groups * (experts // groups) or top_k < 1:
        raise ValueError(f"cannot route top-{top_k} of {experts} experts in {topk_groups} of {groups} groups")
    if not 0.0 <= reuse <= 1.0 or not 0.0 <= drift < 1.0:
        raise ValueError("--reuse must be in [0, 1] and --drift in [0, 1)")
    rng = np.random.default_rng(seed)
    zipf = -skew * np.log(np.arange(1, experts + 1))  # log popularity by rank
    logpop = np.stack([zipf[rng.permutation(experts)] for _ in range(layers)])  # [layers, experts]
    cfg = (groups, topk_groups, top_k)

    # Calibrate the topic/fresh mix on a sample: overlap grows with the persistent share.
    sample = logpop[: min(layers, 8)]
    n_sample = min(tokens, 400)
    lo, hi = 0.0, 1.0
    for _ in range(12):
        mid = (lo + hi) / 2
        trial = _generate(np.random.default_rng([seed, 1]), n_sample, sample, mid, drift, noise, cfg)
        lo, hi = (mid, hi) if overlap(trial) < reuse else (lo, mid)
    return _generate(np.random.default_rng([seed, 2]), tokens, logpop, (lo + hi) / 2, drift, noise, cfg)
