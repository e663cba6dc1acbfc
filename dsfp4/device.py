"""--device: auto (CUDA when present), cpu, cuda or cuda:N, checked against this machine."""

from __future__ import annotations

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
