"""Expert uses counted on the device, for steps that never return to the host (CUDA-graph replays).

A host counter runs only when Python does; a replayed graph skips Python, so a run whose experts are
reached without the host (runtime/store/placement.py, `map_all`) counts each layer step with two small
kernels that the graph captures, and the store folds the totals into its host counters when they are
read (one sync then, none per step). Legend: L blocks, E routed experts, T tokens, K experts per token.
"""

from __future__ import annotations

import numpy as np
import torch

from dsfp4.runtime.store.counters import StoreCounters


class DeviceUseCounts:
    def __init__(self, on_device: np.ndarray, device: torch.device):
        """on_device: [L, E] bool, the records in device slots (the others are read from RAM in place)."""
        self.on_device = on_device
        self.uses = torch.zeros(on_device.shape, dtype=torch.int64, device=device)  # [L, E] (token, expert) pairs
        self.steps = torch.zeros(on_device.shape[0], dtype=torch.int64, device=device)  # [L] layer steps
        # never replaced: graphs hold its address
        self._one = torch.ones(1, dtype=torch.int64, device=device)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        """One step of `layer` with its routing ids: [T, K]."""
        flat = ids.flatten()
        # no buffer sized by T
        self.uses[layer].index_add_(0, flat, self._one.expand(flat.numel()))
        self.steps[layer : layer + 1].add_(1)

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """(uses [L, E], steps [L]) counted since the last take, and zero them (waits for the device)."""
        uses, steps = self.uses.to("cpu", copy=True).numpy(), self.steps.to("cpu", copy=True).numpy()
        self.uses.zero_()
        self.steps.zero_()
        return uses, steps

    def fold_into(self, counters: StoreCounters, record_bytes: int) -> None:
        """Add the uses counted since the last take to `counters` by tier; each use of a RAM record is one
        record read over PCIe (exact at decode, where a kernel reads an expert once per token; an upper
        bound in prefill, where it reads it once per block of tokens)."""
        uses, steps = self.take()
        for layer in np.flatnonzero(steps):
            n, device = int(uses[layer].sum()), int(uses[layer][self.on_device[layer]].sum())
            counters.add_layer(int(layer), n, device, n - device, int(steps[layer]))
            counters.gpu_hits += device
            counters.ram_hits += n - device
            counters.h2d_bytes += (n - device) * record_bytes
