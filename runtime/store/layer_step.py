"""One streamed MoE layer's step on the tiers, as the model and the store see it: what the layer asks for (LayerAsk)
and what it gets to compute with (LayerExperts), from one call, ExpertStore.step.

Legend: T tokens, D dim, K chosen experts per token, E routed experts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dsfp4.runtime.store.cache_aware import Swap
from dsfp4.runtime.store.host_lane import HostJob
from dsfp4.runtime.store.lever_rules import kept_weights


@dataclass(frozen=True)
class HostInputs:
    """What the CPU lane (host_lane.py) reads of a layer step: its input x [T, D] and the tokens' weights [T, K] (after
    any cache-aware swap). Captured steps also hold the device buffers the next piece reads: `out` [T, D], the host's
    sum, added to the layer's output, and `kept` [E] bool, the experts the host computed (they have no slot, yet are
    not left out)."""

    x: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor | None = None
    kept: torch.Tensor | None = None

    @classmethod
    def captured(cls, x: torch.Tensor, weights: torch.Tensor, n_experts: int) -> HostInputs:
        return cls(x, weights, torch.zeros_like(x), torch.zeros(n_experts, dtype=torch.bool, device=x.device))

    def fill(self, job: HostJob | None) -> None:
        """Captured: the host's sum and experts into the buffers the next piece reads (zero when it took none)."""
        if job is None:
            self.out.zero_()
            self.kept.zero_()
            return
        self.out.copy_(job.result().to(self.out.dtype).pin_memory(), non_blocking=True)
        kept = torch.zeros(self.kept.shape, dtype=torch.bool)
        kept[job.experts] = True
        self.kept.copy_(kept.pin_memory(), non_blocking=True)


@dataclass(frozen=True)
class LayerAsk:
    """What a streamed MoE layer asks the store for: the experts its tokens chose (ids[:chosen]) and, when `after` is
    set, those predicted for that next MoE layer (ids[chosen:]), to prefetch; with `weights` (the tokens' [T, K], under
    an expert threshold) tokens may leave cold experts out; with `swap` (cache-aware routing) they may first trade a
    cold expert for a warm one (cache_aware.py); with `lane` the store may compute some RAM hits on the
    host (host_lane.py)."""

    layer: int
    ids: torch.Tensor  # [chosen + predicted] on the device
    chosen: int
    after: int | None
    weights: torch.Tensor | None = None  # [T, K]
    swap: Swap | None = None
    lane: HostInputs | None = None


@dataclass
class LayerExperts:
    """What a layer step computes with: its distinct chosen experts, the store's waves of those the device computes
    (each yielded once its records are on the device for compute queued next), the [T * K] choices that tokens left
    out (None without a threshold) and the host's job (None when it takes no expert)."""

    layer: int
    chosen: list[int]
    waves: Iterator[list[int]]
    drop: list[bool] | None
    job: HostJob | None
    # ExpertStore.offsets
    table: Callable[[int, list[int] | None], torch.Tensor]

    def offsets(self) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Each wave's experts, and its record offsets [E] for the expert kernel, every other expert -1."""
        for wave in self.waves:
            yield wave, self.table(self.layer, None if len(wave) == len(self.chosen) else wave)

    def kept(self, weights: torch.Tensor) -> torch.Tensor:
        """weights [T, K] with the choices left out weighing 0, each token's others rescaled to its former sum."""
        if self.drop is None or not any(self.drop):
            return weights
        return kept_weights(weights, ~torch.tensor(self.drop, device=weights.device).view(weights.shape))
