"""Which card of a split run (--devices) each part of the model lives on, from the plan's cards
(runtime/plan/cards.py), and the hidden state's copy from a card to the next.

Blocks go where the plan put their layer; the embedding on the first card; the final norm and the head (and the MTP
layer) on the last. A card is an index, not a torch device: the same device named twice is two cards, and the
hidden state is copied at the cut all the same (the split path runs whole on one device: tests, one-GPU checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.plan.planner import Plan

if TYPE_CHECKING:
    from dsfp4.runtime.models.v3.model import Transformer

# (hidden state, the step's position, the next card) -> both as that card reads them: a captured step's cut
CardCut = Callable[[torch.Tensor, "int | DevicePosition", int], "tuple[torch.Tensor, int | DevicePosition]"]
EMBED = "embed.weight"
LAYER_PREFIX = "layers."


def device_key(device: torch.device | str) -> str:
    """A device's name with its index: "cuda" is the current CUDA device's ("cuda:0"), as a tensor's device says."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


@dataclass(frozen=True)
class CardMap:
    """cards: each card's device; card_of: each block's card (the main layers' and the MTP layers')."""

    cards: tuple[torch.device, ...]
    card_of: dict[int, int]

    @classmethod
    def of_plan(cls, plan: Plan) -> CardMap | None:
        """The plan's cards (None for a run on one device)."""
        if not plan.cards:
            return None
        devices = tuple(torch.device(c.device) for c in plan.cards)
        return cls(devices, {i: c for c, share in enumerate(plan.cards) for i in share.layers})

    @property
    def last(self) -> int:
        return len(self.cards) - 1

    def of_name(self, name: str) -> torch.device:
        """The device of a backbone tensor by its manifest name: its layer's card; the embedding on the first, the rest
        (final norm, head) on the last."""
        if name.startswith(LAYER_PREFIX):
            return self.cards[self.card_of[int(name.split(".")[1])]]
        return self.cards[0 if name == EMBED else self.last]

    def of_layer(self, layer: int) -> torch.device:
        return self.cards[self.card_of[layer]]

    def hop(self, x: torch.Tensor, card: int) -> torch.Tensor:
        """x onto `card`, copied once (non-blocking where it crosses CUDA cards: torch orders the copy on both
        cards' current streams)."""
        return x.to(self.cards[card], non_blocking=True, copy=True)


def position_on(start_pos: int | DevicePosition, device: torch.device) -> int | DevicePosition:
    """A step's position as a card reads it: a DevicePosition's tensor on that card."""
    if isinstance(start_pos, DevicePosition) and start_pos.pos.device != device:
        return DevicePosition(start_pos.pos.to(device, non_blocking=True), start_pos.span, start_pos.slot)
    return start_pos


def split_blocks(model: Transformer, h: torch.Tensor, start_pos: int | DevicePosition) -> torch.Tensor:
    """h [B, T, D] through every main block of a split model, card after card: the hidden state and the position
    cross to the next card at each cut (model.card_cut while a step is captured), and onto the last card (the head's)
    after the last block -> h on the last card."""
    cards, t = model.cards, h.shape[1]
    card, where = 0, start_pos
    freqs, mask = model.positions(t, start_pos, cards.cards[0])
    for i, layer in enumerate(model.layers):
        c = cards.card_of[i]
        if c != card:
            (h, where), card = _cross(model, h, start_pos, c), c
            freqs, mask = model.positions(t, where, cards.cards[c])
        h = layer(h, where, freqs, mask)
    if card != cards.last:
        h, _ = _cross(model, h, start_pos, cards.last)
    return h


def _cross(
    model: Transformer, h: torch.Tensor, start_pos: int | DevicePosition, card: int
) -> tuple[torch.Tensor, int | DevicePosition]:
    if model.card_cut is not None:
        return model.card_cut(h, start_pos, card)
    return model.cards.hop(h, card), position_on(start_pos, model.cards.cards[card])
