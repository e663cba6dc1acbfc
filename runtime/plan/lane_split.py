"""The CPU lane's share of a decode step's experts not on the device (runtime/store/host_lane.py): the --cpu-experts
setting checked (auto, off or a share), and the split a run takes with what decided it (probes.py measures and
decides it). Free of torch: runtime/options.py checks the setting and the command line reads that module."""

from __future__ import annotations

from dataclasses import dataclass

from dsfp4.errors import ConfigError


@dataclass(frozen=True)
class LaneSplit:
    """The CPU lane's share of a step's experts not on the device, and what decided it (GB/s; 0 when not measured)."""

    share: float
    cpu_gbps: float = 0.0
    pcie_gbps: float = 0.0
    why: str = ""

    def describe(self) -> str:
        if not self.share:
            return f"off ({self.why})" if self.why else "off"
        measured = (
            f": CPU kernel {self.cpu_gbps:.1f} GB/s, PCIe copies {self.pcie_gbps:.1f} GB/s" if self.cpu_gbps else ""
        )
        return f"share {self.share:.2f} of the experts not on the GPU{measured}"


NO_LANE = LaneSplit(0.0)


def parse_host_share(setting: str) -> str:
    """--cpu-experts checked: auto, off, or a share from 0 to 1 (ConfigError otherwise)."""
    if setting in ("auto", "off"):
        return setting
    try:
        share = float(setting)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"--cpu-experts {setting}: give auto, off, or a share of a step's experts from 0 to 1")
    return setting
