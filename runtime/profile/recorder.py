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
from dsfp4.runtime.models.protocol import Model


class RoutingRecorder:
    """Routing of every token the model computes. What a forward pass records stays pending until the
    caller commits it (the pass completed) or discards it (it was interrupted), so every MoE layer always
    holds the same tokens."""

    def __init__(self, model: Model, trace: bool = False) -> None:
        self.moe = [block.ffn for block in model.layers if block.moe]
        self.layers = tuple(m.layer for m in self.moe)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        n, device, self.top_k = model.args.n_routed_experts, model.device, model.args.n_activated_experts
        self.counts = torch.zeros((len(self.moe), n), dtype=torch.int64, device=device)  # [layers, E]
        self.weights = torch.zeros((len(self.moe), n), dtype=torch.float64, device=device)  # [layers, E]
        # pending
        self._counts, self._weights = torch.zeros_like(self.counts), torch.zeros_like(self.weights)
        self.trace = trace
        # committed [T, K] chunks
        self._ids: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self._w: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self._pending: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {layer: [] for layer in self.layers}
        # the committed tokens, when the caller names them
        self.token_ids: list[int] = []
        for m in self.moe:
            if m.observe is not None:
                raise ConfigError("this model already has a routing recorder attached")
            m.observe = self

    def __call__(self, layer: int, weights: torch.Tensor, indices: torch.Tensor) -> None:
        """weights, indices: [T, K] of one MoE layer's routing."""
        r, flat = self.row[layer], indices.flatten()
        self._counts[r] += torch.bincount(flat, minlength=self.counts.shape[1])
        self._weights[r].index_add_(0, flat, weights.flatten().double())
        if self.trace:
            self._pending[layer].append((indices.to(torch.int32).cpu().numpy(), weights.float().cpu().numpy()))

    def commit(self, token_ids: list[int] = ()) -> None:
        """The pending routing belongs to completed passes over `token_ids` (may be left empty)."""
        self.counts += self._counts
        self.weights += self._weights
        for layer, chunks in self._pending.items():
            self._ids[layer] += [ids for ids, _ in chunks]
            self._w[layer] += [w for _, w in chunks]
        self.token_ids += list(token_ids)
        self.discard()

    def discard(self) -> None:
        """Forget the pending routing (of an interrupted pass)."""
        self._counts.zero_()
        self._weights.zero_()
        for chunks in self._pending.values():
            chunks.clear()

    def detach(self) -> None:
        """Unhook the layers and let them go (a closed engine frees them); what was recorded stays readable."""
        for m in self.moe:
            m.observe = None
        self.moe = []
        self.counts, self.weights = self.counts.cpu(), self.weights.cpu()

    @property
    def tokens(self) -> int:
        """Tokens whose routing was committed."""
        return int(self.counts[0].sum()) // self.top_k if len(self.counts) else 0

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
        weights = np.stack([np.concatenate(self._w[layer]) for layer in self.layers], axis=1)
        tokens = np.asarray(self.token_ids, dtype=np.int64) if len(self.token_ids) == len(ids) else None
        return RoutingTrace(ids, weights, np.asarray(self.layers, dtype=np.int32), tokens)
