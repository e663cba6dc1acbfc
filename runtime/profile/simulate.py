"""Decode simulated through the expert store: a routing trace replayed through the store's own slot pools and
eviction policies, with its loads timed on the links a machine has, to project a model that is not here.

What a decode step does, as the store does it (runtime/store/expert_store.py), MoE layer after MoE layer:
  1. the layer's attention runs, then its router: the chosen experts are known (the host reads them when they
     stream, which costs `host_s`);
  2. each chosen record not in a device slot is brought in: from RAM over PCIe, or first read from the SSD;
     reads queue on one SSD, copies on one PCIe link, each at its bandwidth (several in flight share it);
  3. the next layer's guessed experts (a prefetcher of the stated recall) are started right after: reads and
     copies queued behind this layer's own, never evicting one of this layer's experts;
  4. the experts compute once every chosen record is on the device.
The dense layers and the head run once per token (`other_s`). Pools are global across layers and inclusive, as
the store's (a device hit touches the RAM copy). Simplifications, stated: a slot whose load is in flight may be
chosen as a victim (the store pins it), and reads and copies of a queue run one after another at the link's full
rate (the store keeps several reads in flight to reach it). Legend: N tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dsfp4.runtime.models.trace_routing import guesses
from dsfp4.runtime.store.placement import hold_hottest
from dsfp4.runtime.store.policy import TIER_POLICIES
from dsfp4.runtime.store.slots import SlotPool

Key = tuple[int, int]  # (layer, expert)
PER_TOKEN = (
    "seconds",
    "compute_s",
    "stall_s",
    "ssd_bytes",
    "pcie_bytes",
    "uses",
    "device_hits",
    "ram_hits",
    "ssd_misses",
    "prefetch_loads",
)  # summed over the tokens counted, then averaged


@dataclass(frozen=True)
class Links:
    """Bytes per second: SSD record reads at the store's read pattern, pinned host->device copies."""

    ssd: float
    pcie: float


@dataclass(frozen=True)
class StepCosts:
    """Seconds of compute of a decode token: per MoE layer before its router's choice (attention, router) and after
    its records are there (routed and shared experts); per token for the rest (dense layers, head); per MoE layer
    whose experts stream, the host's round trip."""

    attn_s: float
    experts_s: float
    other_s: float
    host_s: float = 0.0


@dataclass
class Projection:
    """Per decode token (the first `warmup` tokens of the trace not counted)."""

    tokens: int = 0
    seconds: float = 0.0  # per token
    compute_s: float = 0.0
    stall_s: float = 0.0  # waiting for records
    ssd_bytes: float = 0.0
    pcie_bytes: float = 0.0
    uses: float = 0.0  # chosen (layer, expert) records
    device_hits: float = 0.0
    ram_hits: float = 0.0
    ssd_misses: float = 0.0
    prefetch_loads: float = 0.0

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s}


def simulate(
    trace: np.ndarray,
    gpu_slots: int,
    ram_slots: int,
    record_bytes: int,
    links: Links,
    costs: StepCosts,
    policy: str = "hot",
    recall: float | None = 0.9,
    n_experts: int | None = None,
    warmup: int = 0,
    seed: int = 0,
    warm: list[Key] = (),
    prefetch_reads: bool = True,
) -> Projection:
    """Decode the tokens of `trace` [N, L, K] through pools of gpu_slots and ram_slots records under `policy`
    (TIER_POLICIES), prefetching with guesses at `recall` (None: no prefetch) -> per-token averages. `warm`: records
    hottest first, placed before the first token as a warm start places them (the first gpu_slots on the device,
    the first ram_slots in RAM). prefetch_reads False: guesses are only copied up from RAM, never read from the
    SSD (a wrong guess then costs PCIe time, not SSD time)."""
    n_tokens, n_layers, _ = trace.shape
    n_experts = n_experts or int(trace.max()) + 1
    gpu_policy, ram_policy = TIER_POLICIES[policy]
    gpu, ram = SlotPool(gpu_slots, gpu_policy), SlotPool(ram_slots, ram_policy)
    guessed = None
    if recall is not None:
        guessed = guesses(trace[:, 1:], recall, n_experts, np.random.default_rng([seed, 23]))  # [N, L - 1, K]
    warm = list(warm)
    for pool, keys in ((gpu, warm[:gpu_slots]), (ram, warm[gpu_slots : gpu_slots + ram_slots])):
        for key in reversed(keys):  # as the warm start places them: the hottest touched last, counted most
            pool.allocate(key, ())
    hold_hottest(ram, warm, gpu_slots + trace.shape[2])
    streams = gpu_slots < n_layers * n_experts  # every record resident: nothing moves, the host is not asked
    copy_s, read_s = record_bytes / links.pcie, record_bytes / links.ssd
    on_device: dict[Key, float] = {}  # when a record's copy to its device slot completes
    in_ram: dict[Key, float] = {}  # when a record's read into its RAM slot completes
    ssd_free = pcie_free = now = 0.0
    out, counting = Projection(), False

    def bring(key: Key, at: float, protected: set[Key], demand: bool) -> float | None:
        """Start moving a record that is not on the device there at time `at` -> its arrival time, or None
        (a prefetch finding no slot)."""
        nonlocal ssd_free, pcie_free
        if ram.lookup(key) is not None:
            ready = in_ram.get(key, 0.0)
            if demand:
                out.ram_hits += counting
        else:
            if ram.allocate(key, protected) is None:
                return None
            ssd_free = max(ssd_free, at) + read_s
            ready = in_ram[key] = ssd_free
            out.ssd_bytes += record_bytes * counting
            out.ssd_misses += demand * counting
        if gpu.allocate(key, protected) is None:
            return None
        pcie_free = max(pcie_free, ready, at) + copy_s
        on_device[key] = pcie_free
        out.pcie_bytes += record_bytes * counting
        return pcie_free

    for token in range(n_tokens):
        counting = token >= warmup
        start = now
        for layer in range(n_layers):
            routed = now + costs.attn_s + (costs.host_s if streams else 0.0)
            chosen = dict.fromkeys((layer, int(e)) for e in trace[token, layer])
            protected = set(chosen)
            ready = routed
            for key in chosen:
                out.uses += counting
                if gpu.lookup(key) is not None:
                    ram.lookup(key)  # inclusive tiers: the RAM copy stays as warm as the device one
                    out.device_hits += counting
                    ready = max(ready, on_device.get(key, 0.0))
                    continue
                arrival = bring(key, routed, protected, demand=True)
                if arrival is None:
                    raise ValueError(f"{gpu_slots} device slots cannot hold one layer's {len(chosen)} experts")
                ready = max(ready, arrival)
            if guessed is not None and layer + 1 < n_layers:
                wanted = [(layer + 1, e) for e in dict.fromkeys(int(g) for g in guessed[token, layer])]
                keep = protected | set(wanted)  # a guess never evicts another guess, nor this layer's experts
                for key in wanted:
                    if key in gpu or not (prefetch_reads or key in ram):
                        continue
                    if bring(key, routed, keep, demand=False) is not None:
                        out.prefetch_loads += counting
            out.stall_s += (ready - routed) * counting
            now = ready + costs.experts_s
        now += costs.other_s
        if counting:
            out.tokens += 1
            out.seconds += now - start
    n = max(out.tokens, 1)
    per_layer = costs.attn_s + costs.experts_s + (costs.host_s if streams else 0.0)
    out.compute_s = (n_layers * per_layer + costs.other_s) * out.tokens
    for field in PER_TOKEN:
        setattr(out, field, getattr(out, field) / n)
    return out
