"""Where a forward pass's tokens go in the caches: from the host (an int start position), or read on the device
when a captured decode step replays (DevicePosition). Both model families take either."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DevicePosition:
    """Where a decode step's tokens go, one per sequence: pos [B] int64 on the device (read when a captured graph
    replays; B = 1 there), sequence b in cache slot `slot` + b; attention covers the first `span` cached rows of each,
    those past its pos masked out. Only V3's caches take B > 1 or a slot (batched decode, runtime/generate/batch.py);
    V4's take the single captured step."""

    pos: torch.Tensor
    span: int
    slot: int = 0


def token_positions(start_pos: int | DevicePosition, t: int, device: torch.device) -> torch.Tensor:
    """[T] positions of a call's tokens: start_pos.. from the host, or a captured step's one on the device."""
    if isinstance(start_pos, DevicePosition):
        return start_pos.pos
    return torch.arange(start_pos, start_pos + t, device=device)
