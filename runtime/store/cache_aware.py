"""Cache-aware routing (RunOptions.cache_aware): a token's chosen expert that would come from the SSD is replaced by an
unchosen expert of the same group that is already on the device or in RAM, when the router scored that one within a
margin of it. Same group: the token's set of groups (V3's 4 of 8) stays what the router picked. The replacement is
the best-scored such expert; the token's weights are then what the router's weighting gives the new set
(kernels/router/route.py chosen_weights: DeepSeek's renormalization over the experts used). The rule itself is
lever_rules.swap_cold's; this is its view of one layer step's tensors.

Legend: T tokens, K chosen experts per token, E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dsfp4.kernels.router.route import chosen_weights
from dsfp4.runtime.store.lever_rules import swap_cold


class WarmTiers(Protocol):
    """What a swap asks of the tiers (step_levers.StepLevers)."""

    def is_warm(self, layer: int, expert: int) -> bool: ...

    def count_swaps(self, n: int) -> None: ...


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

    def apply(self, store: WarmTiers, layer: int, ids: list[int]) -> list[int]:
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
