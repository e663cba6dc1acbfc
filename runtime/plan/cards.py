"""What one card of a split run holds (--devices: runtime/plan/device_split.py decides it), and its rows of the plan
table. The embedding is on the first card, the final norm and the head (and the MTP layer) on the last; the hidden
state crosses from a card to the next once per split point per forward pass."""

from __future__ import annotations

from dataclasses import dataclass

from dsfp4.runtime.plan.host_backbone import spans
from dsfp4.units import format_bytes


@dataclass(frozen=True)
class CardShare:
    """A card's part of a split run: its device budget, its blocks (the MTP layer's among the last card's) and their
    bytes there; its expert slots hold only its MoE layers' `records`."""

    device: str
    budget: int
    layers: tuple[int, ...]
    backbone: int
    # its layers' caches and state, and its own RoPE tables
    kv_cache: int
    # transient tensors of a forward pass on the card (the one-device estimate: an upper one for a part of the layers)
    workspace: int
    gpu_slots: int
    # records of its MoE layers
    records: int
    # its MoE layers with expert records
    expert_layers: tuple[int, ...] = ()


def card_rows(
    cards: tuple[CardShare, ...], record: int, process: tuple[str, str, str] | None
) -> list[tuple[str, str, str]]:
    """The plan table's rows of each card (`process`: the process's row, on the first card when the cards are the
    CPU's, whose tiers are host memory)."""
    rows = []
    for i, c in enumerate(cards):
        ends = ["embedding"] * (i == 0) + ["head"] * (i == len(cards) - 1)
        what = f"layers {spans(c.layers)}" if c.layers else "no layers"
        rows += [
            (f"card {i} budget ({c.device})", format_bytes(c.budget), ", ".join([what, *ends])),
            *([process] if process is not None and i == 0 else []),
            ("  backbone", format_bytes(c.backbone), "its layers' weights in their stored formats"),
            ("  KV cache", format_bytes(c.kv_cache), "its layers' caches and state, RoPE tables"),
            ("  workspace", format_bytes(c.workspace), "transient tensors (estimate)"),
            (
                "  expert slots",
                format_bytes(c.gpu_slots * record),
                f"{c.gpu_slots} x {format_bytes(record)}, {c.gpu_slots / max(c.records, 1):.0%} of its layers' records",
            ),
        ]
    return rows
