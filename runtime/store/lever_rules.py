"""The rules of the store's levers, as pure functions of what a layer step chose and what the tiers hold: the expert
threshold (leave a light cold expert out), cache-aware routing (swap a cold choice for a warm one of its group) and the
CPU lane's share of the RAM hits. The store applies them to each streamed layer step (step_levers.py) and the
projection's simulation to a routing trace, so what is projected is what runs.

Legend: T tokens, K chosen experts per token.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

# an expert id of one layer, or a (layer, expert) key: the rules only compare them
Expert = Hashable


def light_choices(weights: Sequence[float], top_k: int, threshold: float) -> tuple[list[bool], list[float]]:
    """weights: a step's [T * K] routed weights -> (each choice its token weighs below `threshold` of its routed weight
    and that is not its best: the choices the threshold may leave out, each choice's share of its token's weight)."""
    light, shares = [], []
    for row in range(0, len(weights), top_k):
        w = weights[row : row + top_k]
        total, best = sum(w) or 1.0, max(range(len(w)), key=w.__getitem__)
        for j in range(len(w)):
            shares.append(w[j] / total)
            light.append(j != best and shares[-1] < threshold)
    return light, shares


def leave_out(ids: Sequence[Expert], light: Sequence[bool], cold: set[Expert]) -> tuple[set[Expert], list[bool]]:
    """ids: a step's [T * K] choices, light: those the threshold may leave out, cold: the chosen experts in neither the
    device nor RAM -> (the experts no token keeps, not read at all; the [T * K] choices left out: light and cold)."""
    drop = [is_light and e in cold for e, is_light in zip(ids, light, strict=True)]
    kept = {e for e, d in zip(ids, drop, strict=True) if not d}
    return cold - kept, drop


def unhidden(least_weighed_first: Sequence[Expert], n_cold: int, crossing: int, hide_ratio: float) -> list[Expert]:
    """The adaptive threshold (--expert-threshold auto): of the cold experts a step would leave out, least weighed
    first, those whose reads its `crossing` copies of RAM hits over PCIe cannot hide (floor(hide_ratio x crossing)
    of its `n_cold` reads are hidden)."""
    return list(least_weighed_first[: max(0, n_cold - int(hide_ratio * crossing))])


def host_count(share: float, crossing: int, eligible: int) -> int:
    """How many of a step's `crossing` experts (not on the device) the host takes, of `eligible` RAM hits: the whole
    number nearest the balance whose slower side ends first (host: c (1 - share), PCIe: (crossing - c) share, in units
    of one record's time on both together)."""
    low = int(share * crossing)
    cost = lambda c: max(c * (1 - share), (crossing - c) * share)  # noqa: E731
    return min(eligible, low if cost(low) <= cost(low + 1) else low + 1)


def host_candidates(
    experts: Sequence[Expert], on_device: Callable[[Expert], bool], may_read: Callable[[Expert], bool], share: float
) -> list[Expert]:
    """Of one layer step's distinct experts (in expert order), those the CPU lane takes: its share (host_count) of
    those not on the device, from the RAM hits it may read (`may_read`: in RAM, of the model's format, read done)."""
    crossing = [e for e in experts if not on_device(e)]
    eligible = [e for e in crossing if may_read(e)]
    return eligible[: host_count(share, len(crossing), len(eligible))]


# pick(token, cold choice, its warm unchosen group mates in expert order) -> the one it takes, or None
Pick = Callable[[int, int, list[int]], "int | None"]


def swap_cold_by(ids: np.ndarray, warm: Callable[[int], bool], per_group: int, pick: Pick) -> tuple[np.ndarray, int]:
    """Cache-aware routing's rule, whatever scores the choice: ids [T, K] -> (the ids with each cold choice swapped for
    the warm unchosen expert of its group that `pick` takes, the number of swaps). A cold expert is swapped only when
    every token that chose it can swap it: otherwise it is read anyway, and no token pays for a swap that saves
    nothing (as the threshold leaves an expert out only when no token keeps it). Pure: the inputs are not changed."""
    # (token, slot) -> the warm expert it would take
    proposed: dict[tuple[int, int], int] = {}
    for t in range(ids.shape[0]):
        taken = set(ids[t].tolist())
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if warm(e):
                continue
            first = e // per_group * per_group
            mates = [c for c in range(first, first + per_group) if c not in taken and warm(c)]
            if mates and (best := pick(t, e, mates)) is not None:
                proposed[t, j] = best
                taken.add(best)
    slots = [(t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])]
    stuck = {int(ids[t, j]) for t, j in slots if (t, j) not in proposed and not warm(int(ids[t, j]))}
    out = ids.copy()
    swaps = 0
    for (t, j), best in proposed.items():
        if int(ids[t, j]) not in stuck:
            out[t, j] = best
            swaps += 1
    return out, swaps


def swap_cold(
    ids: np.ndarray, choice: np.ndarray, warm: Callable[[int], bool], groups: int, margin: float
) -> tuple[np.ndarray, int]:
    """ids: [T, K] the router's choice, choice: [T, E] the scores it ranked by (with its bias), warm(e): whether e's
    record is on the device or in RAM -> swap_cold_by, each cold choice taking the best-scored warm unchosen expert of
    its group scored at least choice - margin."""

    def best(t: int, e: int, mates: list[int]) -> int | None:
        near = [c for c in mates if choice[t, c] >= choice[t, e] - margin]
        return max(near, key=lambda c: choice[t, c]) if near else None

    return swap_cold_by(ids, warm, choice.shape[1] // groups, best)


def kept_weights(weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """weights: [T, K], keep: [T, K] bool -> the kept experts' weights rescaled to each token's former sum (the
    experts left out weigh 0), as DeepSeek-V3's top-k renormalization would weight the experts that remain."""
    kept = weights * keep
    return kept * (weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny))
