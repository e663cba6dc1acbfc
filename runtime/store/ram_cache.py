"""The RAM tier's bytes: page-aligned record slots in one buffer (pinned on CUDA, so copies to the device run at
PCIe's rate and kernels may read them in place), the record-sized ones first, then the narrow ones sized for cold
records (planner.narrow_slots). Slot numbers are the RAM pool's (slots.py): one numbering across both sizes."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.direct_io import aligned_buffer


def _unregister(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


class RamCache:
    """`wide` [slots, record] and `narrow` [narrow slots, cold record] uint8 tensors over one aligned buffer (`*_np`
    the same bytes as numpy arrays, which the SSD reads fill)."""

    def __init__(self, wide: int, record: int, narrow: int = 0, cold: int = 0, pin: bool = False):
        buf = aligned_buffer(wide * record + narrow * cold)
        self.wide_np = buf[: wide * record].reshape(wide, record)
        self.narrow_np = buf[wide * record :].reshape(narrow, cold)
        self.wide, self.narrow = torch.from_numpy(self.wide_np), torch.from_numpy(self.narrow_np)
        self._all = torch.from_numpy(buf)
        self._unpin = None
        if pin and buf.size:
            err = torch.cuda.cudart().cudaHostRegister(self._all.data_ptr(), self._all.numel(), 0)
            if int(err) != 0:
                raise ConfigError(
                    f"cannot pin {self._all.numel()} bytes of RAM for the record cache (CUDA error {int(err)}); "
                    f"lower --cpu-mem"
                )
            # unregistered when closed or collected, before the buffer can be unmapped and its addresses reused
            self._unpin = weakref.finalize(self, _unregister, self._all)

    def row(self, slot: int) -> np.ndarray:
        """A slot's bytes, for reads into it."""
        wide = len(self.wide_np)
        return self.wide_np[slot] if slot < wide else self.narrow_np[slot - wide]

    def tensor(self, slot: int) -> torch.Tensor:
        """A slot's bytes, for copies from it."""
        wide = len(self.wide)
        return self.wide[slot] if slot < wide else self.narrow[slot - wide]

    def close(self) -> None:
        """Unpin; the memory goes back when the last view of it does."""
        if self._unpin is not None:
            self._unpin()
