"""The contract a model family meets (models/v3, models/v4): what the engine, the decode graphs, the routing
recorder and the layer-wise profiler ask of a model, and nothing more. Legend: B batch, T tokens, D dim, V vocab.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dsfp4.kernels.linear import QuantizedWeight
from dsfp4.kernels.moe.kernel import MoEKernel
from dsfp4.layout.model_args import ModelArgs
from dsfp4.runtime.models.card_map import CardCut, CardMap
from dsfp4.runtime.models.moe import MoE
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.store.expert_store import ExpertStore


class Block(Protocol):
    """One decoder block: `moe` tells whether its feed-forward `ffn` is an MoE layer."""

    moe: bool
    ffn: MoE | nn.Module

    def route(self, h: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """The experts this block's router would pick for the residual stream h that the block before it gave
        (tokens [B, T]: for hash-routed layers) -> [B * T, K]."""


class Model(Protocol):
    """A model family's transformer over a converted model: weights from the manifest, routed experts from the
    store, caches for one sequence of max_len positions."""

    args: ModelArgs
    device: torch.device
    experts: ExpertStore
    # None when the model has no routed experts
    moe_kernel: MoEKernel | None
    # of Block
    layers: nn.ModuleList
    # the MTP blocks, when loaded with them
    mtp: nn.ModuleList
    head: QuantizedWeight
    # why decode steps cannot be captured as CUDA graphs (None: they can)
    why_eager: str | None
    # a split run's cards (runtime/models/card_map.py; None on one device), and while a step is captured the cut
    # that ends one card's piece (runtime/generate/decode_graph.py)
    cards: CardMap | None
    card_cut: CardCut | None

    def __call__(
        self, tokens: torch.Tensor, start_pos: int | DevicePosition = 0, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [B, T] at positions start_pos.. (or one token at a DevicePosition, a captured decode step)
        -> (logits [B, T or 1, V] fp32, final hidden states [B, T, D], normed)."""

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] -> what enters block 0 (V3: [B, T, D]; V4: its streams, [B, T, N, D])."""

    def block_attention(self, i: int, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Block i's attention alone, with its residual add, on what block i - 1 gave for tokens at start_pos
        (runtime/generate/layer_pass.py: a prompt prefilled layer by layer, prompts together, the profile's pass)."""

    def block_ffn(self, i: int, x: torch.Tensor, tokens: torch.Tensor, piece: int) -> torch.Tensor:
        """Block i's feed-forward alone, with its residual add, on what its attention gave for tokens [B, T] (any
        tokens: it works token by token), its kernels taking at most `piece` tokens at a time; the next layer's experts
        are not predicted (the pass reads them ahead itself)."""

    def finish(self, x: torch.Tensor, end: int, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """What the last block gave (block_ffn) for tokens before position `end`, every block having taken them ->
        (logits [B, T or 1, V] fp32, final hidden states [B, T, D], normed), as __call__ ends."""

    def reusable(self, keep: int) -> int:
        """How many cached tokens a call may keep when it would keep `keep` (V4's caches hold their last positions
        only)."""

    def positional_caches(self, slot: int = 0) -> dict[str, torch.Tensor] | None:
        """The caches written by position, by name: each [max_len, ...], the rows of the sequence in cache `slot`
        (what the prompt cache saves and restores, what a batch's sequences move between); None when the family's
        caches are not all addressed by position (it then decodes no batch)."""

    def replayed(self, pos: int) -> None:
        """A captured step at pos was replayed (its Python did not run): bring host-side state up to date."""
