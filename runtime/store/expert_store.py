"""The expert store: routed-expert records in three tiers under byte budgets.

  device slots  records in their FP4 form, one fixed-size slot each, and a device-side (layer, expert) -> slot
                table that kernels read without asking the host (device_table.py)
  RAM cache     page-aligned (pinned on CUDA) record slots; reads from the SSD land here directly
  SSD           O_DIRECT reads by a thread pool, several in flight, checksummed on first read (transfers.py)

This file is what the model asks of the store: one call per streamed MoE layer step (step: the levers applied by
step_levers.py, the host's share started, the layer's experts brought onto the device in waves by load_waves, the
offsets its kernel reads), the next layer's predicted experts started early (prefetch), and the counters. Where the
records start a run is placement.py's; when device and RAM hold every record, `map` leaves them where they are and
kernels read RAM's in place over PCIe (zero-copy): nothing moves, no layer asks the host, graphs capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.token_bounds import DECODE_TOKENS
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.modes import EXACT, Levers
from dsfp4.runtime.plan.lane_split import NO_LANE, LaneSplit
from dsfp4.runtime.plan.planner import Plan
from dsfp4.runtime.plan.probes import PROBE_BYTES, h2d_gbps
from dsfp4.runtime.store.counters import StoreCounters
from dsfp4.runtime.store.device_table import DeviceTable
from dsfp4.runtime.store.host_lane import HostLane
from dsfp4.runtime.store.layer_step import HostInputs, LayerAsk, LayerExperts
from dsfp4.runtime.store.policy import TIER_POLICIES
from dsfp4.runtime.store.ram_cache import RamCache
from dsfp4.runtime.store.slots import SlotPool
from dsfp4.runtime.store.step_levers import StepLevers
from dsfp4.runtime.store.transfers import Transfers
from dsfp4.runtime.store.use_counts import DeviceUseCounts
from dsfp4.runtime.store.waves import wave_size

# (layer, expert)
Key = tuple[int, int]
# records per read ahead: streams, yet runs in parallel (the fastest of the sizes tried: docs/BENCHMARKS.md)
RUN_RECORDS = 4


class ExpertStore:
    def __init__(
        self,
        model_dir: Path,
        manifest: Manifest,
        device: torch.device,
        plan: Plan,
        policy: str = "lru",
        io_threads: int = 4,
        verify: bool = True,
        host: bool = True,
        prefetch_reads: bool = False,
        levers: Levers = EXACT,
        lane: LaneSplit = NO_LANE,
        shares: ExpertStore | None = None,
    ):
        """`host` False: the RAM cache is allocated (and pinned) by open_host, once the caller has loaded what it
        maps first (load_model: the backbone), so the two never share the RAM budget. `prefetch_reads` False: a
        prefetch only copies guesses already in RAM, never reads one from the SSD. `levers`: the lossy ones
        (runtime/modes.py): the threshold, cache-aware routing's margin (step_levers.py, cache_aware.py).
        `lane`: of a decode step's experts not on the device, the share the host computes from RAM (host_lane.py; 0:
        none), and what decided it. The levers and the lane apply to each streamed layer step (step). `shares`: the
        store whose RAM tier, SSD reads and counters this one shares (a split run's cards: split_store.py; its
        open_host first); this one's device slots hold the records of `plan`'s expert_layers only."""
        self.dir, self.manifest, self.device, self.plan = Path(model_dir), manifest, device, plan
        self.layout = manifest.record
        self.cuda = device.type == "cuda"
        self.shares = shares
        self._counters = StoreCounters() if shares is None else shares._counters
        n = self.layout.nbytes if self.layout else 0
        gpu_policy, ram_policy = TIER_POLICIES[policy]
        cold = manifest.cold_nbytes()
        if plan.cold_slots and not (cold and plan.cold_record >= cold and plan.cold_slots < plan.ram_slots):
            raise ConfigError(
                f"the plan's {plan.cold_slots} narrow RAM slots of {plan.cold_record} bytes do not fit this model's "
                f"cold records ({cold or 'none'} bytes at most) beside {plan.ram_slots} RAM slots in all; "
                f"plan it again (planner.narrowed)"
            )
        self.gpu_pool = SlotPool(plan.gpu_slots, gpu_policy)
        if shares is None:
            is_cold = lambda key: manifest.layout_of(key).cold  # noqa: E731 (the pool's key rule)
            self.ram_pool = SlotPool(plan.ram_slots, ram_policy, plan.cold_slots, is_cold)
        else:
            self.ram_pool = shares.ram_pool
        self.gpu = torch.empty((plan.gpu_slots, n), dtype=torch.uint8, device=device)  # [slots, record]
        a = manifest.args
        self.table = DeviceTable(a.n_blocks, a.n_routed_experts, device)
        self._io_threads, self._verify, self.prefetch_reads = io_threads, verify, prefetch_reads
        self.lane_split = lane
        self.n_experts = a.n_routed_experts
        # with the RAM cache (open_host), when the split has a share
        self.lane: HostLane | None = None
        self.rules = StepLevers(levers, (self.gpu_pool, self.ram_pool), manifest, self._counters)
        self.cache: RamCache | None = None
        # with the RAM cache (open_host)
        self.io: Transfers | None = None
        # the warm start's (placement.py preload), once per engine
        self.warm_records, self.warm_s = 0, 0.0
        self.notes: list[str] = []
        if host:
            self.open_host()
        # map: every record on the device or read from pinned RAM in place
        self.mapped = False
        # uses counted by kernels, when mapped
        self._device_counts: DeviceUseCounts | None = None
        self._predicted: dict[int, set[int]] = {}
        self._counting = True
        # the store that holds a layer's device slots: this one, or in a split run its card's (split_store.py)
        self.route: Callable[[int], ExpertStore] = lambda layer: self

    def open_host(self) -> None:
        """Allocate the RAM cache (pinned on CUDA) and start the SSD readers."""
        p, shared = self.plan, self.shares
        wide = p.ram_slots - p.cold_slots
        owned = shared is None
        n = self.gpu.shape[1]
        self.cache = RamCache(wide, n, p.cold_slots, p.cold_record, pin=self.cuda) if owned else shared.cache
        # [slots, record]: the record-sized slots (what the host lane and mapping read)
        self.ram = self.cache.wide
        pools = (self.gpu_pool, self.ram_pool)
        tiers = (self.gpu, self.cache)
        share = None if owned else shared.io
        self.io = Transfers(
            self.dir, self.manifest, tiers, pools, self.table, self._counters, self._io_threads, self._verify, share
        )
        # pinned copies, measured when the adaptive threshold needs them
        levers, pcie_gbps = self.rules.levers, 0.0
        if levers.adaptive and levers.hide_ratio is None and self.cuda and self.layout is not None:
            pcie_gbps = h2d_gbps(self.device, self.layout.nbytes, total=PROBE_BYTES)
        if self.lane_split.share > 0 and self.layout is not None and self.plan.ram_slots:
            limit = self.manifest.args.swiglu_limit
            self.lane = HostLane(self.ram, self.layout, self.n_experts, limit, self.lane_split.share, self._counters)
        self.rules.open(self.io, self.lane, pcie_gbps, self._io_threads)
        self.notes = [
            f"{self.dir / 'experts'}: the filesystem refuses O_DIRECT (tmpfs?); records are read through "
            f"the page cache, and dropped from it after each read"
        ][: not self.io.direct]

    # -- slots ----------------------------------------------------------------------------------------

    def _allocate(self, pool: SlotPool, key: Key, protected: set[Key], wait: bool) -> int | None:
        while True:
            got = pool.allocate(key, protected)
            if got is not None:
                slot, evicted = got
                if pool is self.gpu_pool:
                    self.table.set(key, slot)
                    if evicted is not None:
                        self.table.set(evicted, -1)
                return slot
            if not wait:
                return None
            self.io.wait_any()

    def _to_ram(self, key: Key, protected: set[Key], wait: bool) -> tuple[int, Future | None] | None:
        """The record's RAM slot, reading it from the SSD if it is not there: (slot, the read still in
        flight or None), or None when no slot is free and `wait` is False."""
        rslot = self.ram_pool.slot_of.get(key)
        if rslot is not None:
            return rslot, self.io.reading(rslot)
        rslot = self._allocate(self.ram_pool, key, protected, wait)
        if rslot is None:
            return None
        return rslot, self.io.read([(key, rslot)])

    def read_ahead(self, keys: Iterable[Key], protected: set[Key]) -> None:
        """Start reading the records of `keys` that are not in RAM from the SSD, in file order, adjacent
        records in one read (runs of RUN_RECORDS); waits only when no RAM slot is free. Never evicts one
        of `keys` or of `protected`."""
        self.io.retire()
        keys = sorted(keys, key=self.manifest.file_position)
        protected = protected | set(keys)
        run: list[tuple[Key, int]] = []
        for key in keys:
            if key in self.ram_pool:
                continue
            rslot = self._allocate(self.ram_pool, key, protected, wait=False)
            # the run so far must be in flight before waiting for a slot
            if rslot is None:
                self.io.read(run)
                run = []
                rslot = self._allocate(self.ram_pool, key, protected, wait=True)
            follows = run and self.manifest.file_position(key) == (key[0], self.manifest.record_end(run[-1][0]))
            if run and (len(run) == RUN_RECORDS or not follows):
                self.io.read(run)
                run = []
            run.append((key, rslot))
        self.io.read(run)

    def start(self, key: Key, protected: set[Key], wait: bool) -> Future | None:
        """Begin moving a record that is not on the device there: (SSD ->) RAM -> device. Returns the job
        whose result is the copy's event, or None when no slot is free and `wait` is False."""
        # RAM copies in use are pinned; the device's are protected
        got = self._to_ram(key, set(), wait)
        if got is None:
            return None
        rslot, read = got
        gslot = self._allocate(self.gpu_pool, key, protected, wait)
        if gslot is None:
            # prefetch: the record stays in RAM
            return None
        return self.io.upload(key, gslot, rslot, read)

    def map(self, host_slots: torch.Tensor, counts: DeviceUseCounts) -> None:
        """Every used record is placed (placement.map_all): those not on the device are read from these RAM slots
        ([blocks, experts] int32, -1 none) in place, and kernels count their uses on the device. Cold records among
        them are widened where they are, once: kernels read only records of the model's format."""
        for (layer, e), rslot in self.ram_pool.slot_of.items():
            cold = self.manifest.layout_of((layer, e))
            if host_slots[layer, e] >= 0 and cold.cold:
                # widen() builds a new tensor
                self.ram[rslot].copy_(cold.widen(self.ram[rslot, : cold.nbytes]))
        self.table.map_host(host_slots)
        self._device_counts, self.mapped = counts, True

    # -- the interface the model uses -----------------------------------------------------------------

    def step(self, ask: LayerAsk) -> LayerExperts:
        """One streamed MoE layer's step: read the ids (the one host sync of the layer), apply the levers to them
        (a cache-aware swap before the threshold: a swapped-in expert is warm, so never left out), start the host's
        share of the RAM hits, and queue the device's experts in waves (load_waves) -> what the layer computes with."""
        rules, ids = self.rules, ask.ids.tolist()
        chosen_ids = ids[: ask.chosen]
        if ask.swap is not None:
            chosen_ids = ask.swap.apply(rules, ask.layer, chosen_ids)
        skipped, drop = set(), None
        if ask.weights is not None:
            top_k = ask.weights.shape[-1]
            skipped, drop = rules.skip_cold(ask.layer, chosen_ids, ask.weights.flatten().tolist(), top_k)
        chosen = sorted(set(chosen_ids) - skipped)
        prefetch = None if ask.after is None else (ask.after, sorted(set(ids[ask.chosen :])))
        host = rules.host_split(ask.layer, chosen) if ask.lane is not None else {}
        job = None
        if host:
            lane, captured = ask.lane, ask.lane.out is not None
            job = rules.submit_host(lane.x, lane.weights, host, chosen_ids, skipped, drop, by_expert=captured)
        device = [e for e in chosen if e not in host]
        waves = self.load_waves(ask.layer, device, prefetch, host=list(host))
        return LayerExperts(ask.layer, chosen, waves, drop, job, self.offsets)

    def reached(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """A layer step whose records the kernels reach without the host (visible): counted (count_step) -> the
        offsets [E] of every expert."""
        self.count_step(layer, ids)
        return self.offsets(layer)

    def host_inputs(self, x: torch.Tensor, weights: torch.Tensor, captured: bool) -> HostInputs | None:
        """What the CPU lane reads of a layer step of x [T, D], weights [T, K]: None without a lane, or for more
        tokens than a decode step's (a prefill's experts all go to the device); captured: with the buffers the next
        piece reads."""
        if self.lane is None or x.shape[0] > DECODE_TOKENS:
            return None
        return HostInputs.captured(x, weights, self.n_experts) if captured else HostInputs(x, weights)

    def load_waves(
        self, layer: int, experts: list[int], prefetch: tuple[int, list[int]] | None = None, host: list[int] = ()
    ) -> Iterator[list[int]]:
        """Yield `experts` in waves of wave_size (all at once where the device slots hold them; a long prompt's layer
        may use more experts than fit): those on the device first, then those in RAM, then the SSD's. When a wave is
        yielded its records are on the device for compute queued on the current stream (copies are
        waited for there, not on the host); their slots are refilled only after the compute queued
        before the next wave (or the end). `prefetch` (next layer, predicted experts) starts once this
        layer's own loads are queued. `host`: the layer's other experts, which the host computes (host_split): counted
        here as RAM hits, not moved."""
        assert not self.mapped, "a mapped store moves nothing: its layers read records where they are"
        self._score_prediction(layer, [*experts, *host])
        tier = {e: 0 if (layer, e) in self.gpu_pool else 1 if (layer, e) in self.ram_pool else 2 for e in experts}
        tiers = list(tier.values())
        self._counters.add_layer(layer, len(experts) + len(host), tiers.count(0), tiers.count(1) + len(host))
        self._counters.ram_hits += len(host)
        order = sorted(experts, key=tier.__getitem__)
        # the host takes every expert of the step: the guesses still go
        if not order and prefetch is not None:
            self.route(prefetch[0]).prefetch(*prefetch, protect={(layer, e) for e in host})
        size = wave_size(len(order), self.plan.gpu_slots)
        for first in range(0, len(order), size):
            wave = order[first : first + size]
            protected = {(layer, e) for e in wave}
            # once per wave: a blocked allocation retires again in wait_any
            self.io.retire()
            jobs = []
            for e in wave:
                key = (layer, e)
                gslot = self.gpu_pool.lookup(key)
                # inclusive tiers: the RAM copy stays as warm as the device one
                self.ram_pool.lookup(key)
                if gslot is not None:
                    self._counters.gpu_hits += 1
                    # a prefetch may still be filling it
                    if (filling := self.io.filling(gslot)) is not None:
                        jobs.append(filling)
                    continue
                in_ram = key in self.ram_pool
                self._counters.ram_hits += in_ram
                self._counters.ssd_misses += not in_ram
                jobs.append(self.start(key, protected, wait=True))
            if prefetch is not None and first == 0:
                self.route(prefetch[0]).prefetch(*prefetch, protect={(layer, e) for e in experts})
            self.io.wait_on_device(jobs)
            yield wave
            if self.cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                self.io.release([self.gpu_pool.slot_of[(layer, e)] for e in wave], event)

    def load(
        self, layer: int, experts: list[int], prefetch: tuple[int, list[int]] | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """load_waves, one (expert, record on the device) at a time."""
        for wave in self.load_waves(layer, experts, prefetch):
            for e in wave:
                yield e, self.gpu[self.gpu_pool.slot_of[(layer, e)]]

    def slot_table(self) -> torch.Tensor:
        """[blocks, experts] int32 on the device: each expert's slot, -1 when it is not there."""
        return self.table.table()

    def offsets(self, layer: int, wave: list[int] | None = None) -> torch.Tensor:
        """[experts] int64 on the device: each expert's record offset from the device pool (kernels/moe), into
        pinned RAM when mapped there, -1 when not there; with `wave`, every other expert is left out (-1) too."""
        return self.table.offsets(layer, self.gpu, self.ram, wave)

    def prefetch(self, layer: int, experts: list[int], protect: set[Key]) -> None:
        """Start moving predicted experts of `layer` towards the device without waiting and without
        evicting anything in `protect` (the current layer's experts) or in flight."""
        self._predicted[layer] = set(experts)
        self.io.retire()
        # a guess never evicts another guess
        keep = protect | {(layer, e) for e in experts}
        for e in experts:
            key = (layer, e)
            if key in self.gpu_pool or not (self.prefetch_reads or key in self.ram_pool):
                continue
            if self.start(key, keep, wait=False) is not None:
                self._counters.prefetch_loads += 1

    def _score_prediction(self, layer: int, experts: list[int]) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self._counters.add_prediction(len(predicted), len(set(experts)), len(predicted & set(experts)))

    @property
    def all_resident(self) -> bool:
        """Every record the run uses sits on the device, none in flight (nothing can be evicted then)."""
        return len(self.gpu_pool.slot_of) == self.plan.total_records > 0 and not self.io.gpu_jobs

    @property
    def visible(self) -> bool:
        """The kernels reach every record the run uses without the host: all resident, or mapped."""
        return self.mapped or self.all_resident

    # -- counting -------------------------------------------------------------------------------------

    @property
    def counters(self) -> StoreCounters:
        """The counters, with the uses that kernels counted on the device folded in (a sync when mapped)."""
        if self._device_counts is not None and self._counting:
            self._device_counts.fold_into(self._counters, self.layout.nbytes)
        return self._counters

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Layer steps run inside are not counted (a graph's warm-up and capture runs)."""
        self.counters  # noqa: B018 (what the device counted before is kept)
        self._counting = False
        try:
            yield
        finally:
            self._counting = True
            if self._device_counts is not None:
                # the runs inside counted on the device too: dropped
                self._device_counts.take()

    def count_step(self, layer: int, ids: torch.Tensor) -> None:
        """Count a step of `layer` whose experts (ids: [T, K]) the kernels reached without the host: on the
        device when mapped (graphs replay the count), else all as device hits on the host."""
        if self._device_counts is not None:
            self._device_counts.add(layer, ids)
        else:
            self.count_resident((layer,), ids.numel())

    def count_resident(self, layers: Iterable[int], uses: int) -> None:
        """Count a step of each of `layers` whose `uses` were all on the device (an all-resident graph replay;
        mapped runs count on the device). Uses are (token, expert) pairs: at decode (one token) the distinct
        experts load_waves counts."""
        if not self._counting or self._device_counts is not None:
            return
        for layer in layers:
            self._counters.add_layer(layer, uses, uses, 0)
            self._counters.gpu_hits += uses

    # -- the end --------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait for every job in flight (raising the first error)."""
        self.io.sync()

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        if self.io is not None:
            self.io.close()
        if self.cache is not None:
            # a shared RAM tier is its owner's to free
            if self.shares is None:
                self.cache.close()
            self.cache = None
        # the record memory goes back now, not when the store is collected: the process may go on
        n = self.gpu.shape[1]
        self.gpu = self.gpu.new_empty((0, n))
        self.ram = torch.empty((0, n), dtype=torch.uint8)

    def residency(self) -> np.ndarray:
        """[layers, experts] int8: 2 on the device, 1 in RAM only, 0 on the SSD only (for tests and stats)."""
        a = self.manifest.args
        out = np.zeros((a.n_blocks, a.n_routed_experts), dtype=np.int8)
        for layer, e in self.ram_pool.slot_of:
            out[layer, e] = 1
        for layer, e in self.gpu_pool.slot_of:
            out[layer, e] = 2
        return out
