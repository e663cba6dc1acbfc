"""The levers of one streamed layer step on the store's tiers: cache-aware swaps, the expert threshold and the CPU
lane's share, each deciding by its rule (lever_rules.py) from what the tiers hold now, and counting what it did."""

from __future__ import annotations

import torch

from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.modes import Levers
from dsfp4.runtime.store.counters import StoreCounters, disk_rate
from dsfp4.runtime.store.host_lane import HostJob, HostLane
from dsfp4.runtime.store.lever_rules import host_candidates, kept_weights, leave_out, light_choices, unhidden
from dsfp4.runtime.store.slots import SlotPool
from dsfp4.runtime.store.transfers import Transfers


class StepLevers:
    """`levers` over the store's pools (device, RAM), its reads (`io`) and its CPU lane, once the RAM cache is open
    (open): what the rules ask of the tiers, and the counts of what they did."""

    def __init__(
        self, levers: Levers, pools: tuple[SlotPool, SlotPool], manifest: Manifest, counters: StoreCounters
    ) -> None:
        self.levers, (self.gpu_pool, self.ram_pool), self.manifest = levers, pools, manifest
        self.counters = counters
        self.io: Transfers | None = None
        self.lane: HostLane | None = None
        self.pcie_gbps, self.io_threads = 0.0, 1

    def open(self, io: Transfers, lane: HostLane | None, pcie_gbps: float, io_threads: int) -> None:
        """The RAM cache's readers, the CPU lane (None: no share) and the rates the adaptive threshold weighs."""
        self.io, self.lane, self.pcie_gbps, self.io_threads = io, lane, pcie_gbps, io_threads

    def is_warm(self, layer: int, expert: int) -> bool:
        """The record is on the device or in RAM: using it reads nothing from the SSD."""
        return (layer, expert) in self.gpu_pool or (layer, expert) in self.ram_pool

    def count_swaps(self, n: int) -> None:
        self.counters.swapped += n

    def skip_cold(self, layer: int, ids: list[int], weights: list[float], top_k: int) -> tuple[set[int], list[bool]]:
        """Under Levers.expert_threshold: a token leaves out a chosen expert that is in neither the device nor RAM
        and that it weighs below the threshold (as a share of its routed weight), unless it is the token's best.
        ids, weights: the step's [T, K] choice, flattened -> (the experts no token keeps: not loaded, the choices
        left out [T * K])."""
        threshold = self.levers.expert_threshold
        if not threshold:
            return set(), [False] * len(ids)
        light, shares = light_choices(weights, top_k, threshold)
        cold = {e for e in set(ids) if not self.is_warm(layer, e)}
        skip, drop = leave_out(ids, light, cold)
        # only what the step's copies cannot hide, the least weighed first
        if self.levers.adaptive and skip:
            # each expert's largest share of a choosing token's routed weight
            weight: dict[int, float] = {}
            for e, share in zip(ids, shares, strict=True):
                weight[e] = max(weight.get(e, 0.0), share)
            crossing = sum(1 for e in set(ids) if (layer, e) in self.ram_pool and (layer, e) not in self.gpu_pool)
            skip = set(unhidden(sorted(skip, key=weight.__getitem__), len(cold), crossing, self._hide_ratio()))
            drop = [d and e in skip for e, d in zip(ids, drop, strict=True)]
        self.counters.skipped += len(skip)
        self.counters.skipped_bytes += sum(self.manifest.layout_of((layer, e)).nbytes for e in skip)
        return skip, drop

    def _hide_ratio(self) -> float:
        """The SSD's read rate over the PCIe copies' (Levers.hide_ratio, else measured: the readers' bytes over their
        time, all io_threads in flight, against pinned copies measured when the RAM cache opened; 0 before any
        read, or without a GPU)."""
        if self.levers.hide_ratio is not None:
            return self.levers.hide_ratio
        c = self.counters
        if not self.pcie_gbps:
            return 0.0
        return disk_rate(c.ssd_bytes, c.ssd_read_s, self.io_threads) / 1e9 / self.pcie_gbps

    def _host_may_read(self, layer: int, e: int) -> bool:
        rslot = self.ram_pool.slot_of.get((layer, e))
        if rslot is None or self.manifest.layout_of((layer, e)).cold:
            return False
        job = self.io.reading(rslot)
        # an upload still waiting is waiting for the read
        return job is None or job.done()

    def host_split(self, layer: int, chosen: list[int]) -> dict[int, int]:
        """Of a decode step's distinct chosen experts, those the host computes (expert -> RAM slot, pinned until its
        job is collected): the lane's share of those not on the device (lever_rules.host_candidates). Only these: a
        prefetch copies its guesses while the layer before computes, off the critical path, where the host cannot
        start (it needs the layer's input)."""
        self.io.retire()
        on_device = lambda e: (layer, e) in self.gpu_pool  # noqa: E731
        take = host_candidates(chosen, on_device, lambda e: self._host_may_read(layer, e), self.lane.share)
        host = {e: self.ram_pool.slot_of[(layer, e)] for e in take}
        for e, rslot in host.items():
            # a use, for the policy
            self.ram_pool.lookup((layer, e))
            self.ram_pool.pin(rslot)
        self.counters.host_computed += len(host)
        return host

    def submit_host(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        host: dict[int, int],
        ids: list[int],
        skipped: set[int],
        drop: list[bool] | None,
        by_expert: bool,
    ) -> HostJob:
        """Start the host's experts of host_split on the step's x [T, D] and weights [T, K], weighted as the device
        weighs the same choices: renormalized over those not left out, by expert when `by_expert` (a captured step's
        next piece drops each expert without a slot) else by choice. Its RAM slots are unpinned if it cannot start."""
        try:
            k = weights.shape[-1]
            chosen = torch.tensor(ids, dtype=torch.int64).view(-1, k)  # [T, K]
            w = weights.float().cpu()  # [T, K]
            if by_expert and skipped:
                w = kept_weights(w, ~torch.isin(chosen, torch.tensor(sorted(skipped))))
            elif not by_expert and drop is not None and any(drop):
                w = kept_weights(w, ~torch.tensor(drop).view(-1, k))
            return self.lane.submit(host, x.float().cpu(), chosen, w, self.ram_pool.unpin)
        except BaseException:
            self.release_host(host)
            raise

    def release_host(self, host: dict[int, int]) -> None:
        """Unpin host_split's RAM slots when no job was started for them (its inputs failed)."""
        for rslot in host.values():
            self.ram_pool.unpin(rslot)
