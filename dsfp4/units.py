"""Byte counts as people read and write them (binary units: 1 GiB = 2^30 bytes)."""

from __future__ import annotations

import shutil
from pathlib import Path

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> tuple[Path, int]:
    """(nearest existing folder, its filesystem's free bytes): where `path` will be written."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free
