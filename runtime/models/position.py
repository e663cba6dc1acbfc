"""Where a forward pass's tokens go in the caches: from the host (an int start position), or read on the device
when a captured decode step replays (DevicePosition). Both model families take either."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DevicePosition:
    """Where a captured decode step's token goes: pos [1] int64 on the device (read when the graph replays);
    attention covers the first `span` cached rows, those past pos masked out."""

    pos: torch.Tensor
    span: int


def token_positions(start_pos: int | DevicePosition, t: int, device: torch.device) -> torch.Tensor:
    """[T] positions of a call's tokens: start_pos.. from the host, or a captured step's one on the device."""
    if isinstance(start_pos, DevicePosition):
        return start_pos.pos
    return torch.arange(start_pos, start_pos + t, device=device)
