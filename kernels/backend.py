"""Where the kernels run, decided once: the Triton import, the one rule that picks a kernel or its torch reference,
and what the kernels read of the process (the device's SM count and fp8 support, whether Triton interprets).

The rule (use_kernels): Triton kernels run on CUDA tensors when Triton is installed; the torch references run
everywhere else (the CPU build of torch comes without Triton). The tests call the kernels themselves on the CPU
under TRITON_INTERPRET, which runs them in Triton's interpreter.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    # the CPU build of torch comes without Triton: the torch references serve
    triton = tl = None

# threads per warp, for tile rules that count threads
WARP = 32
# tokens per call that the decode kernels (GEMVs on CUDA cores) take: decode steps and MTP verify batches; above
# it the prefill paths on tensor cores win. One bound for all of them, so a call never mixes the two
DECODE_TOKENS = 16
# a sequence's tokens per call above which MLA's prefill attention expands the cached latent rows through wkv_b, a
# key block at a time, and attends in the decompressed form (kernels/mla/prefill.py) instead of the absorbed one;
# at least DECODE_TOKENS. Expanding costs a call the same whatever its tokens: from 48 tokens on the decompressed form
# was as fast or faster at every context measured on the H200, at 32 slower from 8k cached rows
# (scripts/bench_prefill_attention.py)
DECOMPRESS_TOKENS = 32


def use_kernels(where: torch.Tensor | torch.device) -> bool:
    """The one rule for kernel or reference: Triton kernels for tensors on (or a device that is) CUDA, when Triton
    is installed; the torch references elsewhere."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type == "cuda" and triton is not None


def interpreted() -> bool:
    """True when Triton runs kernels on the CPU interpreter (inline PTX is not available there)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Ada and Hopper convert e4m3 in hardware; Triton has no fp8 type below
HW_E4M3_CAPABILITY = (8, 9)


@functools.lru_cache
def cuda_props(index: int):
    """The CUDA device's properties, asked once (kernel wrappers consult them on every call)."""
    return torch.cuda.get_device_properties(index)


# off CUDA (the interpreter) the kernels' plans assume an H100
REFERENCE_SMS = 132


def n_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors, for grid sizing (REFERENCE_SMS off CUDA)."""
    return cuda_props(device.index or 0).multi_processor_count if device.type == "cuda" else REFERENCE_SMS


def hw_e4m3(device: torch.device) -> bool:
    """Whether kernels on `device` may convert e4m3 by the GPU's instruction (else by bits), the Triton fp8
    types included."""
    device = torch.device(device)
    if device.type != "cuda" or interpreted():
        return False
    p = cuda_props(device.index or 0)
    return (p.major, p.minor) >= HW_E4M3_CAPABILITY
