"""`dsfp4 profile-hot --report`: how skewed each layer's routing is, and what a static hot set would hit.

Per layer: the share of selections covered by the hottest 10% and 25% of experts, and the Gini
coefficient of the counts (0: every expert equally used; 1: one expert takes everything). Then the
share of expert uses a static hot set would serve at the planner's budgets: the hottest records on the
device, the next in RAM (what the warm start loads). That is an upper bound for the calibration text's
own distribution; the runtime's eviction policies adapt to the conversation instead.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsfp4.layout.atomic import atomic_write_bytes
from dsfp4.layout.hot_profile import HotProfile


@dataclass(frozen=True)
class LayerSkew:
    layer: int
    top10: float
    top25: float
    gini: float
    # expert
    hottest: int
    hottest_share: float


def coverage(counts: np.ndarray) -> np.ndarray:
    """Share of selections covered by the hottest 1, 2, ... experts: [E], ending at 1."""
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    total = c.sum()
    return np.cumsum(c) / total if total else np.zeros_like(c)


def gini(counts: np.ndarray) -> float:
    c = np.sort(np.asarray(counts, dtype=np.float64))
    n, total = len(c), c.sum()
    if not total:
        return 0.0
    return float(2 * np.sum(np.arange(1, n + 1) * c) / (n * total) - (n + 1) / n)


def _top_share(cov: np.ndarray, fraction: float) -> float:
    return float(cov[max(int(round(fraction * len(cov))), 1) - 1])


def layer_skew(profile: HotProfile) -> list[LayerSkew]:
    rows = []
    for layer, counts in sorted(profile.counts.items()):
        c = np.asarray(counts)
        cov = coverage(c)
        hottest = profile.order(layer)[0]
        share = c[hottest] / c.sum() if c.sum() else 0.0
        rows.append(LayerSkew(layer, _top_share(cov, 0.10), _top_share(cov, 0.25), gini(c), hottest, float(share)))
    return rows


def static_hit_rates(profile: HotProfile, gpu_slots: int, ram_slots: int) -> tuple[float, float]:
    """(device, device or RAM): the share of expert uses the warm-start placement serves."""
    ranked = np.asarray(sorted((x for c in profile.counts.values() for x in c), reverse=True), dtype=np.float64)
    total = ranked.sum()
    if not total:
        return 0.0, 0.0
    return float(ranked[:gpu_slots].sum() / total), float(ranked[: gpu_slots + ram_slots].sum() / total)


def report_table(profile: HotProfile, gpu_slots: int, ram_slots: int, device: str) -> str:
    rows = layer_skew(profile)
    lines = [f"{'layer':>5}  {'top 10%':>8}  {'top 25%':>8}  {'gini':>5}  hottest expert"]
    for r in rows:
        lines.append(
            f"{r.layer:>5}  {r.top10:>8.1%}  {r.top25:>8.1%}  {r.gini:>5.2f}  {r.hottest} ({r.hottest_share:.1%})"
        )
    mean = [np.mean([getattr(r, f) for r in rows]) for f in ("top10", "top25", "gini")]
    lines.append(f"{'mean':>5}  {mean[0]:>8.1%}  {mean[1]:>8.1%}  {mean[2]:>5.2f}")
    gpu, both = static_hit_rates(profile, gpu_slots, ram_slots)
    lines += [
        "",
        f"{profile.tokens} tokens profiled ({'; '.join(profile.sources)})",
        f"static hot set at the planner's budgets: {gpu_slots} slots on {device} serve {gpu:.1%} of expert uses; "
        f"with {ram_slots} RAM slots, {both:.1%} (the rest is read from the SSD)",
    ]
    return "\n".join(lines)


def write_plot(profile: HotProfile, path: Path) -> str | None:
    """Coverage curves of every layer (and their mean) as a PNG; a note instead when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed (pip install 'dsfp4[plot]'), so {path} was not drawn"
    curves = np.stack([coverage(np.asarray(c)) for _, c in sorted(profile.counts.items())])  # [layers, E]
    # no experts cover nothing: every curve starts at (0, 0)
    curves = np.pad(curves, ((0, 0), (1, 0)))
    x = np.arange(curves.shape[1]) / (curves.shape[1] - 1)
    fig, ax = plt.subplots(figsize=(7, 5))
    for curve in curves:
        ax.plot(x, curve, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(x, curves.mean(axis=0), color="tab:red", linewidth=2, label="mean of layers")
    ax.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=1, label="uniform routing")
    ax.set(xlabel="share of experts (hottest first)", ylabel="share of selections", xlim=(0, 1), ylim=(0, 1))
    ax.set_title(f"Expert coverage per MoE layer ({profile.tokens} tokens)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=120, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return None
