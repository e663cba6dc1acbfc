"""Quick measurements a run takes of this machine when it starts, and `dsfp4 doctor` takes with its ceilings:
host->GPU copies of a record, and the CPU kernel's speed on one (kernels/cpu/moe.c). From the two the CPU lane's
share follows (runtime/store/host_lane.py; the LaneSplit of lane_split.py): the cores take the share of a step's
experts that they finish in the time PCIe copies the rest. All speeds are GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import time

import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.cpu import moe as host_moe
from dsfp4.layout.record import RecordLayout
from dsfp4.runtime.plan.lane_split import LaneSplit

# records the probes move: more than a CPU's caches hold, so the kernel reads memory as the lane does (one record
# read again and again came from the cache: docs/BENCHMARKS.md, the CPU lane)
PROBE_BYTES = 256 << 20
# the scale byte of 1.0: e4m3, e8m0 (no subnormal slows the probe)
UNIT_SCALE = {"nvfp4": 0x38, "mxfp4": 127}


def h2d_gbps(device: torch.device, chunk: int, total: int = 1 << 30, pinned: bool = True) -> float:
    """Host->GPU copies of `chunk` bytes (an expert record's size) from a pinned or pageable buffer."""
    n = max(total // chunk, 2)
    host = torch.empty(2 * chunk, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    gpu = torch.empty(chunk, dtype=torch.uint8, device=device)
    for i in range(2):
        gpu.copy_(host[i * chunk : (i + 1) * chunk], non_blocking=pinned)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for i in range(n):
        gpu.copy_(host[(i % 2) * chunk : (i % 2 + 1) * chunk], non_blocking=pinned)
    torch.cuda.synchronize(device)
    return n * chunk / (time.perf_counter() - t) / 1e9


def probe_record(layout: RecordLayout) -> torch.Tensor:
    """A record of `layout` (uint8 [nbytes]) with random codes and unit scales, for timing the kernel."""
    record = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for p in layout.parts:
        if p.name == "scale_2":
            record[p.offset : p.offset + p.nbytes] = torch.ones(3).view(torch.uint8)
        elif p.name.endswith("_scale"):
            record[p.offset : p.offset + p.nbytes] = UNIT_SCALE[layout.format]
    return record


def host_moe_gbps(layout: RecordLayout) -> float:
    """The CPU kernel for one token on records in memory (not in the CPU's caches: PROBE_BYTES of them, each read
    once), in GB/s of records; 0.0 when it cannot be built here."""
    if not host_moe.available():
        return 0.0
    wide = layout.wide()
    n = max(2, -(-PROBE_BYTES // wide.nbytes))
    records = probe_record(wide).repeat(n, 1)  # [n, nbytes]: n copies, each in memory of its own
    x, w = torch.randn(1, layout.dim), torch.ones(1, 1)
    offsets = torch.arange(n, dtype=torch.int64) * wide.nbytes
    # builds and warms it
    host_moe.moe_host(x, torch.zeros(1, 1, dtype=torch.int64), w, records, offsets, wide)
    t0 = time.perf_counter()
    # the first is in the caches now
    for e in range(1, n):
        host_moe.moe_host(x, torch.full((1, 1), e, dtype=torch.int64), w, records, offsets, wide)
    return (n - 1) * wide.nbytes / (time.perf_counter() - t0) / 1e9


def host_share(setting: str, layout: RecordLayout | None, device: torch.device) -> LaneSplit:
    """--cpu-experts as the lane's split: `off` none; a number itself; `auto` the share that balances the CPU kernel
    against PCIe copies of records, both measured now (CUDA runs with expert records; none elsewhere or when the kernel
    cannot be built)."""
    if setting == "off":
        return LaneSplit(0.0, why="--cpu-experts off")
    if layout is None:
        return LaneSplit(0.0, why="no expert records")
    if setting != "auto":
        if float(setting) and not host_moe.available():
            raise ConfigError(
                f"--cpu-experts {setting}: the CPU kernel cannot be built here ({host_moe.why_unavailable()}); "
                "install a C compiler, or give off"
            )
        # on a CPU run too: the tests run the lane there
        return LaneSplit(float(setting), why="--cpu-experts")
    if device.type != "cuda":
        return LaneSplit(0.0, why="the experts compute on the CPU already")
    if not host_moe.available():
        return LaneSplit(0.0, why=f"the CPU kernel cannot be built here: {host_moe.why_unavailable()}")
    cpu, pcie = host_moe_gbps(layout), h2d_gbps(device, layout.wide().nbytes, total=PROBE_BYTES)
    return LaneSplit(cpu / (cpu + pcie), cpu, pcie)
