"""Backbone tensors in pinned host memory that the device reads in place over PCIe (the plan's HostBackbone).

One page-aligned arena is pinned (registered with CUDA) for all of them; each tensor is a view of it. On CUDA the
view handed to the model is a CUDA tensor at the same address (unified addressing: registered pages have one
address for host and device), so every kernel, torch's and ours, reads it as it reads VRAM, only over PCIe, and
CUDA graphs capture it like any other tensor. Off CUDA the host views are the tensors themselves.
"""

from __future__ import annotations

import weakref

import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.direct_io import aligned_buffer

ALIGN = 256  # every tensor starts on a boundary any dtype's loads accept


class _DeviceAddress:
    """Hands torch a device address through the CUDA array interface; holds the arena while any view lives."""

    def __init__(self, arena: HostArena, nbytes: int):
        self.arena = arena
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (arena.host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def _unregister(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


class HostArena:
    """`nbytes` of pinned host memory handed out as tensors in order (`put`)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.host = torch.from_numpy(aligned_buffer(nbytes))  # [nbytes] u8
        self.used, self.device = 0, device
        self.view = self.host
        if device.type == "cuda" and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise ConfigError(
                    f"cannot pin {nbytes} bytes of RAM for the backbone (CUDA error {int(err)}); lower --cpu-mem"
                )
            weakref.finalize(self, _unregister, self.host)  # before the pages can be unmapped and reused
            self.view = torch.as_tensor(_DeviceAddress(self, nbytes), device=device)  # [nbytes] u8, same address

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the CPU tensor `t` in the arena, as the device sees it."""
        n = t.numel() * t.element_size()
        start = -(-self.used // ALIGN) * ALIGN
        if start + n > self.host.numel():
            raise ConfigError(
                f"the plan's {self.host.numel()} bytes of host backbone are too few: the manifest changed?"
            )
        self.used = start + n
        host = self.host[start : start + n].view(t.dtype).view(t.shape)
        host.copy_(t)
        return self.view[start : start + n].view(t.dtype).view(t.shape)
