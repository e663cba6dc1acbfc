"""The ceilings every benchmark reports beside its numbers (docs/BENCHMARKS.md), measured the way the
entries there were: HBM read over 2 GiB, pinned host->GPU in 256 MiB copies, O_DIRECT reads and writes of
given files. The measurements themselves are dsfp4/ceilings.py's (`dsfp4 doctor` uses them too)."""

from __future__ import annotations

from pathlib import Path

import torch

from dsfp4 import ceilings


def gpu_ceilings() -> dict:
    """HBM read (torch sum over 2 GiB) and pinned host->GPU (256 MiB copies), GB/s; {} without CUDA."""
    if not torch.cuda.is_available():
        return {}
    dev = torch.device("cuda")
    return {
        "gpu": torch.cuda.get_device_name(),
        "hbm_read_gbps": ceilings.hbm_read_gbps(dev, 2 << 30),
        "pinned_h2d_gbps": ceilings.h2d_gbps(dev, 256 << 20, total=10 * (256 << 20)),
    }


def odirect_read_gbps(paths: list[Path], threads: int = 1, chunk: int = 16 << 20) -> float:
    """Read the files once with O_DIRECT, in order, `chunk` bytes per read, `threads` reads in flight."""
    return ceilings.sequential_read_gbps(paths, threads, chunk, limit=1 << 62)


def odirect_write_gbps(folder: Path, nbytes: int = 4 << 30, chunk: int = 64 << 20) -> float:
    """Write a scratch file of nbytes with O_DIRECT, `chunk` bytes per write, then fsync and delete it."""
    path = Path(folder) / ".dsfp4-write-ceiling.tmp"
    try:
        return ceilings.write_scratch(path, nbytes, chunk)
    finally:
        path.unlink(missing_ok=True)
