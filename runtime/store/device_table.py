"""The device-side map from (layer, expert) to where a kernel finds its record: a device slot, or (when every
record is mapped) a slot of the pinned RAM cache read in place over PCIe. Kernels read it without asking the host.

Slot changes are noted on the host and written to the device only when a kernel needs the table (`table`), so the
layer loop pays nothing; the offsets tensor keeps its address (captured graphs read it) and is refreshed in place.
"""

from __future__ import annotations

import torch

from dsfp4.kernels.backend import upload
from dsfp4.layout.record_offsets import record_offsets

# (layer, expert)
Key = tuple[int, int]


class DeviceTable:
    def __init__(self, n_blocks: int, n_experts: int, device: torch.device):
        self.device = device
        self._slots = torch.full((n_blocks, n_experts), -1, dtype=torch.int32, device=device)  # [blocks, experts]
        self._updates: dict[Key, int] = {}
        # record_offsets of the whole table, refreshed in place
        self._offsets: torch.Tensor | None = None
        self._stale = True
        self._host_slots: torch.Tensor | None = None  # [blocks, experts] RAM slot of each record read in place

    def set(self, key: Key, slot: int) -> None:
        """key's record now sits in device slot `slot` (-1: it left the device)."""
        self._updates[key] = slot

    def map_host(self, host_slots: torch.Tensor) -> None:
        """Records not on the device are read from these RAM slots ([blocks, experts] int32, -1 none) in place."""
        self._host_slots, self._stale = host_slots.to(self.device), True

    def table(self) -> torch.Tensor:
        """[blocks, experts] int32 on the device: each expert's slot, -1 when it is not there."""
        if self._updates:
            rows = upload(torch.tensor([(lay, e, s) for (lay, e), s in self._updates.items()]), self.device)  # [n, 3]
            self._slots[rows[:, 0], rows[:, 1]] = rows[:, 2].to(torch.int32)
            self._updates, self._stale = {}, True
        return self._slots

    def offsets(self, layer: int, gpu: torch.Tensor, ram: torch.Tensor, wave: list[int] | None = None) -> torch.Tensor:
        """[experts] int64 on the device: each expert's record offset from the device pool `gpu` (kernels/moe),
        into pinned RAM (`ram`) when mapped there, -1 when not there; with `wave`, every other expert is left out
        (-1)."""
        table = self.table()
        if wave is not None:
            keep = torch.zeros_like(table[layer], dtype=torch.bool)
            keep[upload(torch.tensor(wave), self.device)] = True
            return record_offsets(torch.where(keep, table[layer], -1), gpu)
        # every layer's at once, until a slot changes: once, when nothing moves
        if self._stale:
            host = () if self._host_slots is None else (self._host_slots, ram)
            fresh = record_offsets(table, gpu, *host)  # [blocks, experts]
            self._offsets = fresh if self._offsets is None else self._offsets.copy_(fresh)
            self._stale = False
        return self._offsets[layer]
