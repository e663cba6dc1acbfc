"""Backbone tensors and KV caches in pinned host memory that the device reads in place over PCIe (the plan's
HostBackbone).

The arena is page-aligned host memory registered with CUDA (portable and mapped), in chunks: one of the plan's size,
and another should the model load more than planned (a family may keep more of its tensors in fp32 than the plan
counts). Each tensor handed to the model is a CUDA tensor at its pages' own address (unified addressing: registered
pages have one address for host and device, as the expert store's zero-copy records do), so every kernel, torch's and
ours, reads it as it reads VRAM, only over PCIe, and CUDA graphs capture it like any other tensor. A chunk is
unregistered when the last tensor on it is freed. Off CUDA the host views are the tensors themselves.
"""

from __future__ import annotations

import weakref

import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.direct_io import aligned_buffer

# every tensor starts on a boundary any dtype's loads accept
ALIGN = 256
# cudaHostRegisterPortable | cudaHostRegisterMapped: every device, device-addressable
REGISTER_FLAGS = 0x01 | 0x02
# the least a chunk beyond the plan's holds
SPARE = 64 << 20


def _unregister(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


class Chunk:
    """`nbytes` of page-aligned host memory, pinned and registered on CUDA until this object is freed."""

    def __init__(self, nbytes: int, device: torch.device):
        self.host = torch.from_numpy(aligned_buffer(nbytes))  # [nbytes] u8
        self.used = 0
        if device.type == "cuda":
            err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), nbytes, REGISTER_FLAGS)
            if int(err) != 0:
                raise ConfigError(
                    f"cannot pin {nbytes} bytes of RAM for the backbone (CUDA error {int(err)}); lower --cpu-mem"
                )
            # before the pages can be unmapped and reused
            weakref.finalize(self, _unregister, self.host)


class _DeviceAddress:
    """Hands torch the device address of `nbytes` of a chunk from `start` (the CUDA array interface); holds the
    chunk while any tensor on it lives."""

    def __init__(self, chunk: Chunk, start: int, nbytes: int):
        self.chunk = chunk
        ptr = chunk.host.data_ptr() + start
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class HostArena:
    """Pinned host memory handed out as tensors in order (`put`), `nbytes` planned."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.chunks = [Chunk(nbytes, device)] if nbytes else []

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in the arena, as the device sees it (a cache the device writes and reads in place)."""
        return self.put(torch.zeros((), dtype=dtype).expand(shape))

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the CPU tensor `t` in the arena, as the device sees it."""
        n = t.numel() * t.element_size()
        chunk = self.chunks[-1] if self.chunks else None
        start = -(-chunk.used // ALIGN) * ALIGN if chunk else 0
        if chunk is None or start + n > chunk.host.numel():
            chunk, start = Chunk(max(n, SPARE), self.device), 0
            self.chunks.append(chunk)
        chunk.used = start + n
        chunk.host[start : start + n].view(t.dtype).view(t.shape).copy_(t)
        if self.device.type != "cuda":
            return chunk.host[start : start + n].view(t.dtype).view(t.shape)
        view = torch.as_tensor(_DeviceAddress(chunk, start, n), device=self.device)  # [n] u8, the same pages
        return view.view(t.dtype).view(t.shape)
