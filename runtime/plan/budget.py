"""Memory budgets: sizes as users write them, named hardware presets, and what this machine has free.

A budget is bytes the runtime may hold: `gpu` covers everything it allocates on the device (backbone,
KV cache, workspace, expert slots), `cpu` the process's resident memory (interpreter, libraries, the
pinned RAM cache). Defaults take free VRAM and available RAM (the cgroup's limit when it is lower),
less a safety margin for the desktop, the OS and other processes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsfp4.errors import ConfigError
from dsfp4.units import format_bytes

if TYPE_CHECKING:
    import torch

GiB = 1 << 30
UNIT_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


@dataclass(frozen=True)
class Preset:
    # each card's budget
    gpu: int
    cpu: int
    about: str
    # cards in the box (--devices names as many): their budgets are `gpu` each, the RAM and SSD are one machine's
    cards: int = 1


# What a card and a machine of that class leave us after the display, the CUDA context and the OS.
PRESETS = {
    "16g": Preset(15 * GiB, 80 * GiB, "16 GB GPU, 96 GB RAM, PCIe 5 SSD"),
    "24g": Preset(23 * GiB, 80 * GiB, "RTX 4090 24 GB, 96 GB RAM, PCIe 4 SSD"),
    "32g": Preset(31 * GiB, 100 * GiB, "RTX 5090 32 GB, 128 GB RAM"),
    "80g": Preset(76 * GiB, 200 * GiB, "H100 80 GB, 256 GB RAM"),
    # two cards in one box, the RAM and SSD of the one-card classes (runtime/plan/device_split.py splits the layers)
    "2x16g": Preset(15 * GiB, 80 * GiB, "two 16 GB GPUs, 96 GB RAM, PCIe 5 SSD", cards=2),
    "2x24g": Preset(23 * GiB, 80 * GiB, "two RTX 3090 or 4090 24 GB, 96 GB RAM, PCIe 4 SSD", cards=2),
}


def parse_size(text: str, flag: str) -> int:
    """'24GiB', '24G', '24g', '1.5T', '512M', '4096' -> bytes (binary units: G = GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise ConfigError(f"{flag} {text!r}: give a size such as 14G, 20GiB or 512M")
    return int(float(m.group(1)) * (1 << UNIT_SHIFT[m.group(2).lower()]))


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise ConfigError(f"/proc/meminfo has no {key}; give --cpu-mem")


def _cgroup_room() -> int | None:
    """Bytes left under the cgroup's memory limit (v2, then v1), or None without a limit."""
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            cap = Path(limit).read_text().strip()
            used = int(Path(usage).read_text())
        except (OSError, ValueError):
            continue
        if cap != "max" and int(cap) < 1 << 60:
            return max(int(cap) - used, 0)
    return None


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status in bytes: VmRSS now, VmHWM the peak (0 where there is none).
    Per process, unlike ru_maxrss, which carries a parent's peak across fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def process_rss() -> int:
    return proc_status_bytes("VmRSS")


def peak_memory(device: torch.device) -> tuple[int, int]:
    """(peak device bytes: torch's max reserved, 0 on the CPU; peak process RSS: VmHWM)."""
    # torch imported here: the command line's help reads this module (PRESETS, Budgets)
    import torch

    gpu = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    return gpu, proc_status_bytes("VmHWM")


def available_ram() -> int:
    room = _cgroup_room()
    avail = _meminfo("MemAvailable")
    return avail if room is None else min(avail, room)


def default_gpu_budget(device: torch.device) -> int:
    """Free VRAM less 5% of the card (at least 512 MiB) for the driver, the display and fragmentation."""
    # torch imported here: the command line's help reads this module (PRESETS, Budgets)
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return max(free - max(total // 20, GiB // 2), 0)


def default_host_budget() -> int:
    """What the process holds now plus 80% of the available RAM (the rest stays with the OS)."""
    return process_rss() + available_ram() * 4 // 5


def default_sizes(gpu: int | None, cpu: int | None, device: torch.device) -> tuple[int, int]:
    """The budgets not given, from this machine's free memory. On a CPU device both tiers are host memory: they
    share the host's budget (a third to the 'device', the process with it, the rest to the RAM cache), and one
    given takes its size from the other's share."""
    if device.type == "cuda":
        return default_gpu_budget(device) if gpu is None else gpu, default_host_budget() if cpu is None else cpu
    host = default_host_budget()
    # a size given alone must leave the other some of the host: else the planner would blame the flag not given
    for flag, given in (("--gpu-mem", gpu), ("--cpu-mem", cpu)):
        if given is not None and (gpu is None or cpu is None) and given >= host:
            other = "--cpu-mem" if flag == "--gpu-mem" else "--gpu-mem"
            raise ConfigError(
                f"{flag} {format_bytes(given)}: a {device.type} run holds both budgets in this machine's RAM, which "
                f"has {format_bytes(host)} free for them; give {flag} less than that (the rest goes to {other}), "
                "or both flags"
            )
    if gpu is None:
        gpu = host // 3 if cpu is None else host - cpu
    return gpu, host - gpu if cpu is None else cpu


@dataclass(frozen=True)
class Budgets:
    """Bytes the run may hold on the device (`gpu`) and in the process (`cpu`). Parsed from the flags (`parse`), a size
    neither a flag nor the preset gives is None until `resolve` takes it from the run's device and host: the planner
    sees resolved budgets only. A run split across cards (--devices) has one device budget per card (`cards`, in the
    order of --devices), and `gpu` is their sum once resolved (runtime/plan/devices.py)."""

    gpu: int | None
    cpu: int | None
    # how they were chosen, for the plan table
    source: str
    # each card's device budget of a split run (None: that card's free memory); () for one device
    cards: tuple[int | None, ...] = ()

    @classmethod
    def parse(cls, gpu_mem: str | None, cpu_mem: str | None, preset: str | None, n_cards: int = 1) -> Budgets:
        """--gpu-mem, --cpu-mem and --preset for a run on `n_cards` cards: explicit sizes win over the preset's.
        --gpu-mem gives one size (each card's) or one per card, separated by commas."""
        if preset is not None and preset not in PRESETS:
            raise ConfigError(f"--preset {preset}: choose one of {', '.join(PRESETS)}")
        p = PRESETS.get(preset) if preset else None
        if p is not None and p.cards > 1 and n_cards != p.cards:
            raise ConfigError(
                f"--preset {preset} is a machine of {p.cards} cards: name them with --devices "
                f"(as {','.join(f'cuda:{i}' for i in range(p.cards))}), or choose a one-card preset"
            )
        sizes = [parse_size(t, "--gpu-mem") for t in gpu_mem.split(",")] if gpu_mem else []
        if len(sizes) > 1 and len(sizes) != n_cards:
            cards = f"--devices names {n_cards}" if n_cards > 1 else "one device runs"
            raise ConfigError(
                f"--gpu-mem {gpu_mem} gives {len(sizes)} budgets, one per card, but {cards}; give one size (each "
                "card's) or one per card of --devices"
            )
        each = sizes[0] if len(sizes) == 1 else p.gpu if p and not sizes else None
        per_card = tuple(sizes) if len(sizes) > 1 else (each,) * n_cards
        gpu = per_card[0] if n_cards == 1 else sum(per_card) if None not in per_card else None
        cpu = parse_size(cpu_mem, "--cpu-mem") if cpu_mem else p.cpu if p else None
        sources = [f"preset {preset} ({p.about})"] if p else []
        sources += [flag for flag, given in (("--gpu-mem", gpu_mem), ("--cpu-mem", cpu_mem)) if given]
        return cls(gpu, cpu, ", ".join(sources) or "free memory of this machine", per_card if n_cards > 1 else ())

    def resolve(self, device: torch.device) -> Budgets:
        """Both sizes: those not given from this machine's free memory (the preset's and the flags' win over it). A
        split run's cards resolve with runtime/plan/devices.py's card_budgets."""
        gpu, cpu = default_sizes(self.gpu, self.cpu, device)
        return Budgets(gpu, cpu, self.source, self.cards)


def resolve_budgets(gpu_mem: str | None, cpu_mem: str | None, preset: str | None, device: torch.device) -> Budgets:
    """Explicit flags win over the preset, the preset over the machine's free memory."""
    return Budgets.parse(gpu_mem, cpu_mem, preset).resolve(device)
