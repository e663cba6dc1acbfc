"""Where each expert's record sits, as the kernels find it: a byte offset from the address of the device slot pool.

Records sit one a slot, a slot being one record's bytes: device slot i at i * nbytes of the pool `records`
[S, nbytes], and a slot of the pinned host pool `host` [S', nbytes] past it by the distance between the two
pools' addresses (the GPU sees host and device memory in one address space, so a kernel reads such a record
over PCIe). An expert that takes no part in a call gets ABSENT. Legend: E experts, S device slots, S' host slots.
"""

from __future__ import annotations

import torch

# offsets are multiples of the slot alignment, so -1 never names a record
ABSENT = -1


def record_offsets(
    slots: torch.Tensor,
    records: torch.Tensor,
    host_slots: torch.Tensor | None = None,
    host: torch.Tensor | None = None,
) -> torch.Tensor:
    """slots: [..., E] int device slot per expert (-1: not on the device); host_slots: the same shape, slots
    in `host` (pinned [S', nbytes], -1: not there) -> offsets [..., E] int64 from `records`' address
    (device first)."""
    nbytes = records.shape[1]
    off = torch.where(slots >= 0, slots.long() * nbytes, torch.full_like(slots, ABSENT, dtype=torch.long))
    if host_slots is not None:
        assert host is not None and host.shape[1] == nbytes, "host records need the device's record size"
        delta = host.data_ptr() - records.data_ptr()
        assert delta % 16 == 0, "the kernels read records 16 bytes at a time: both pools must be 16-byte aligned"
        from_host = torch.where(host_slots >= 0, host_slots.long() * nbytes + delta, ABSENT)
        off = torch.where(slots >= 0, off, from_host.to(off.device))
    return off
