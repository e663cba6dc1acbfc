"""The lossy levers (runtime/modes.py) projected on the whole model: its decode under a calibrated routing trace, as
whole_model.py projects exact routing, with each lever applied where the store would apply it.

A calibrated trace (synthetic/routing_trace.py) holds the experts chosen, not their weights nor the router's scores
of the others. What the levers need of those is measured on a trained model and carried over, stated:
- expert threshold T: the share of a token's non-best choices that weigh below T (routing weights normalized per
  token, from a routing trace the trained model recorded: `dsfp4 run --record-trace`); each such choice of the
  calibrated trace is drawn at that share, independently.
- cache-aware margin D: the share of (chosen, unchosen same-group) pairs scored within D (scripts/router_margins.py
  on the trained model); the simulation's SwapModel takes a warm neighbour of a cold choice at that share.
- experts per token K (--experts-per-token): each token of the calibrated trace keeps its K heaviest (top_k.py);
  the threshold's share is then read on the recorded weights with as many dropped (7 of 8 as 5 of 6, top_k.same_drop).
- cold records of B bits: a property of the model, not a lever of the run, projected beside each mode: the records
  outside each layer's hot set (as much as the plan's slots hold) read and copied at their cold size.
Legend: N tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsfp4.layout.recipe import ColdRecipe
from dsfp4.projection.simulate import Projection, SwapModel
from dsfp4.projection.top_k import heaviest_weights, same_drop
from dsfp4.projection.whole_model import machine_run
from dsfp4.runtime.modes import Levers


def low_share(weights: np.ndarray, threshold: float) -> float:
    """weights: [N, L, K] routing weights of a recorded trace -> the share of non-best choices that weigh below
    `threshold` of their token's routed weight."""
    w = weights / weights.sum(-1, keepdims=True)
    # best first
    w = -np.sort(-w, axis=-1)
    return float((w[..., 1:] < threshold).mean())


def skippable(shape: tuple[int, ...], share: float, seed: int) -> np.ndarray | None:
    """[N, L, K] bool: each choice but the first (a calibrated trace lists a token's best first) at `share`."""
    if share <= 0:
        return None
    low = np.random.default_rng([seed, 31]).random(shape) < share
    low[..., 0] = False
    return low


def margin_shares(choice: np.ndarray, ids: np.ndarray, groups: int, margins: list[float]) -> dict[str, dict]:
    """choice: [N, E] selection scores, ids: [N, K] the experts chosen on them -> per margin the share of (chosen,
    unchosen same-group) pairs within it and the share of choices with at least one."""
    n, e = choice.shape
    per_group = e // groups
    chosen = np.zeros_like(choice, dtype=bool)
    np.put_along_axis(chosen, ids, True, axis=1)
    rows = np.arange(n)[:, None]
    group_of = ids // per_group  # [N, K]
    members = group_of[..., None] * per_group + np.arange(per_group)  # [N, K, per_group] the choice's group
    gap = choice[rows, ids][..., None] - choice[rows[..., None], members]  # [N, K, per_group]
    unchosen = ~chosen[rows[..., None], members]
    out = {}
    for d in margins:
        near = unchosen & (gap <= d)
        out[str(d)] = {"close": float(near.sum() / max(unchosen.sum(), 1)), "any": float(near.any(-1).mean())}
    return out


@dataclass(frozen=True)
class LeverRow:
    mode: str
    machine: str
    levers: Levers
    low_share: float
    close: float
    projection: Projection
    # a width, or a recipe (layout/recipe.py)
    cold_bits: int | ColdRecipe | None = None
    # with cold_bits: given, or None for the plan's held share
    hot_share: float | None = None
    # bits per routed weight as stored, scales included (MachineRun.routed_bits)
    routed_bits: float = 0.0
    # --experts-per-token (0: the model's own)
    experts_per_token: int = 0

    def to_dict(self) -> dict:
        p = self.projection
        return {
            "mode": self.mode,
            "machine": self.machine,
            "expert_threshold": self.levers.expert_threshold,
            "cache_aware": self.levers.cache_aware,
            "low_share": self.low_share,
            "close": self.close,
            "cold_bits": self.cold_bits if not isinstance(self.cold_bits, ColdRecipe) else str(self.cold_bits),
            "hot_share": self.hot_share,
            "routed_bits": self.routed_bits,
            "experts_per_token": self.experts_per_token,
            "tok_s": p.tok_s,
            "ssd_gb_per_token": p.ssd_bytes / 1e9,
            "pcie_gb_per_token": p.pcie_bytes / 1e9,
            "skipped_share": p.skipped / max(p.uses + p.skipped, 1e-9),
            "swapped_share": p.swapped / max(p.uses + p.skipped, 1e-9),
            "host_share": p.host_computed / max(p.uses, 1e-9),
        }


def project_levers(
    family: str,
    ids: np.ndarray,
    machines: list[str],
    eff: float,
    modes: dict[str, Levers],
    weights: np.ndarray,
    close: dict[float, float],
    recall: float = 0.9,
    seed: int = 0,
    cold_bits: tuple[int | ColdRecipe | None, ...] = (None,),
    cpu: float = 0.0,
    hot_share: float | None = None,
    experts_per_token: tuple[int, ...] = (0,),
    trace_weights: np.ndarray | None = None,
) -> list[LeverRow]:
    """The whole model of `family` decoding the calibrated trace `ids` [N, L, K] on each machine under each mode's
    levers, the store as shipped (hot policy, prefetch at `recall` copying up from RAM only), with the model's cold
    records of each of `cold_bits` (a width or a recipe; None: none) outside each layer's hottest `hot_share`
    (MachineRun.decode's default). weights: a recorded trace's routing weights; close: margin -> pair share
    (scripts/router_margins.py), for every margin used; cpu: the CPU lane's kernel rate, bytes/s (0: none);
    experts_per_token: each K of them (0: all) with each mode, the trace's choices kept by `trace_weights` where it
    has them (top_k.keep)."""
    rows = []
    for name, k in ((name, k) for name in machines for k in experts_per_token):
        r = machine_run(family, name, ids, eff, experts_per_token=k, weights=trace_weights)
        groups = max(r.m.args.n_expert_groups, 1)
        kept = heaviest_weights(weights, same_drop(k, ids.shape[-1], weights.shape[-1]))
        for mode, levers in modes.items():
            share = low_share(kept, levers.expert_threshold) if levers.expert_threshold else 0.0
            near = close[levers.cache_aware] if levers.cache_aware else 0.0
            swap = SwapModel(groups, near, seed) if near else None
            for bits in cold_bits:
                low = skippable(r.run.shape, share, seed)
                p = r.decode("hot", recall, False, low, swap, bits, cpu, levers.adaptive, hot_share)
                held = hot_share if bits else None
                bits_a_weight = r.routed_bits(bits, hot_share)
                rows.append(LeverRow(mode, name, levers, share, near, p, bits, held, bits_a_weight, k))
    return rows
