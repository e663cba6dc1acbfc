"""Cache-aware routing (RunOptions.cache_aware): a token's chosen expert that would come from the SSD is replaced by an
unchosen expert of the same group that is already on the device or in RAM, when the router scored that one within a
margin of it. Same group: the token's set of groups (V3's 4 of 8) stays what the router picked. The replacement is
the best-scored such expert; the token's weights are then what the router's weighting gives the new set
(kernels/router/route.py chosen_weights: DeepSeek's renormalization over the experts used).

Legend: T tokens, K chosen experts per token, E routed experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsfp4.kernels.router.route import chosen_weights

if TYPE_CHECKING:
    from dsfp4.runtime.store.expert_store import ExpertStore


def swap_cold(
    ids: np.ndarray, choice: np.ndarray, warm: Callable[[int], bool], groups: int, margin: float
) -> tuple[np.ndarray, int]:
    """ids: [T, K] the router's choice, choice: [T, E] the scores it ranked by (with its bias), warm(e): whether e's
    record is on the device or in RAM -> (the ids with each cold choice swapped for the best-scored warm unchosen
    expert of its group scored at least choice - margin, the number of swaps). A cold expert is swapped only when
    every token that chose it can swap it: otherwise it is read anyway, and no token pays for a swap that saves
    nothing (as the threshold leaves an expert out only when no token keeps it). Pure: the inputs are not changed."""
    per_group = choice.shape[1] // groups
    proposed: dict[tuple[int, int], int] = {}  # (token, slot) -> the warm expert it would take
    for t in range(ids.shape[0]):
        taken = set(ids[t].tolist())
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if warm(e):
                continue
            first = e // per_group * per_group
            candidates = [
                c
                for c in range(first, first + per_group)
                if c not in taken and choice[t, c] >= choice[t, e] - margin and warm(c)
            ]
            if candidates:
                best = max(candidates, key=lambda c: choice[t, c])
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


@dataclass(frozen=True)
class Swap:
    """One layer step's inputs to cache-aware routing. indices and weights are the tensors the expert kernel reads: a
    swap rewrites them in place (so a captured decode step's next piece reads the new choice)."""

    indices: torch.Tensor  # [T, K] int64
    weights: torch.Tensor  # [T, K] fp32
    scores: torch.Tensor  # [T, E] fp32, without the selection bias
    bias: torch.Tensor | None  # [E]
    groups: int
    norm: bool
    scale: float
    margin: float

    def apply(self, store: ExpertStore, layer: int, ids: list[int]) -> list[int]:
        """ids: the step's [T * K] choice as the host read it -> the choice to load (swapped where cold)."""
        k = self.indices.shape[-1]
        chosen = np.array(ids, dtype=np.int64).reshape(-1, k)  # [T, K]
        if all(store.is_warm(layer, e) for e in set(ids)):
            return ids
        choice = self.scores if self.bias is None else self.scores + self.bias
        warm = lambda e: store.is_warm(layer, e)  # noqa: E731
        new, swaps = swap_cold(chosen, choice.cpu().numpy(), warm, self.groups, self.margin)
        if not swaps:
            return ids
        store.count_swaps(swaps)
        self.indices.copy_(torch.from_numpy(new).to(self.indices.device))
        self.weights.copy_(chosen_weights(self.scores, self.indices, self.norm, self.scale))
        return new.ravel().tolist()
