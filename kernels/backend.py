"""Where the kernels run, decided once: the Triton import, the one rule that picks a kernel or its torch reference,
and what the kernels read of the process (the device's SM count and fp8 support, whether Triton interprets).

The rule (use_kernels): Triton kernels run on CUDA tensors of an NVIDIA GPU from sm_80 with Triton installed
(kernels_run); the torch references run everywhere else: the CPU (whose build of torch comes without Triton), older
cards, ROCm (whose torch looks like CUDA), CUDA without Triton, as kernel_paths.py tells the user. The tests call the
kernels themselves on the CPU under TRITON_INTERPRET, which runs them in Triton's interpreter.

FP8 (e4m3) weights take one of three paths (fp8_path): NATIVE on GPUs that convert e4m3 in hardware (sm_89 on:
the PTX conversions, Triton's fp8 types, the W8A8 GEMM on FP8 tensor cores); BY_BITS on CUDA GPUs from sm_80 that
do not (A100, RTX 3090: e4m3 widened by bit placement inside the kernels, the prefill GEMM W8A16 on bf16/fp16 tensor
cores); REFERENCE elsewhere (no Triton, the CPU, older GPUs, ROCm), the torch functions. DSFP4_FP8_BY_BITS=1 in the
environment, read once, forces BY_BITS where NATIVE would run (a benchmark or a GPU test of the Ampere path on an
Ada or Hopper card).

The routed experts' prefill takes its FP4 tensor-core variant (moe/prefill_mma.py, W4A8 on MXFP4 records) where
fp4_mma says: by default on Blackwell (sm_100, sm_120), whose block-scaled MMA tl.dot_scaled emits; DSFP4_FP4_MMA=0
turns it off, =1 forces it on any card from sm_89 the kernels run on (Triton upcasts it there: a GPU test of its
numbers) and, on the CPU, its torch reference in place of the exact one (a quality measurement).
"""

from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    # the CPU build of torch comes without Triton: the torch references serve
    triton = tl = None

# threads per warp, for tile rules that count threads
WARP = 32


def interpreted() -> bool:
    """True when Triton runs kernels on the CPU interpreter (inline PTX is not available there)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Ada and Hopper convert e4m3 in hardware; Triton has no fp8 type below
HW_E4M3_CAPABILITY = (8, 9)
# dsfp4's Triton kernels need bf16 tensor cores and Ampere's PTX (cvt.rn.f16x2.f32, ...), NVIDIA's only
KERNEL_CAPABILITY = (8, 0)
# "1": the by-bits FP8 kernels where the GPU converts e4m3 itself (read once per process)
FP8_BY_BITS_ENV = "DSFP4_FP8_BY_BITS"
# Blackwell's majors (B200 and B300: 10; RTX 5090 and RTX PRO 6000, DGX Spark: 12): block-scaled FP4 MMA
FP4_MMA_MAJORS = (10, 12)
# "0": never the FP4 tensor-core prefill; "1": wherever it can run (read once per process)
FP4_MMA_ENV = "DSFP4_FP4_MMA"
# the record format it reads (moe/prefill_mma.py: NVFP4's e4m3 scales are no e8m0 scales)
FP4_MMA_FORMAT = "mxfp4"
# off CUDA (the interpreter) the kernels' plans assume an H100: its SMs and the shared memory a block may opt in to
REFERENCE_SMS = 132
REFERENCE_SMEM = 232448


class FP8Path(enum.Enum):
    """How kernels read e4m3 weights on a device (the module docstring)."""

    NATIVE = "native"
    BY_BITS = "by bits"
    REFERENCE = "reference"


@functools.lru_cache
def cuda_props(index: int):
    """The CUDA device's properties, asked once (kernel wrappers consult them on every call)."""
    return torch.cuda.get_device_properties(index)


def kernels_run(capability: tuple[int, int], hip: bool = False, has_triton: bool = True) -> bool:
    """Whether dsfp4's Triton kernels run on a GPU of compute `capability` (ROCm: `hip`): NVIDIA from
    KERNEL_CAPABILITY, with Triton installed."""
    return has_triton and not hip and capability >= KERNEL_CAPABILITY


@functools.lru_cache
def _kernels_on(index: int) -> bool:
    p = cuda_props(index)
    return kernels_run((p.major, p.minor), torch.version.hip is not None, triton is not None)


def use_kernels(where: torch.Tensor | torch.device) -> bool:
    """The one rule for kernel or reference: Triton kernels for tensors on (or a device that is) a CUDA GPU they
    run on (kernels_run); the torch references elsewhere (the CPU, older cards, ROCm, no Triton)."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type == "cuda" and triton is not None and _kernels_on(device.index or 0)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting there: pinned and non-blocking to a CUDA device (a pageable copy would
    wait for the compute stream), as it is elsewhere."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def n_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors, for grid sizing (REFERENCE_SMS off CUDA)."""
    return cuda_props(device.index or 0).multi_processor_count if device.type == "cuda" else REFERENCE_SMS


@dataclass(frozen=True)
class Card:
    """What tile rules read of a GPU: compute capability, SMs, the shared memory a program may opt in to (bytes)."""

    capability: tuple[int, int]
    sms: int
    smem: int


# off CUDA (the interpreter) the kernels' plans assume an H100
REFERENCE_CARD = Card((9, 0), REFERENCE_SMS, REFERENCE_SMEM)


def card_of(props) -> Card:
    """The Card of torch.cuda.get_device_properties' answer (or an object with its fields)."""
    smem = getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_multiprocessor
    return Card((props.major, props.minor), props.multi_processor_count, smem)


def card(device: torch.device) -> Card:
    """The Card of `device`, REFERENCE_CARD off CUDA."""
    return card_of(cuda_props(device.index or 0)) if device.type == "cuda" else REFERENCE_CARD


@functools.lru_cache
def fp8_by_bits_forced() -> bool:
    """Whether FP8_BY_BITS_ENV asks for the by-bits kernels (read once: every kernel of a process takes one path)."""
    return os.environ.get(FP8_BY_BITS_ENV, "0") not in ("", "0")


def fp8_path_for(capability: tuple[int, int], forced: bool = False, hip: bool = False) -> FP8Path:
    """The FP8 path of a CUDA GPU of compute `capability` with Triton (ROCm: `hip`): the module docstring's rule."""
    if not kernels_run(capability, hip):
        return FP8Path.REFERENCE
    return FP8Path.BY_BITS if forced or capability < HW_E4M3_CAPABILITY else FP8Path.NATIVE


def fp8_path(device: torch.device | str) -> FP8Path:
    """The FP8 path kernels take on `device`. Under TRITON_INTERPRET the CPU runs the kernels: NATIVE there stands
    for the native kernels' interpreted branches (Triton's fp8 types, no PTX), BY_BITS when forced."""
    device = torch.device(device)
    if triton is None:
        return FP8Path.REFERENCE
    if device.type != "cuda":
        if not interpreted():
            return FP8Path.REFERENCE
        return FP8Path.BY_BITS if fp8_by_bits_forced() else FP8Path.NATIVE
    p = cuda_props(device.index or 0)
    return fp8_path_for((p.major, p.minor), fp8_by_bits_forced(), torch.version.hip is not None)


def has_fp8_kernels(device: torch.device | str) -> bool:
    """True where the FP8 Triton kernels run (natively or by bits): CUDA sm_80+, or the CPU under the interpreter."""
    return fp8_path(device) is not FP8Path.REFERENCE


def hw_e4m3(device: torch.device | str) -> bool:
    """Whether kernels on `device` may convert e4m3 by the GPU's instruction (else by bits), the Triton fp8
    types included: the NATIVE path on CUDA (never under the interpreter)."""
    device = torch.device(device)
    return device.type == "cuda" and not interpreted() and fp8_path(device) is FP8Path.NATIVE


@functools.lru_cache
def fp4_mma_forced() -> bool | None:
    """FP4_MMA_ENV's answer: True ("1"), False ("0"), None (unset: the card decides). Read once per process."""
    value = os.environ.get(FP4_MMA_ENV, "")
    return None if value == "" else value != "0"


def fp4_mma_for(capability: tuple[int, int], forced: bool | None = None, hip: bool = False) -> bool:
    """Whether a CUDA GPU of compute `capability` with Triton (ROCm: `hip`) takes the FP4 tensor-core prefill:
    Blackwell by default, `forced` either way where the kernels run and the GPU converts e4m3 (the activations')."""
    if not kernels_run(capability, hip) or capability < HW_E4M3_CAPABILITY:
        return False
    return capability[0] in FP4_MMA_MAJORS if forced is None else forced


def fp4_mma(device: torch.device | str, fmt: str) -> bool:
    """Whether the routed experts' prefill on `device` for records of format `fmt` takes the FP4 tensor-core variant
    (its kernels on CUDA, its torch reference on the CPU when FP4_MMA_ENV forces it)."""
    device = torch.device(device)
    if fmt != FP4_MMA_FORMAT:
        return False
    if device.type != "cuda" or triton is None:
        return fp4_mma_forced() is True
    p = cuda_props(device.index or 0)
    return fp4_mma_for((p.major, p.minor), fp4_mma_forced(), torch.version.hip is not None)
