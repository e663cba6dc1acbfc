"""Watching the router: which experts each MoE layer chose for every token the model computes.

A RoutingRecorder hooks every MoE layer of a model (MoE.observe): it sees the routing of the tokens
computed, never the prefetcher's predictions. Counts and weight sums stay on the device (no host sync);
the ordered trace, when asked for, is copied to the host as it comes.
"""

from __future__ import annotations

import numpy as np
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.routing_trace import RoutingTrace
from dsfp4.runtime.model import Transformer


class RoutingRecorder:
    def __init__(self, model: Transformer, trace: bool = False):
        self.moe = [block.ffn for block in model.layers if block.moe]
        self.layers = tuple(m.layer for m in self.moe)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        n, device, self.top_k = model.args.n_routed_experts, model.freqs_cis.device, model.args.n_activated_experts
        self.counts = torch.zeros((len(self.moe), n), dtype=torch.int64, device=device)  # [layers, E]
        self.weights = torch.zeros((len(self.moe), n), dtype=torch.float64, device=device)  # [layers, E]
        self.trace = trace
        self._ids: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}  # chunks of [T, K]
        self._weights: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self.token_ids: list[int] = []  # the tokens computed, when the caller knows them
        for m in self.moe:
            if m.observe is not None:
                raise ConfigError("this model already has a routing recorder attached")
            m.observe = self

    def __call__(self, layer: int, weights: torch.Tensor, indices: torch.Tensor) -> None:
        """weights, indices: [T, K] of one MoE layer's routing."""
        r, flat = self.row[layer], indices.flatten()
        self.counts[r] += torch.bincount(flat, minlength=self.counts.shape[1])
        self.weights[r].index_add_(0, flat, weights.flatten().double())
        if self.trace:
            self._ids[layer].append(indices.to(torch.int32).cpu().numpy())
            self._weights[layer].append(weights.float().cpu().numpy())

    def detach(self) -> None:
        for m in self.moe:
            m.observe = None

    @property
    def tokens(self) -> int:
        """Tokens routed so far (by the first MoE layer; layer-wise passes fill the layers in turn)."""
        return int(self.counts[0].sum()) // self.top_k if self.moe else 0

    def profile(self, conversion: str, sources: tuple[str, ...]) -> HotProfile:
        counts, weights = self.counts.cpu().tolist(), self.weights.cpu().tolist()
        return HotProfile(
            conversion,
            self.tokens,
            {layer: tuple(counts[i]) for i, layer in enumerate(self.layers)},
            {layer: tuple(weights[i]) for i, layer in enumerate(self.layers)},
            sources,
        )

    def routing_trace(self) -> RoutingTrace:
        """The trace recorded so far: [tokens, layers, top_k] ids and weights, token ids when known."""
        if not self.trace:
            raise ConfigError("this recorder was not asked to keep a trace")
        n = {layer: sum(len(c) for c in chunks) for layer, chunks in self._ids.items()}
        if len(set(n.values())) != 1 or not n[self.layers[0]]:
            raise ConfigError(f"no complete trace: tokens routed per MoE layer {sorted(set(n.values()))}")
        ids = np.stack([np.concatenate(self._ids[layer]) for layer in self.layers], axis=1)
        weights = np.stack([np.concatenate(self._weights[layer]) for layer in self.layers], axis=1)
        tokens = np.asarray(self.token_ids, dtype=np.int64) if len(self.token_ids) == len(ids) else None
        return RoutingTrace(ids, weights, np.asarray(self.layers, dtype=np.int32), tokens)
