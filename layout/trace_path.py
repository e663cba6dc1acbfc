"""Where a routing trace may be written (layout/routing_trace.py reads and writes them): a .npy or .npz file in a
folder that exists and can be written, checked before any work. Free of numpy: runtime/options.py checks
--record-trace with it, and the command line reads that module."""

from __future__ import annotations

from pathlib import Path

from dsfp4.errors import ConfigError
from dsfp4.layout.atomic import require_folder

TRACE_SUFFIXES = (".npy", ".npz")


def check_trace_path(path: Path) -> Path:
    """Fail before any work when a trace could not be written there."""
    path = Path(path)
    if path.suffix not in TRACE_SUFFIXES:
        raise ConfigError(f"{path}: a routing trace is written as .npy (ids) or .npz (ids, weights, tokens)")
    return require_folder(path, "routing trace")
