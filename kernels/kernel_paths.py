"""Which path each part of a run takes on a device, and the one line that says what it costs: read by `run` (a note
before anything loads, or a refusal where nothing can run), `run --plan` and `doctor`.

The rule is backend.py's (use_kernels, fp8_path); this module describes it for a device as seen (`Gpu`), so that
the CPU tests can ask what a 3090, an A100, a 4090, a 5090, a ROCm device or an sm_75 card would get.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.backend import (
    REFERENCE_CARD,
    FP8Path,
    card_of,
    cuda_props,
    fp4_mma_for,
    fp4_mma_forced,
    fp8_by_bits_forced,
    fp8_path_for,
    kernels_run,
    triton,
)

# what the torch references cost where they replace the kernels: measured on the H200 with the e4m3 rule raised
# (issue 49): the FP8 matrices dequantized on every call, decode 939 -> 120 tok/s
REFERENCE_COST = "decode several times slower (the FP8 layers' reference alone: 7.8x on an H200)"
TRITON_PATH = "Triton"
REFERENCE_PATH = "torch reference"
FP8_PART = "FP8 backbone"
EXPERTS_PART = "routed experts"
# the experts' path where backend.fp4_mma_for picks the FP4 tensor-core prefill (moe/prefill_mma.py)
FP4_MMA_PATH = "Triton, FP4 tensor cores (W4A8) for MXFP4 records' prefill, unmeasured; NVFP4 decoded in software"
# part -> its path when the Triton kernels run
KERNEL_PARTS = {
    EXPERTS_PART: "Triton, FP4 decoded in software",
    FP8_PART: "",  # the FP8 path's own (FP8_PATHS)
    "MLA attention": TRITON_PATH,
    "norms, rope, router": TRITON_PATH,
}
FP8_PATHS = {
    FP8Path.NATIVE: "Triton, e4m3 in hardware (prefill on FP8 tensor cores)",
    FP8Path.BY_BITS: "Triton, e4m3 converted by bits (prefill W8A16 on bf16 tensor cores)",
    FP8Path.REFERENCE: "torch reference, dequantized on every call",
}


@dataclass(frozen=True)
class Gpu:
    """What the rule reads of a CUDA device: its name, compute capability, shared memory a program may opt in to
    (bytes), SMs, whether torch runs on ROCm, and the architectures this torch build carries kernels for."""

    name: str
    capability: tuple[int, int]
    smem: int
    sms: int
    hip: bool = False
    torch_archs: tuple[str, ...] = ()


def gpu_of(device: torch.device) -> Gpu:
    """The Gpu of a CUDA `device` on this machine."""
    p = cuda_props(device.index or 0)
    c = card_of(p)
    return Gpu(p.name, c.capability, c.smem, c.sms, torch.version.hip is not None, tuple(torch.cuda.get_arch_list()))


def torch_runs(gpu: Gpu) -> bool:
    """Whether this torch build has kernels for the card: a cubin of its major version at or below its minor, or
    PTX of an architecture at or below it (JIT-compiled). An empty list (ROCm's names, unknown) is trusted."""
    if gpu.hip or not gpu.torch_archs:
        return True
    for arch in gpu.torch_archs:
        kind, _, digits = arch.partition("_")
        if not digits.isdigit():
            continue
        major, minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and major == gpu.capability[0] and minor <= gpu.capability[1]:
            return True
        if kind == "compute" and (major, minor) <= gpu.capability:
            return True
    return False


@dataclass(frozen=True)
class KernelPaths:
    """Each part's path on a device, whether the Triton kernels and the FP8 kernels run (what the planner reserves
    for), and `word`: one line of what runs and what it costs where that is not the kernels at speed ("" there).
    `refused`: nothing can run; `word` says why and the fix."""

    device: str
    parts: dict[str, str]
    kernels: bool
    fp8_kernels: bool
    word: str = ""
    refused: bool = False
    capability: tuple[int, int] | None = None
    smem: int = 0
    sms: int = 0

    def check(self) -> None:
        """Raise the refusal (ConfigError), before anything loads."""
        if self.refused:
            raise ConfigError(self.word)

    def lines(self) -> list[str]:
        """A line per part, for `run --plan` and `doctor`."""
        return [f"  {part}: {path}" for part, path in self.parts.items()]

    def to_dict(self) -> dict:
        return asdict(self)


def _parts(fp8: FP8Path, kernels: bool, fp4_mma: bool = False) -> dict[str, str]:
    """Each part's path: the kernels' (the FP8 backbone's by `fp8`, the experts' by `fp4_mma`), else the references."""
    own = {part: path if kernels else REFERENCE_PATH for part, path in KERNEL_PARTS.items()}
    experts = {EXPERTS_PART: FP4_MMA_PATH} if kernels and fp4_mma else {}
    return {**own, FP8_PART: FP8_PATHS[fp8 if kernels else FP8Path.REFERENCE], **experts}


def paths_for(
    gpu: Gpu | None, has_triton: bool = True, forced_by_bits: bool = False, fp4_mma: bool | None = None
) -> KernelPaths:
    """The paths on `gpu` (None: the CPU) with Triton installed or not: backend.py's rule, described (`fp4_mma`:
    FP4_MMA_ENV's answer)."""
    if gpu is None:
        return KernelPaths("CPU", _parts(FP8Path.REFERENCE, kernels=False), False, False)
    sm = f"sm_{gpu.capability[0]}{gpu.capability[1]}"
    where, shape = (
        gpu.name if gpu.hip else f"{gpu.name} ({sm})",
        dict(capability=gpu.capability, smem=gpu.smem, sms=gpu.sms),
    )
    if not torch_runs(gpu):
        word = (
            f"{where}: this torch build has no CUDA kernels for {sm} (it has {', '.join(gpu.torch_archs)}); "
            "install a torch build for this card, or run with --device cpu"
        )
        return KernelPaths(where, _parts(FP8Path.REFERENCE, kernels=False), False, False, word, True, **shape)
    if kernels_run(gpu.capability, gpu.hip, has_triton):
        fp8 = fp8_path_for(gpu.capability, forced_by_bits, gpu.hip)
        parts = _parts(fp8, True, fp4_mma_for(gpu.capability, fp4_mma, gpu.hip))
        return KernelPaths(where, parts, True, True, **shape)
    if gpu.hip:
        why = "ROCm: dsfp4's Triton kernels are written for NVIDIA GPUs (inline PTX)"
    elif not has_triton:
        why = "Triton is not installed (pip install triton; on Windows triton-windows)"
    else:
        why = "dsfp4's Triton kernels need sm_80 or later (bf16 tensor cores, Ampere's PTX)"
    word = f"{where}: {why}; every part runs its torch reference on the GPU: {REFERENCE_COST}"
    return KernelPaths(where, _parts(FP8Path.REFERENCE, kernels=False), False, False, word, **shape)


def kernel_paths(device: torch.device) -> KernelPaths:
    """The paths on `device` of this machine; a CUDA device where this machine has none is a user's card planned for
    (a projection's), taken as REFERENCE_CARD with the kernels installed."""
    if device.type == "cuda" and not torch.cuda.is_available():
        c = REFERENCE_CARD
        return paths_for(Gpu("a CUDA card (none here)", c.capability, c.smem, c.sms))
    gpu = gpu_of(device) if device.type == "cuda" else None
    return paths_for(gpu, triton is not None, fp8_by_bits_forced(), fp4_mma_forced())
