"""`dsfp4 doctor`: this machine's ceilings, measured in under a minute, and a verdict on what will limit a
model's decode speed. The result is saved as JSON (default: ~/.cache/dsfp4/doctor.json) for `dsfp4 bench`,
which reports every speed against it.

The disk is measured where the model lives: a converted model's expert files are read as they are;
any other folder gets a scratch file, written, read and deleted.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dsfp4.device import resolve_device
from dsfp4.errors import ConfigError
from dsfp4.kernels.cpu.build import cache_root
from dsfp4.kernels.kernel_paths import kernel_paths
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import RecordLayout
from dsfp4.runtime.plan.budget import available_ram
from dsfp4.runtime.plan.host_backbone import step_bytes_on_host
from dsfp4.runtime.plan.planner import Plan, expert_layers, token_bytes
from dsfp4.runtime.plan.probes import host_moe_gbps
from dsfp4.tools import ceilings
from dsfp4.units import format_bytes

# the measurement's stages: the CLI shows them on a terminal (dsfp4/cli/progress.py)
log = logging.getLogger("dsfp4")

# a DeepSeek-V3 NVFP4 expert record, when no model is given
V3_LAYOUT = RecordLayout.for_expert("nvfp4", 7168, 2048)
# the copy size when no model is given
RECORD_BYTES = V3_LAYOUT.nbytes
SCRATCH = ".dsfp4-doctor.tmp"
# bytes of a plain weight on a GPU run, where backbone in RAM is read
BF16 = 2


def default_path() -> Path:
    return cache_root() / "doctor.json"


@dataclass(frozen=True)
class Ceilings:
    """GB/s unless named otherwise; GPU fields are empty without CUDA."""

    gpu: str = ""
    gpu_mem: int = 0
    # "sm_86"; the shared memory a program may opt in to, bytes; streaming multiprocessors
    gpu_capability: str = ""
    gpu_smem: int = 0
    gpu_sms: int = 0
    # part -> the kernel path it takes (kernels/kernel_paths.py), and the line saying what that costs ("" at speed)
    kernel_paths: dict[str, str] = field(default_factory=dict)
    kernel_word: str = ""
    hbm_read_gbps: float = 0.0
    pinned_h2d_gbps: float = 0.0
    pageable_h2d_gbps: float = 0.0
    # the folder measured
    disk: str = ""
    # False: the filesystem refused O_DIRECT (reads went through the page cache)
    disk_direct: bool = True
    seq_read_gbps: float = 0.0
    random_read_gbps: float = 0.0
    # the best of the store's read sizes (1 or RUN_RECORDS records) and depths
    store_read_gbps: float = 0.0
    record_bytes: int = RECORD_BYTES
    ram_available: int = 0
    cpu_cores: int = 0
    cpu_isa: list[str] = field(default_factory=list)
    # the CPU lane's kernel on one record for one token, alone (0: no C compiler)
    cpu_moe_gbps: float = 0.0
    measured_at: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Ceilings:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def floor_s(self, device_bytes: float, ssd_bytes: float, h2d_bytes: float) -> float | None:
        """The time a token's bytes need at these ceilings: SSD reads and host->GPU copies overlap each other,
        device reads follow (None without a GPU measured). SSD bytes go at the disk's faster ceiling: the
        store reads runs of adjacent records, so some of its reads stream, and no pattern beats sequential."""
        if not (self.hbm_read_gbps and self.pinned_h2d_gbps and self.random_read_gbps):
            return None
        ssd = max(self.random_read_gbps, self.seq_read_gbps or 0.0)
        links = max(ssd_bytes / (ssd * 1e9), h2d_bytes / (self.pinned_h2d_gbps * 1e9))
        return links + device_bytes / (self.hbm_read_gbps * 1e9)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)


def load(path: Path) -> Ceilings:
    try:
        return Ceilings.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{path}: cannot read the doctor's ceilings ({e}); run `dsfp4 doctor` again") from e


def folder_model(folder: Path) -> Manifest | None:
    """The converted model with expert records in `folder`, or None."""
    if not (folder / "manifest.json").is_file():
        return None
    m = Manifest.open(folder)
    return m if m.record is not None and m.experts else None


def _disk_files(folder: Path, model: Manifest | None, scratch_bytes: int) -> tuple[list[Path], int, Path | None]:
    """(files to read, record size, scratch file to delete or None)."""
    if model is not None:
        return [folder / ef.file for ef in model.experts.values()], model.record.nbytes, None
    if scratch_bytes < 2 * RECORD_BYTES:
        raise ConfigError(f"--scratch {format_bytes(scratch_bytes)}: give at least {format_bytes(2 * RECORD_BYTES)}")
    scratch = folder / SCRATCH
    ceilings.write_scratch(scratch, scratch_bytes)
    return [scratch], RECORD_BYTES, scratch


def measure(
    folder: Path, scratch_bytes: int = 2 << 30, device: torch.device | None = None, model: Manifest | None = None
) -> Ceilings:
    """Every ceiling; `folder` is where the model lives (or will), `model` its folder_model()."""
    t0 = time.perf_counter()
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder; give the model's folder or the disk it will live on")
    files, record, scratch = _disk_files(folder, model, scratch_bytes)
    log.info("measuring the disk under %s: sequential, random records, the store's reads", folder)
    try:
        direct = ceilings.direct_io_allowed(files[0])
        seq = ceilings.sequential_read_gbps(files)
        rand = ceilings.random_read_gbps(files, record)
        store = ceilings.store_read_gbps(files, record)
    finally:
        if scratch is not None:
            scratch.unlink(missing_ok=True)
    device = device or resolve_device("auto")
    paths = kernel_paths(device)
    gpu: dict = dict(kernel_paths=paths.parts, kernel_word=paths.word)
    if paths.word:
        log.info("%s", paths.word)
    # a card this torch cannot run on has nothing to measure
    if device.type == "cuda" and not paths.refused:
        log.info("measuring the GPU: memory bandwidth, host->GPU copies")
        props = torch.cuda.get_device_properties(device)
        gpu.update(
            gpu=props.name,
            gpu_mem=props.total_memory,
            gpu_capability=f"sm_{paths.capability[0]}{paths.capability[1]}",
            gpu_smem=paths.smem,
            gpu_sms=paths.sms,
            hbm_read_gbps=ceilings.hbm_read_gbps(device),
            pinned_h2d_gbps=ceilings.h2d_gbps(device, record, pinned=True),
            pageable_h2d_gbps=ceilings.h2d_gbps(device, record, total=256 << 20, pinned=False),
        )
    log.info("measuring the CPU lane's expert kernel")
    return Ceilings(
        **gpu,
        disk=str(folder.resolve()),
        disk_direct=direct,
        seq_read_gbps=seq,
        random_read_gbps=rand,
        store_read_gbps=store,
        record_bytes=record,
        ram_available=available_ram(),
        cpu_cores=len(os.sched_getaffinity(0)),
        cpu_isa=ceilings.cpu_isa(),
        cpu_moe_gbps=host_moe_gbps(model.record if model is not None else V3_LAYOUT),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        seconds=time.perf_counter() - t0,
    )


def model_expert_bytes(model: Manifest | None) -> int | None:
    """Bytes of the routed-expert records one token of `model` moves (MTP left out); None without one."""
    if model is None:
        return None
    return len(expert_layers(model)) * model.args.n_activated_experts * model.record.nbytes


# DeepSeek-V3: 58 MoE layers x top-8, for the verdict without a model
V3_EXPERTS_PER_TOKEN = 58 * 8


def verdict(c: Ceilings, expert_bytes_per_token: int | None = None) -> list[str]:
    """What will limit decode: per-token times of moving the routed experts a token uses through each link
    (DeepSeek-V3's when no model's figure is given), slowest first."""
    per_token = expert_bytes_per_token or V3_EXPERTS_PER_TOKEN * c.record_bytes
    links = [("SSD (random record reads)", c.random_read_gbps)]
    if c.gpu:
        links += [("host->GPU (pinned)", c.pinned_h2d_gbps), ("GPU memory", c.hbm_read_gbps)]
    links = [(name, gbps, per_token / (gbps * 1e9)) for name, gbps in links if gbps > 0]
    lines = [f"routed experts per token: {format_bytes(per_token)}; if none were cached, each token would take:"]
    lines += [f"  {name}: {s * 1e3:,.0f} ms ({gbps:.2f} GB/s)" for name, gbps, s in sorted(links, key=lambda r: -r[2])]
    if links:
        slow = max(links, key=lambda r: r[2])
        lines.append(f"verdict: {slow[0]} limits decode; every expert kept in a faster tier saves its share")
    if not c.disk_direct:
        lines.append(f"note: {c.disk} refuses O_DIRECT (tmpfs?): its reads went through the page cache")
    if not c.gpu:
        lines.append("note: no CUDA device: dsfp4 runs on the CPU here, far below these links")
    if c.kernel_word:
        lines.append(f"note: {c.kernel_word}")
    return lines


def table(c: Ceilings) -> str:
    card = f", {c.gpu_capability}, {c.gpu_sms} SMs, {format_bytes(c.gpu_smem)} shared memory a block" if c.gpu else ""
    rows = [
        ("GPU", f"{c.gpu} ({format_bytes(c.gpu_mem)}{card})" if c.gpu else "none"),
        ("HBM read", f"{c.hbm_read_gbps:,.0f} GB/s" if c.gpu else "-"),
        (
            "host->GPU",
            f"pinned {c.pinned_h2d_gbps:.1f} GB/s, pageable {c.pageable_h2d_gbps:.1f} GB/s "
            f"({format_bytes(c.record_bytes)} copies)"
            if c.gpu
            else "-",
        ),
        (
            "disk",
            f"{c.disk}: sequential {c.seq_read_gbps:.2f} GB/s, random records {c.random_read_gbps:.2f} GB/s, "
            f"as the store reads {c.store_read_gbps:.2f} GB/s" + ("" if c.disk_direct else " (page cache)"),
        ),
        ("RAM available", format_bytes(c.ram_available)),
        ("CPU", f"{c.cpu_cores} cores, {' '.join(c.cpu_isa) or 'no vector extensions found'}"),
        (
            "CPU experts",
            f"{c.cpu_moe_gbps:.1f} GB/s of records for one token (the CPU lane's kernel, --cpu-experts)"
            if c.cpu_moe_gbps
            else "no C compiler: the CPU lane is off",
        ),
        *(("kernels" if i == 0 else "", f"{part}: {path}") for i, (part, path) in enumerate(c.kernel_paths.items())),
        ("measured", f"{c.measured_at} in {c.seconds:.1f} s"),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def plan_floor(plan: Plan, manifest: Manifest, c: Ceilings) -> float | None:
    """Seconds per decode token that a plan's tiers allow at these ceilings if every expert were equally
    likely (real routing is skewed, and a hot profile puts the hottest on the device): each of a token's
    experts is on the device with probability gpu_slots / records, in RAM (which holds the device's too)
    with ram_slots / records, else on the SSD; backbone the plan keeps in RAM crosses PCIe with the copies. None
    without a GPU measured or without experts."""
    if not plan.total_records or manifest.record is None:
        return None
    n = plan.total_records
    on_gpu, in_ram = min(plan.gpu_slots / n, 1.0), min(max(plan.ram_slots, plan.gpu_slots) / n, 1.0)
    backbone, record = token_bytes(manifest)
    experts = len(plan.expert_layers) * manifest.args.n_activated_experts * record
    host = step_bytes_on_host(manifest, plan.on_host, BF16)
    return c.floor_s(backbone - host + experts, (1 - in_ram) * experts, (1 - on_gpu) * experts + host)


def expected_floor(plan: Plan, manifest: Manifest, path: Path | None = None) -> tuple[float | None, str]:
    """(plan_floor at the saved ceilings, a line saying it or how to get it) for `run --plan`."""
    path = path or default_path()
    if not path.is_file():
        return None, f"decode floor: run `dsfp4 doctor` to measure this machine's ceilings ({path})"
    floor = plan_floor(plan, manifest, load(path))
    if floor is None:
        return None, "decode floor: the saved ceilings have no GPU (or the model no routed experts)"
    return floor, (
        f"decode floor at this machine's ceilings ({path}), experts equally likely: "
        f"{floor * 1e3:,.1f} ms per token ({1 / floor:,.1f} tok/s)"
    )
