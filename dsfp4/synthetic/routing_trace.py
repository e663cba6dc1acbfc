"""SYNTHETIC routing traces of DeepSeek models [tokens, layers, top_k], fitted to published figures.

No ordered routing trace of DeepSeek-V3/R1 or V4-Flash is public, so these traces imitate what is published
(data/routing-figures.json names every source): each layer's share of uses per expert, and how much a token reuses
the previous token's experts. The model of a token's routing at one layer (our own):

  score(e) = log w(e) + Gumbel noise;  the router's selection on the scores (V3: 4 of 8 groups by the sum of their
  two best, then the top 8; V2-Lite and V4: the top k)

Without groups, top-k of log w + Gumbel draws k experts without replacement in proportion to w (Plackett-Luce), so
the weights w fix the popularity; groups distort it a little, which a few rounds of refitting w to the target
shares undo. The Gumbel noise of a (layer, expert) is a Gaussian AR(1) over tokens mapped through its CDF: each
token's noise is still Gumbel (the marginals stay), and the coefficient `rho` sets how often a token chooses again
what the token before it chose; it is fitted by bisection to the target next-token reuse. Layers are independent
of each other (no cross-layer structure: the runtime's prefetch under a trace draws its guesses at a stated
recall instead, runtime/models/trace_routing.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib.resources import files

import numpy as np
import torch

FIGURES = "routing-figures.json"
V3_COUNTS = "deepseek-v3-routing-frequencies.json"
# refits of w to the target shares
FIT_ROUNDS = 4
# rounds of fitting w, then rho
FIT_ALTERNATIONS = 2
# of rho
BISECT_STEPS = 14
# tokens of the fitting runs
SAMPLE_TOKENS = 1500
# tokens routed at once
CHUNK = 256


@dataclass(frozen=True)
class RouterShape:
    experts: int
    top_k: int
    groups: int = 1
    topk_groups: int = 1


def figures() -> dict:
    """The published and derived figures the traces are fitted to (data/routing-figures.json)."""
    return json.loads((files("dsfp4.synthetic") / "data" / FIGURES).read_text())


def v3_shares() -> np.ndarray:
    """DeepSeek-V3's published per-layer shares of uses [58, 256] (MoE layers 3-60; tt-metal's counts)."""
    data = json.loads((files("dsfp4.synthetic") / "data" / V3_COUNTS).read_text())["layers"]
    counts = np.array([data[str(layer)] for layer in range(3, 61)], dtype=np.float64)
    return counts / counts.sum(1, keepdims=True)


def zipf_shares(layers: int, experts: int, exponent: float, seed: int) -> np.ndarray:
    """Zipf-shaped shares [layers, experts], each layer's experts in a random order."""
    rng = np.random.default_rng([seed, 7])
    base = np.arange(1, experts + 1, dtype=np.float64) ** -exponent
    return np.stack([(base / base.sum())[rng.permutation(experts)] for _ in range(layers)])


def route(scores: np.ndarray, shape: RouterShape) -> np.ndarray:
    """The router's selection on scores [n, experts] -> ids [n, top_k], best first: group-limited (V3: groups
    ranked by the sum of their two best scores) when the shape has groups."""
    n, e = scores.shape
    if shape.groups > 1:
        g = scores.reshape(n, shape.groups, e // shape.groups)  # [n, groups, per_group]
        best = min(2, g.shape[2])
        group_score = np.partition(g, -best, axis=2)[:, :, -best:].sum(2)  # [n, groups]
        keep = np.argpartition(-group_score, shape.topk_groups - 1, axis=1)[:, : shape.topk_groups]
        mask = np.zeros((n, shape.groups), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        scores = np.where(mask[:, :, None], g, -np.inf).reshape(n, e)
    idx = np.argpartition(-scores, shape.top_k - 1, axis=1)[:, : shape.top_k]  # [n, top_k], unordered
    order = np.argsort(-np.take_along_axis(scores, idx, 1), axis=1)
    return np.take_along_axis(idx, order, 1)


def gumbel(z: np.ndarray) -> np.ndarray:
    """Standard Gaussians -> standard Gumbels through their CDFs (the same quantile)."""
    u = torch.special.ndtr(torch.from_numpy(np.asarray(z, dtype=np.float32))).clamp_(1e-7, 1 - 1e-7)
    return (-torch.log(-torch.log(u))).numpy()


class Noise:
    """Gumbel noise [tokens, layers, experts], chunk by chunk, whose underlying Gaussians `z` follow an AR(1) over
    tokens with coefficient rho (its state carries from one chunk to the next)."""

    def __init__(self, rng: np.random.Generator, layers: int, experts: int, rho: float):
        self.rng, self.rho = rng, rho
        self.z = rng.standard_normal((layers, experts))

    def gaussians(self, tokens: int) -> np.ndarray:
        """The next tokens' Gaussians [tokens, layers, experts] (the state moves on)."""
        out = np.empty((tokens, *self.z.shape), dtype=np.float32)
        fresh = self.rng.standard_normal(out.shape) * math.sqrt(1.0 - self.rho * self.rho)
        for t in range(tokens):
            self.z = self.rho * self.z + fresh[t]
            out[t] = self.z
        return out

    def next(self, tokens: int) -> np.ndarray:
        return gumbel(self.gaussians(tokens))


def _routing(rng: np.random.Generator, tokens: int, logws: np.ndarray, rho: float, shape: RouterShape) -> np.ndarray:
    """ids [tokens, layers, k] of routing with weights log w [layers, experts] and noise persistence rho."""
    layers, experts = logws.shape
    noise, out = Noise(rng, layers, experts, rho), []
    for start in range(0, tokens, CHUNK):
        n = min(CHUNK, tokens - start)
        scores = logws[None] + noise.next(n)  # [n, layers, experts]
        out.append(route(scores.reshape(n * layers, experts), shape).reshape(n, layers, shape.top_k))
    return np.concatenate(out)


def reuse(trace: np.ndarray) -> float:
    """Mean share of a token's experts that the token before it chose at the same layer."""
    same = (trace[1:, :, :, None] == trace[:-1, :, None, :]).any(-1)  # [tokens - 1, layers, k]
    return float(same.mean())


def _fit_weights(shares: np.ndarray, rho: float, shape: RouterShape, seed: int) -> np.ndarray:
    """log w [layers, experts] such that the routing's shares of uses match `shares`."""
    target = np.log(np.maximum(shares, 1e-6))
    logws = target.copy()
    for i in range(FIT_ROUNDS):
        ids = _routing(np.random.default_rng([seed, 11, i]), SAMPLE_TOKENS, logws, rho, shape)
        for layer in range(shares.shape[0]):
            got = np.bincount(ids[:, layer].ravel(), minlength=shape.experts) / (SAMPLE_TOKENS * shape.top_k)
            logws[layer] += target[layer] - np.log(np.maximum(got, 0.5 / (SAMPLE_TOKENS * shape.top_k)))
    return logws


def _fit_rho(logws: np.ndarray, target_reuse: float, shape: RouterShape, seed: int) -> float:
    """The AR(1) coefficient whose routing reuses `target_reuse` of the previous token's experts (on a sample of
    the layers); reuse grows with rho."""
    sample = logws[:: max(1, len(logws) // 8)]
    lo, hi = 0.0, 0.999
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        trial = _routing(np.random.default_rng([seed, 13]), SAMPLE_TOKENS, sample, mid, shape)
        lo, hi = (mid, hi) if reuse(trial) < target_reuse else (lo, mid)
    return (lo + hi) / 2


def synthetic_trace(
    shares: np.ndarray, shape: RouterShape, tokens: int, target_reuse: float, seed: int = 0
) -> tuple[np.ndarray, float]:
    """A trace int32 [tokens, layers, top_k] whose layers' shares of uses follow `shares` [layers, experts] and
    whose tokens reuse `target_reuse` of the previous token's experts; and the fitted rho. Deterministic. The shares
    alone give independent tokens some reuse (the sum of squared shares over k): a lower target ends at rho 0."""
    layers, experts = shares.shape
    if experts != shape.experts or experts % shape.groups or shape.top_k > experts:
        raise ValueError(f"shares of {experts} experts do not fit a router of {shape}")
    if not 0.0 <= target_reuse < 1.0:
        raise ValueError(f"reuse {target_reuse}: give a share from 0 to 1")
    logws, rho = fit_generator(shares, shape, target_reuse, seed)
    trace = _routing(trace_rng(seed), tokens, logws, rho, shape)
    return trace.astype(np.int32), rho


def trace_rng(seed: int) -> np.random.Generator:
    """The generator a trace of `seed` draws its noise from (scripts/online_bound.py draws it again)."""
    return np.random.default_rng([seed, 17])


def fit_generator(
    shares: np.ndarray, shape: RouterShape, target_reuse: float, seed: int = 0
) -> tuple[np.ndarray, float]:
    """The generator's parameters -> (log w [layers, experts], rho) for the shares and the reuse."""
    rho = 0.0
    # the weights move the reuse a little, rho the shares: fit each in turn
    for _ in range(FIT_ALTERNATIONS):
        logws = _fit_weights(shares, rho, shape, seed)
        rho = _fit_rho(logws, target_reuse, shape, seed)
    return _fit_weights(shares, rho, shape, seed), rho


def top_share(trace: np.ndarray, n_experts: int, frac: float) -> float:
    """Share of the uses (mean over layers) that go to each layer's most used `frac` of experts."""
    n_top = max(1, round(frac * n_experts))
    shares = []
    for layer in range(trace.shape[1]):
        counts = np.sort(np.bincount(trace[:, layer].ravel(), minlength=n_experts))[::-1]
        shares.append(counts[:n_top].sum() / counts.sum())
    return float(np.mean(shares))


def gini(trace: np.ndarray, n_experts: int) -> float:
    """Mean over layers of the Gini coefficient of the experts' use counts."""
    out = []
    for layer in range(trace.shape[1]):
        c = np.sort(np.bincount(trace[:, layer].ravel(), minlength=n_experts)).astype(np.float64)
        n = len(c)
        out.append(float((2 * np.arange(1, n + 1) - n - 1) @ c / (n * c.sum())))
    return float(np.mean(out))


def hit_in_previous(trace: np.ndarray, window: int) -> float:
    """Share of a token's experts that one of the `window` tokens before it chose at the same layer."""
    tokens = trace.shape[0]
    if tokens <= window:
        # no token has that many before it
        return float("nan")
    hits = np.zeros(trace[window:].shape, dtype=bool)  # [tokens - W, layers, k]
    for back in range(1, window + 1):
        prev = trace[window - back : tokens - back]
        hits |= (trace[window:, :, :, None] == prev[:, :, None, :]).any(-1)
    return float(hits.mean())


def trace_stats(trace: np.ndarray, n_experts: int) -> dict[str, float]:
    """The figures the traces are fitted to and checked against (the published ones are in FIGURES)."""
    return {
        "top10": top_share(trace, n_experts, 0.10),
        "top25": top_share(trace, n_experts, 0.25),
        "top50": top_share(trace, n_experts, 0.50),
        "gini": gini(trace, n_experts),
        "next_token_reuse": reuse(trace),
        **{f"hit_in_previous_{w}": hit_in_previous(trace, w) for w in (2, 4, 8, 16)},
    }
