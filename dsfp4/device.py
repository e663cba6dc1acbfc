"""--device: auto (CUDA when present), cpu, cuda or cuda:N, checked against this machine; and the CUDA allocator's
setting the device budget relies on."""

from __future__ import annotations

import os

import torch

from dsfp4.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available; use --device cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise ConfigError(f"--device {name}: choose auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def use_expandable_segments() -> bool:
    """Expandable segments keep torch's reserved device memory close to what is allocated, so a --gpu-mem budget
    holds: on, unless the user's allocator settings say otherwise -> whether this call turned it on. Before CUDA's
    first allocation the environment is enough; after it (a library user's process) the allocator is told."""
    if any("expandable_segments" in os.environ.get(v, "") for v in ALLOC_VARS):
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
        filter(None, (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), EXPANDABLE))
    )
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    return True
