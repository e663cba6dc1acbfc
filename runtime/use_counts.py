"""Expert uses counted on the device, for steps that never return to the host (CUDA-graph replays).

A host counter runs only when Python does; a replayed graph skips Python, so a run whose experts are
reached without the host (runtime/expert_store.py, `map_all`) counts each layer step with two small
kernels that the graph captures, and the store folds the totals into its host counters when they are
read (one sync then, none per step). Legend: L blocks, E routed experts, T tokens, K experts per token.
"""

from __future__ import annotations

import numpy as np
import torch


class DeviceUseCounts:
    def __init__(self, blocks: int, experts: int, device: torch.device):
        self.uses = torch.zeros(blocks, experts, dtype=torch.int64, device=device)  # [L, E] (token, expert) pairs
        self.steps = torch.zeros(blocks, dtype=torch.int64, device=device)  # [L] layer steps
        self._one = torch.ones(1, dtype=torch.int64, device=device)  # never replaced: graphs hold its address

    def add(self, layer: int, ids: torch.Tensor) -> None:
        """One step of `layer` with its routing ids: [T, K]."""
        flat = ids.flatten()
        self.uses[layer].index_add_(0, flat, self._one.expand(flat.numel()))  # no buffer sized by T
        self.steps[layer : layer + 1].add_(1)

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """(uses [L, E], steps [L]) counted since the last take, and zero them (waits for the device)."""
        uses, steps = self.uses.to("cpu", copy=True).numpy(), self.steps.to("cpu", copy=True).numpy()
        self.uses.zero_()
        self.steps.zero_()
        return uses, steps
