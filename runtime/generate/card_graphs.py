"""A split run's captured decode step (--devices): one piece a card at least, each captured on its card's side stream,
and the hidden state and the position copied between the pieces at each cut, as a replay runs them. A graph holds the
kernels of one card; the copy from a card to the next runs between two replays, on both cards' streams (torch orders
a copy across cards on the current streams of both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Crossing:
    """At a cut of a captured step: the piece before it leaves the hidden state in `h` and reads the position from
    `pos` (its own tensors); the next piece, on the next card, reads their copies `h_to` and `pos_to`."""

    h: torch.Tensor  # [B, 1, D]
    h_to: torch.Tensor
    pos: torch.Tensor  # [B]
    pos_to: torch.Tensor

    @classmethod
    def to(cls, h: torch.Tensor, pos: torch.Tensor, device: torch.device) -> Crossing:
        """The copies' tensors on `device`, allocated outside any capture (they outlive it, as the graphs' own)."""
        return cls(h, torch.empty_like(h, device=device), pos, torch.empty_like(pos, device=device))

    def run(self) -> None:
        """Between the two pieces of a replay."""
        self.h_to.copy_(self.h, non_blocking=True)
        self.pos_to.copy_(self.pos, non_blocking=True)


def capture_on(device: torch.device, stream: torch.cuda.Stream, saved: dict[str, torch.cuda.Stream]) -> None:
    """Capture the next piece on `device`'s side stream `stream`: the device current, its stream set (the one before
    kept in `saved` once, for restore), after what that device has queued."""
    torch.cuda.set_device(device)
    saved.setdefault(str(device), torch.cuda.current_stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    torch.cuda.set_stream(stream)


def restore(saved: dict[str, torch.cuda.Stream], streams: dict[str, torch.cuda.Stream], current: int) -> None:
    """After a capture: each card entered back on its stream, which waits for the capture's side stream; the device
    that was current before the capture (an index: a device named "cuda" has none) current again."""
    for name, before in saved.items():
        before.wait_stream(streams[name])
        torch.cuda.set_stream(before)
    torch.cuda.set_device(current)


def synchronize(devices: tuple[torch.device, ...]) -> None:
    """Every card's current stream done."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
