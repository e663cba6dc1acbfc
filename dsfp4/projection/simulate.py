"""The expert store simulated: a routing trace replayed through the store's own slot pools and eviction policies,
with its loads timed on the links a machine has, to project a model that is not here.

What a decode step does, as the store does it (runtime/store/expert_store.py), MoE layer after MoE layer:
  1. the layer's attention runs, then its router: the chosen experts are known (the host reads them when they
     stream, which costs `host_s`);
  2. each chosen record not in a device slot is brought in: from RAM over PCIe, or first read from the SSD;
     reads queue on one SSD, copies on one PCIe link, each at its bandwidth (several in flight share it);
  3. the next layer's guessed experts (a prefetcher of the stated recall) are started right after: reads and
     copies queued behind this layer's own, never evicting one of this layer's experts;
  4. the experts compute once every chosen record is on the device.
The dense layers and the head run once per token (`other_s`). A prompt's chunk (simulate_prefill.py) does the same
with every token of the chunk at once: its layer's distinct experts come in waves of the store's wave_size (all of
them where the device slots hold them, else half the slots a wave), device hits first, then RAM's, then the SSD's;
a wave's reads start as the wave before it computes, and its copies wait for the compute of the wave before that
(or, in one wave, for nothing) to free the slots. Pools are global across layers and inclusive, as the store's (a device
hit touches the RAM copy). Simplifications, stated: a slot whose load is in flight may be chosen as a victim (the
store pins it), and reads and copies of a queue run one after another at the link's full rate (the store keeps
several reads in flight to reach it). Legend: N tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dsfp4.projection.cold_records import ColdRecords
from dsfp4.runtime.models.trace_routing import guesses
from dsfp4.runtime.store.lever_rules import host_candidates, leave_out, swap_cold_by, unhidden
from dsfp4.runtime.store.placement import hold_hottest
from dsfp4.runtime.store.policy import TIER_POLICIES
from dsfp4.runtime.store.slots import SlotPool

# (layer, expert)
Key = tuple[int, int]
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
    "skipped",
    "swapped",
    "host_computed",
    # summed over the tokens counted, then averaged
)


@dataclass(frozen=True)
class Links:
    """Bytes per second: SSD record reads at the store's read pattern, pinned host->device copies, and the host's
    cores computing records of RAM for one token (the CPU lane's kernel; 0: no lane)."""

    ssd: float
    pcie: float
    cpu: float = 0.0


# a kernel reading pinned RAM in place moves bytes at this share of a pinned copy's rate: an FP8 GEMV's over the
# copies' on the H200 (docs/BENCHMARKS.md, the host backbone's entry)
IN_PLACE_SHARE = 49.7 / 54.5
# a prefill GEMM reads its weights once per tile of this many tokens (kernels/fp8/linear.py)
PREFILL_TILE_ROWS = 128


@dataclass(frozen=True)
class HostStream:
    """Backbone a plan keeps in pinned RAM (runtime/plan/host_backbone.py), read in place on every step over the link
    the expert copies take: per streamed MoE layer (by its index among the MoE layers) its attention's and router's
    bytes and its shared experts'; per token the rest (dense layers, the embedding's row). `hidden_bytes`: what a
    layer-wise pass moves over that link per token and MoE layer, its hidden state to the device and back around the
    block's attention and its feed-forward (layer_pass.py), the dense blocks' share included."""

    layers: frozenset[int] = frozenset()
    attn_bytes: float = 0.0
    experts_bytes: float = 0.0
    other_bytes: float = 0.0
    hidden_bytes: float = 0.0


@dataclass(frozen=True)
class StepCosts:
    """Seconds of compute of a token: per MoE layer before its router's choice (attention, router) and after
    its records are there (routed and shared experts); per token for the rest (dense layers, head); per MoE layer
    whose experts stream, the host's round trip (once per forward, however many tokens it holds); per wave of a
    layer step that takes several (a prompt's: simulate_prefill.py), the host's work to plan and queue a compacted
    wave (kernels/moe/waves.py), beside the device's compute of the wave before."""

    attn_s: float
    experts_s: float
    other_s: float
    host_s: float = 0.0
    wave_s: float = 0.0


@dataclass
class Projection:
    """Decode: per token (the first `warmup` tokens of the trace not counted). Prefill: the whole prompt (`tokens`
    its length, `seconds` the time to its first token)."""

    tokens: int = 0
    seconds: float = 0.0
    compute_s: float = 0.0
    # waiting for records
    stall_s: float = 0.0
    ssd_bytes: float = 0.0
    pcie_bytes: float = 0.0
    # chosen (layer, expert) records
    uses: float = 0.0
    device_hits: float = 0.0
    ram_hits: float = 0.0
    ssd_misses: float = 0.0
    prefetch_loads: float = 0.0
    # choices left out by an expert threshold (cold, and weighed below it)
    skipped: float = 0.0
    # cold choices cache-aware routing traded for a warm expert of the same group
    swapped: float = 0.0
    # RAM hits the CPU lane computed (among ram_hits)
    host_computed: float = 0.0

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s}


@dataclass(frozen=True)
class SwapModel:
    """Cache-aware routing (runtime/store/cache_aware.py) on a trace that holds no scores: each unchosen expert of a
    cold choice's group counts as scored within the margin with probability `close` (what a router's scores give at
    that margin: scripts/router_margins.py), and the swap takes one such warm expert at random."""

    groups: int
    close: float
    seed: int = 0


class Tiers:
    """The store's two pools and its two links in simulated time: where each record is, when its read and its copy
    complete, and the moves counted into `out` while `counting`."""

    def __init__(
        self,
        gpu_slots: int,
        ram_slots: int,
        record_bytes: int,
        links: Links,
        policy: str,
        warm: list[Key],
        keep_free: int,
        cold: ColdRecords | None = None,
    ) -> None:
        """Pools warm-started from `warm` (Tiers.place, `keep_free` slots left to move through); `out`, a fresh
        Projection, counts the moves; `cold`: records stored in cold codes, read and copied at their own size."""
        gpu_policy, ram_policy = TIER_POLICIES[policy]
        self.cold, self.links = cold or ColdRecords(), links
        self.gpu = SlotPool(gpu_slots, gpu_policy)
        self.ram = SlotPool(ram_slots, ram_policy, self.cold.slots, self.cold.keys.__contains__)
        self.record, self.out, self.counting = record_bytes, Projection(), True
        self.in_place = links.pcie * IN_PLACE_SHARE
        # when a record's copy to its device slot completes
        self.on_device: dict[Key, float] = {}
        # when a record's read into its RAM slot completes
        self.in_ram: dict[Key, float] = {}
        self.ssd_free = self.pcie_free = self.cpu_free = 0.0
        self.place(list(warm), keep_free)

    def place(self, warm: list[Key], keep_free: int) -> None:
        """Records hottest first, placed as a warm start places them (placement.preload: the first gpu_slots on the
        device and the first the RAM slots hold in RAM, or the next ones when the device is the larger); the hot policy
        then holds them, leaving `keep_free` slots to move through."""
        g, r = len(self.gpu.key_of), len(self.ram.key_of)
        for pool, keys in ((self.gpu, warm[:g]), (self.ram, self.ram.fitting(warm if g <= r else warm[g:]))):
            # the hottest touched last, counted most
            for key in reversed(keys):
                pool.allocate(key, ())
        hold_hottest(self.ram, warm, keep_free)

    def on_gpu(self, key: Key) -> float | None:
        """A device hit -> when its record is there (a prefetch may still be copying it), or None."""
        if self.gpu.lookup(key) is None:
            return None
        # inclusive tiers: the RAM copy stays as warm as the device one
        self.ram.lookup(key)
        return self.on_device.get(key, 0.0)

    def stream(self, at: float, nbytes: float, compute_s: float) -> float:
        """Compute of `compute_s` from `at` that reads `nbytes` of backbone in place over PCIe, behind the copies
        queued before it -> when it is done."""
        if not nbytes:
            return at + compute_s
        self.pcie_free = max(self.pcie_free, at) + nbytes / self.in_place
        self.out.pcie_bytes += nbytes * self.counting
        return max(self.pcie_free, at + compute_s)

    def nbytes(self, key: Key) -> int:
        return self.cold.size(key) if key in self.cold.keys else self.record

    def host_may_read(self, key: Key, at: float) -> bool:
        """A RAM hit of the model's format whose read is done at `at` (what the CPU lane computes)."""
        return key in self.ram and key not in self.cold.keys and self.in_ram.get(key, 0.0) <= at

    def host_candidates(self, keys: list[Key], at: float, share: float) -> list[Key]:
        """Of one layer's records those the CPU lane would take at `at`, by the store's rule (host_candidates), in
        expert order as the store's chosen list."""
        return host_candidates(sorted(keys), self.gpu.__contains__, lambda k: self.host_may_read(k, at), share)

    def compute_on_host(self, key: Key, at: float) -> float:
        """The CPU lane computes a RAM hit from `at`, behind its earlier work -> when it is done."""
        self.ram.lookup(key)
        self.cpu_free = max(self.cpu_free, at) + self.record / self.links.cpu
        self.out.ram_hits += self.counting
        self.out.host_computed += self.counting
        return self.cpu_free

    def bring(self, key: Key, at: float, protected: set[Key], demand: bool, copy_after: float = 0.0) -> float | None:
        """Start moving a record that is not on the device there at time `at`, its copy not before `copy_after`
        (when its slot is free) -> its arrival time, or None (no slot that may be evicted)."""
        out, counting = self.out, self.counting
        nbytes = self.nbytes(key)
        if self.ram.lookup(key) is not None:
            ready = self.in_ram.get(key, 0.0)
            out.ram_hits += demand * counting
        else:
            if self.ram.allocate(key, protected) is None:
                return None
            self.ssd_free = max(self.ssd_free, at) + nbytes / self.links.ssd
            ready = self.in_ram[key] = self.ssd_free
            out.ssd_bytes += nbytes * counting
            out.ssd_misses += demand * counting
        if self.gpu.allocate(key, protected) is None:
            return None
        self.pcie_free = max(self.pcie_free, ready, at, copy_after) + nbytes / self.links.pcie
        self.on_device[key] = self.pcie_free
        out.pcie_bytes += nbytes * counting
        return self.pcie_free


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
    skippable: np.ndarray | None = None,
    swap: SwapModel | None = None,
    host: HostStream = HostStream(),
    cold: ColdRecords | None = None,
    host_share: float = 0.0,
    hide_ratio: float | None = None,
) -> Projection:
    """Decode the tokens of `trace` [N, L, K] through pools of gpu_slots and ram_slots records under `policy`
    (TIER_POLICIES), prefetching with guesses at `recall` (None: no prefetch) -> per-token averages. `warm`: records
    hottest first, placed before the first token as a warm start places them (Tiers.place). prefetch_reads False:
    guesses are only copied up from RAM, never read from the SSD (a wrong guess then costs PCIe time, not SSD
    time). skippable [N, L, K] bool: the choices a token weighs below an expert threshold (never its best): each is
    left out when its record is in neither tier, as the store's skip_cold leaves it out. swap: cache-aware routing,
    before the threshold as in the store. host: backbone read in place from RAM, sharing the PCIe link. cold: records
    stored in cold codes. host_share: the CPU lane's share (runtime/store/host_lane.py), at the links' cpu rate.
    hide_ratio: the adaptive threshold (--expert-threshold auto): of the skippable cold choices a layer leaves out
    only those beyond floor(hide_ratio x its RAM hits crossing PCIe), the least weighed first."""
    n_tokens, n_layers, top_k = trace.shape
    n_experts = n_experts or int(trace.max()) + 1
    guessed = None
    if recall is not None:
        guessed = guesses(trace[:, 1:], recall, n_experts, np.random.default_rng([seed, 23]))  # [N, L - 1, K]
    tiers = Tiers(gpu_slots, ram_slots, record_bytes, links, policy, warm, gpu_slots + top_k, cold)
    out = tiers.out
    swap_rng = None if swap is None else np.random.default_rng([swap.seed, 29])
    # every record resident: nothing moves, the host is not asked
    streams = gpu_slots < n_layers * n_experts
    now = 0.0
    for token in range(n_tokens):
        tiers.counting = counting = token >= warmup
        start = now
        for layer in range(n_layers):
            streamed = layer in host.layers
            routed = tiers.stream(now, host.attn_bytes * streamed, costs.attn_s) + (costs.host_s if streams else 0.0)
            ids = trace[token, layer]
            light = [False] * top_k if skippable is None else skippable[token, layer].tolist()
            # before the threshold, as in the store: a swapped-in expert is warm
            if swap is not None:
                ids, swaps = _swapped(ids, layer, tiers, n_experts // swap.groups, swap.close, swap_rng)
                out.swapped += swaps * counting
            chosen = list(dict.fromkeys((layer, int(e)) for e in ids))
            protected = set(chosen)
            ready = routed
            kept = _kept(chosen, light, tiers, hide_ratio)
            out.skipped += (len(chosen) - len(kept)) * counting
            on_host = tiers.host_candidates(kept, routed, host_share) if host_share and links.cpu else []
            for key in on_host:
                out.uses += counting
                ready = max(ready, tiers.compute_on_host(key, routed))
            for key in kept:
                if key in on_host:
                    continue
                out.uses += counting
                if (there := tiers.on_gpu(key)) is not None:
                    out.device_hits += counting
                    ready = max(ready, there)
                    continue
                arrival = tiers.bring(key, routed, protected, demand=True)
                if arrival is None:
                    raise ValueError(f"{gpu_slots} device slots cannot hold one layer's {len(chosen)} experts")
                ready = max(ready, arrival)
            if guessed is not None and layer + 1 < n_layers:
                wanted = [(layer + 1, e) for e in dict.fromkeys(int(g) for g in guessed[token, layer])]
                # a guess never evicts another guess, nor this layer's experts
                keep = protected | set(wanted)
                for key in wanted:
                    if key in tiers.gpu or not (prefetch_reads or key in tiers.ram):
                        continue
                    if tiers.bring(key, routed, keep, demand=False) is not None:
                        out.prefetch_loads += counting
            out.stall_s += (ready - routed) * counting
            now = tiers.stream(ready, host.experts_bytes * streamed, costs.experts_s)
        now = tiers.stream(now, host.other_bytes, costs.other_s)
        if counting:
            out.tokens += 1
            out.seconds += now - start
    n = max(out.tokens, 1)
    per_layer = costs.attn_s + costs.experts_s + (costs.host_s if streams else 0.0)
    out.compute_s = (n_layers * per_layer + costs.other_s) * out.tokens
    for field in PER_TOKEN:
        setattr(out, field, getattr(out, field) / n)
    return out


def _kept(chosen: list[Key], light: list[bool], tiers: Tiers, hide_ratio: float | None) -> list[Key]:
    """A token's chosen records at one layer (best first, as a trace lists them) -> those it keeps under the expert
    threshold, by the store's rules: `light` choices of cold records are left out (leave_out), and with `hide_ratio`
    (adaptive) only those the RAM hits' copies cannot hide, the least weighed (unhidden)."""
    cold = {k for k in chosen if k not in tiers.gpu and k not in tiers.ram}
    leave, _ = leave_out(chosen, light, cold)
    if hide_ratio is not None:
        crossing = sum(1 for k in chosen if k in tiers.ram and k not in tiers.gpu)
        leave = set(unhidden([k for k in reversed(chosen) if k in leave], len(cold), crossing, hide_ratio))
    return [k for k in chosen if k not in leave]


def _swapped(
    ids: np.ndarray, layer: int, tiers: Tiers, per_group: int, close: float, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """A token's chosen experts [K] at one layer -> (the choice after cache-aware routing's swaps, by the store's rule
    (swap_cold_by), their number): each warm group mate of a cold choice counts as scored within the margin with
    probability `close`, and the swap takes one of those at random."""

    def near(t: int, e: int, mates: list[int]) -> int | None:
        close_ones = [c for c in mates if rng.random() < close]
        return close_ones[int(rng.integers(len(close_ones)))] if close_ones else None

    warm = lambda e: (layer, e) in tiers.gpu or (layer, e) in tiers.ram  # noqa: E731
    new, swaps = swap_cold_by(ids[None], warm, per_group, near)
    return new[0], swaps
