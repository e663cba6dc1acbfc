"""Counters of the expert store: where each expert came from, the bytes moved, how well prefetch
predicted, how long the model waited. Cumulative; a generation reports the difference of two snapshots.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


def disk_rate(ssd_bytes: float, ssd_read_s: float, io_threads: int) -> float:
    """Bytes/s of the SSD as the store's readers found it: each reader's rate (ssd_read_s is summed over them) times
    the readers, all in flight; 0 before any read."""
    return ssd_bytes / ssd_read_s * io_threads if ssd_read_s else 0.0


@dataclass
class StoreCounters:
    # MoE layer invocations
    layer_steps: int = 0
    # experts those invocations needed
    expert_uses: int = 0
    # experts found in a device slot
    gpu_hits: int = 0
    # found in the RAM cache (then copied to the device, or read there zero-copy)
    ram_hits: int = 0
    # in neither: read from the SSD on demand
    ssd_misses: int = 0
    # records read from the SSD (demand and prefetch)
    ssd_reads: int = 0
    ssd_bytes: int = 0
    # summed over reader threads
    ssd_read_s: float = 0.0
    # records moved host -> device: copied to a slot, or read in place by a kernel
    h2d_bytes: int = 0
    # records a prediction started moving
    prefetch_loads: int = 0
    # experts predicted for a layer ...
    predicted: int = 0
    # ... experts that layer then used ...
    actual: int = 0
    # ... and both
    predicted_used: int = 0
    # host time blocked waiting for expert loads
    stall_s: float = 0.0
    # experts left out by the expert threshold (cold, and every token that chose them left them out)
    skipped: int = 0
    # the records they would have read
    skipped_bytes: int = 0
    # choices cache-aware routing traded for a warm expert of the same group
    swapped: int = 0
    # RAM hits the host computed from RAM (the CPU lane), counted among ram_hits too
    host_computed: int = 0
    # the CPU lane's kernel time
    host_s: float = 0.0
    # host time blocked waiting for the CPU lane's result
    host_wait_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _layers: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)  # [uses, device, RAM]

    def add_layer(self, layer: int, uses: int, gpu: int, ram: int, steps: int = 1) -> None:
        """A layer step (or `steps` of them): its expert uses, and how many came from the device and from RAM."""
        self.layer_steps += steps
        self.expert_uses += uses
        row = self._layers.setdefault(layer, [0, 0, 0])
        row[0] += uses
        row[1] += gpu
        row[2] += ram

    def layers(self) -> dict[int, tuple[int, int, int]]:
        """layer -> (uses, device hits, RAM hits) so far."""
        return {layer: tuple(row) for layer, row in sorted(self._layers.items())}

    def add_read(self, nbytes: int, seconds: float) -> None:
        # reader threads
        with self._lock:
            self.ssd_bytes += nbytes
            self.ssd_read_s += seconds

    def add_host(self, seconds: float) -> None:
        # the lane's worker
        with self._lock:
            self.host_s += seconds

    def add_prediction(self, predicted: int, actual: int, both: int) -> None:
        self.predicted += predicted
        self.actual += actual
        self.predicted_used += both

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


def counters_since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: now[k] - before.get(k, 0) for k in now}
