"""The expert store: routed-expert records in three tiers under byte budgets.

  device slots  records in their FP4 form, one fixed-size slot each, and a device-side
                (layer, expert) -> slot table that kernels can read without asking the host
  RAM cache     page-aligned (pinned on CUDA) record slots; reads from the SSD land here directly
  SSD           O_DIRECT reads by a thread pool, several in flight, checksummed on first read

When device and RAM hold every record the run uses, `map_all` places them once (hottest on the device) and
kernels read RAM's in place over PCIe (zero-copy): nothing moves, no layer asks the host, graphs capture.

Only the main thread touches the bookkeeping (two SlotPools); worker threads read and upload. A slot
with a job in flight is pinned until the job and its copy event complete, and a device slot is only
refilled after the compute that last read it (the copy stream waits on that event, on the device).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dsfp4.errors import ChecksumError, ConfigError
from dsfp4.kernels.moe.ref import record_offsets
from dsfp4.layout.direct_io import RecordFile, aligned_buffer
from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import record_sha256
from dsfp4.runtime.plan.planner import Plan
from dsfp4.runtime.store.counters import StoreCounters
from dsfp4.runtime.store.policy import TIER_POLICIES
from dsfp4.runtime.store.slots import SlotPool
from dsfp4.runtime.store.use_counts import DeviceUseCounts

Key = tuple[int, int]  # (layer, expert)
RUN_RECORDS = 4  # records per read ahead: streams, yet runs in parallel (fastest of 1, 4, 16: BENCHMARKS.md)


def _done(job: Future) -> bool:
    if not job.done() or job.exception() is not None:
        return job.done()
    return job.result() is None or job.result().query()  # and its copy event, if any, has passed


def _unregister(host: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def _finished(value: object) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


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
    ):
        self.dir, self.manifest, self.device, self.plan = Path(model_dir), manifest, device, plan
        self.layout = manifest.record
        self.verify, self._counters = verify, StoreCounters()
        n = self.layout.nbytes if self.layout else 0
        gpu_policy, ram_policy = TIER_POLICIES[policy]
        self.gpu_pool, self.ram_pool = SlotPool(plan.gpu_slots, gpu_policy), SlotPool(plan.ram_slots, ram_policy)
        self.gpu = torch.empty((plan.gpu_slots, n), dtype=torch.uint8, device=device)  # [slots, record]
        self._host = aligned_buffer(plan.ram_slots * n)
        self.ram_np = self._host.reshape(plan.ram_slots, n)
        self.ram = torch.from_numpy(self.ram_np)  # [slots, record]
        self.cuda = device.type == "cuda"
        self._unpin = None
        if self.cuda and self.ram.numel():
            err = torch.cuda.cudart().cudaHostRegister(self.ram.data_ptr(), self.ram.numel(), 0)
            if int(err) != 0:
                raise ConfigError(
                    f"cannot pin {self.ram.numel()} bytes of RAM for the record cache (CUDA error {int(err)}); "
                    f"lower --cpu-mem"
                )
            # unregistered when closed or collected, before the buffer can be unmapped and its addresses reused
            self._unpin = weakref.finalize(self, _unregister, self.ram)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        a = manifest.args
        self._table = torch.full((a.n_blocks, a.n_routed_experts), -1, dtype=torch.int32, device=device)
        self._table_updates: dict[Key, int] = {}
        self._offsets: torch.Tensor | None = None  # record_offsets of the whole table, refreshed in place
        self._offsets_stale = True  # graphs captured the tensor's address: its contents change, never it
        self.mapped = False  # map_all: every record on the device or read from pinned RAM in place
        self._host_slots: torch.Tensor | None = None  # [blocks, experts] RAM slot of records read in place
        self._device_counts: DeviceUseCounts | None = None  # uses counted by kernels, when mapped
        self.files = {layer: RecordFile(self.dir / ef.file) for layer, ef in manifest.experts.items()}
        self.notes = [
            f"{self.dir / 'experts'}: the filesystem refuses O_DIRECT (tmpfs?); records are read through "
            f"the page cache, and dropped from it after each read"
        ][: any(not f.direct for f in self.files.values())]
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="dsfp4-io")
        # uploads wait for their read; on a thread of their own they never queue behind later reads
        self.uploads = ThreadPoolExecutor(1, thread_name_prefix="dsfp4-upload")
        self.gpu_jobs: dict[int, list[Future]] = {}  # slot -> jobs filling it
        self.ram_jobs: dict[int, list[Future]] = {}  # slot -> jobs writing or reading it
        self.released: list[torch.cuda.Event | None] = [None] * plan.gpu_slots
        self._verified: set[Key] = set()
        self._predicted: dict[int, set[int]] = {}
        self._counting = True

    # -- worker side --------------------------------------------------------------------------------

    def _read_run(self, run: list[tuple[Key, int]]) -> None:
        """Read adjacent records of one layer file into their RAM slots, in one sequential read."""
        (layer, first), _ = run[0]
        ef = self.manifest.experts[layer]
        t0 = time.perf_counter()
        self.files[layer].read_into([self.ram_np[rslot] for _, rslot in run], ef.offsets[first])
        for key, rslot in run:
            if self.verify and key not in self._verified:
                if record_sha256(self.ram_np[rslot]) != ef.sha256[key[1]]:
                    raise ChecksumError(
                        f"{self.dir / ef.file}: the record of expert {key[1]} (layer {layer}) fails its sha256 "
                        f"check; run `dsfp4 verify` and convert again"
                    )
                self._verified.add(key)
        self._counters.add_read(len(run) * self.layout.nbytes, time.perf_counter() - t0)

    def _upload(self, gslot: int, rslot: int, after: Future | None, released: object) -> torch.cuda.Event | None:
        if after is not None:
            after.result()  # the read of this record
        if not self.cuda:
            self.gpu[gslot].copy_(self.ram[rslot])
            return None
        with torch.cuda.stream(self.copy_stream):
            if released is not None:
                self.copy_stream.wait_event(released)  # compute has finished reading the old record
            self.gpu[gslot].copy_(self.ram[rslot], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return event

    # -- bookkeeping (main thread) ------------------------------------------------------------------

    def _track(self, jobs: dict[int, list[Future]], pool: SlotPool, slot: int, job: Future) -> None:
        jobs.setdefault(slot, []).append(job)
        pool.pin(slot)

    def _retire(self) -> None:
        for jobs, pool in ((self.gpu_jobs, self.gpu_pool), (self.ram_jobs, self.ram_pool)):
            for slot in list(jobs):
                left = [j for j in jobs[slot] if not _done(j)]
                for _ in range(len(jobs[slot]) - len(left)):
                    pool.unpin(slot)
                if any(j.done() and j.exception() for j in jobs[slot]) and pool.key_of[slot] is not None:
                    if pool is self.gpu_pool:
                        self._table_updates[pool.key_of[slot]] = -1
                    pool.drop(pool.key_of[slot])  # a failed load leaves nothing behind (the error is raised)
                if left:
                    jobs[slot] = left
                else:
                    del jobs[slot]

    def _wait_any(self) -> None:
        """Block until the oldest job in flight completes (a demand load needs its slot)."""
        jobs = [j for js in (*self.gpu_jobs.values(), *self.ram_jobs.values()) for j in js]
        if not jobs:
            raise ConfigError("every expert slot is held by the current layer; raise --gpu-mem or --cpu-mem")
        t0 = time.perf_counter()
        event = jobs[0].result()
        if event is not None:
            event.synchronize()
        self._counters.stall_s += time.perf_counter() - t0
        self._retire()

    def _allocate(self, pool: SlotPool, key: Key, protected: set[Key], wait: bool) -> int | None:
        while True:
            got = pool.allocate(key, protected)
            if got is not None:
                slot, evicted = got
                if pool is self.gpu_pool:
                    self._table_updates[key] = slot
                    if evicted is not None:
                        self._table_updates[evicted] = -1
                return slot
            if not wait:
                return None
            self._wait_any()

    def _submit_read(self, run: list[tuple[Key, int]]) -> Future | None:
        if not run:
            return None
        read = self.pool.submit(self._read_run, run)
        for _, rslot in run:
            self._track(self.ram_jobs, self.ram_pool, rslot, read)
        self._counters.ssd_reads += len(run)
        return read

    def _to_ram(self, key: Key, protected: set[Key], wait: bool) -> tuple[int, Future | None] | None:
        """The record's RAM slot, reading it from the SSD if it is not there: (slot, the read still in
        flight or None), or None when no slot is free and `wait` is False."""
        rslot = self.ram_pool.slot_of.get(key)
        if rslot is not None:
            return rslot, next(iter(self.ram_jobs.get(rslot, ())), None)  # a prefetch may still be reading it
        rslot = self._allocate(self.ram_pool, key, protected, wait)
        if rslot is None:
            return None
        return rslot, self._submit_read([(key, rslot)])

    def file_position(self, key: Key) -> tuple[int, int]:
        """(layer, offset in its file): sorting keys by it gives the order of a sequential read."""
        return self.manifest.file_position(key)

    def read_ahead(self, keys: Iterable[Key], protected: set[Key]) -> None:
        """Start reading the records of `keys` that are not in RAM from the SSD, in file order, adjacent
        records in one read (runs of RUN_RECORDS); waits only when no RAM slot is free. Never evicts one
        of `keys` or of `protected`."""
        self._retire()
        keys = sorted(keys, key=self.file_position)
        protected = protected | set(keys)
        run: list[tuple[Key, int]] = []
        for key in keys:
            if key in self.ram_pool:
                continue
            rslot = self._allocate(self.ram_pool, key, protected, wait=False)
            if rslot is None:  # the run so far must be in flight before waiting for a slot
                self._submit_read(run)
                run = []
                rslot = self._allocate(self.ram_pool, key, protected, wait=True)
            if run and (len(run) == RUN_RECORDS or self.file_position(key) != self._next_position(run[-1][0])):
                self._submit_read(run)
                run = []
            run.append((key, rslot))
        self._submit_read(run)

    def _next_position(self, key: Key) -> tuple[int, int]:
        layer, offset = self.file_position(key)
        return layer, offset + self.layout.nbytes

    def _start(self, key: Key, protected: set[Key], wait: bool) -> Future | None:
        """Begin moving a record that is not on the device there: (SSD ->) RAM -> device. Returns the job
        whose result is the copy's event, or None when no slot is free and `wait` is False."""
        got = self._to_ram(key, set(), wait)  # RAM copies in use are pinned; the device's are protected
        if got is None:
            return None
        rslot, read = got
        gslot = self._allocate(self.gpu_pool, key, protected, wait)
        if gslot is None:
            return None  # prefetch: the record stays in RAM
        released = self.released[gslot]
        if read is None or read.done():
            job = _finished(self._upload(gslot, rslot, read, released))
        else:
            job = self.uploads.submit(self._upload, gslot, rslot, read, released)
        self._track(self.gpu_jobs, self.gpu_pool, gslot, job)
        self._track(self.ram_jobs, self.ram_pool, rslot, job)
        self._counters.h2d_bytes += self.layout.nbytes
        return job

    def slot_table(self) -> torch.Tensor:
        """[blocks, experts] int32 on the device: each expert's slot, -1 when it is not there. Updated
        only when asked (for kernels that look experts up on the device), so the layer loop pays nothing."""
        if self._table_updates:
            rows = torch.tensor([(lay, e, s) for (lay, e), s in self._table_updates.items()])  # [n, 3]
            if self.cuda:  # pinned and non-blocking: a pageable copy would wait for the compute stream
                rows = rows.pin_memory().to(self.device, non_blocking=True)
            self._table[rows[:, 0], rows[:, 1]] = rows[:, 2].to(torch.int32)
            self._table_updates, self._offsets_stale = {}, True
        return self._table

    # -- the interface the model uses ---------------------------------------------------------------

    def load_waves(
        self, layer: int, experts: list[int], prefetch: tuple[int, list[int]] | None = None
    ) -> Iterator[list[int]]:
        """Yield `experts` in waves of at most the device slot count (a long prompt's layer may use more
        experts than fit): those on the device first, then those in RAM, then the SSD's. When a wave is
        yielded its records are on the device for compute queued on the current stream (copies are
        waited for there, not on the host); their slots are refilled only after the compute queued
        before the next wave (or the end). `prefetch` (next layer, predicted experts) starts once this
        layer's own loads are queued."""
        assert not self.mapped, "a mapped store moves nothing: its layers read records where they are"
        self._score_prediction(layer, experts)
        tier = {e: 0 if (layer, e) in self.gpu_pool else 1 if (layer, e) in self.ram_pool else 2 for e in experts}
        tiers = list(tier.values())
        self._counters.add_layer(layer, len(experts), tiers.count(0), tiers.count(1))
        order = sorted(experts, key=tier.__getitem__)
        for start in range(0, len(order), self.plan.gpu_slots):
            wave = order[start : start + self.plan.gpu_slots]
            protected = {(layer, e) for e in wave}
            self._retire()  # once per wave: a blocked allocation retires again in _wait_any
            jobs = []
            for e in wave:
                key = (layer, e)
                gslot = self.gpu_pool.lookup(key)
                self.ram_pool.lookup(key)  # inclusive tiers: the RAM copy stays as warm as the device one
                if gslot is not None:
                    self._counters.gpu_hits += 1
                    filling = self.gpu_jobs.get(gslot)  # a prefetch may still be filling it
                    if filling:
                        jobs.append(filling[-1])
                    continue
                in_ram = key in self.ram_pool
                self._counters.ram_hits += in_ram
                self._counters.ssd_misses += not in_ram
                jobs.append(self._start(key, protected, wait=True))
            if prefetch is not None and start == 0:
                self.prefetch(*prefetch, protect={(layer, e) for e in experts})
            self._await(jobs)
            yield wave
            if self.cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                for e in wave:
                    self.released[self.gpu_pool.slot_of[(layer, e)]] = event

    def _await(self, jobs: list[Future]) -> None:
        """Make the current stream wait for these loads (the host only waits for them to be queued)."""
        for job in jobs:
            t0 = time.perf_counter()
            try:
                event = job.result()  # the SSD read and the copy are queued (or a checksum error)
            except BaseException:
                wait(jobs)  # the wave's other jobs may share the failed read: all end, then every failure is forgotten
                self._retire()
                raise
            self._counters.stall_s += time.perf_counter() - t0
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)  # on the device, not the host

    def load(
        self, layer: int, experts: list[int], prefetch: tuple[int, list[int]] | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """load_waves, one (expert, record on the device) at a time."""
        for wave in self.load_waves(layer, experts, prefetch):
            for e in wave:
                yield e, self.gpu[self.gpu_pool.slot_of[(layer, e)]]

    def offsets(self, layer: int, wave: list[int] | None = None) -> torch.Tensor:
        """[experts] int64 on the device: each expert's record offset from the device pool (kernels/moe/kernel.py),
        into pinned RAM when mapped there, -1 when not there; with `wave`, every other expert is left out
        (-1) too."""
        table = self.slot_table()
        if wave is not None:
            keep = torch.zeros_like(table[layer], dtype=torch.bool)
            keep[torch.tensor(wave, device=self.device)] = True
            return record_offsets(torch.where(keep, table[layer], -1), self.gpu)
        if self._offsets_stale:  # every layer's at once, until a slot changes: once, when nothing moves
            host = () if self._host_slots is None else (self._host_slots, self.ram)
            fresh = record_offsets(table, self.gpu, *host)  # [blocks, experts]
            self._offsets = fresh if self._offsets is None else self._offsets.copy_(fresh)
            self._offsets_stale = False
        return self._offsets[layer]

    def prefetch(self, layer: int, experts: list[int], protect: set[Key]) -> None:
        """Start moving predicted experts of `layer` towards the device without waiting and without
        evicting anything in `protect` (the current layer's experts) or in flight."""
        self._predicted[layer] = set(experts)
        self._retire()
        for e in experts:
            key = (layer, e)
            if key in self.gpu_pool:
                continue
            if self._start(key, protect, wait=False) is not None:
                self._counters.prefetch_loads += 1

    def _score_prediction(self, layer: int, experts: list[int]) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self._counters.add_prediction(len(predicted), len(set(experts)), len(predicted & set(experts)))

    def warm_start(self, profile: HotProfile) -> None:
        """Hottest records to the device slots, the next ones to RAM. Each layer's share is read in file
        order, adjacent records together: after a hot-first repack, the hot prefix of every layer is read
        sequentially (its device part, then its RAM part, which follows it in the file)."""
        self._preload([k for k in profile.ranked() if k[0] in self.plan.expert_layers])

    def fill(self) -> None:
        """Every record of the used layers onto the device (the plan's slots hold them all): from then on
        the MoE layers find every expert on the device and never wait for the host."""
        n = self.manifest.args.n_routed_experts
        assert self.plan.gpu_slots >= self.plan.total_records, "fill() needs a device slot per record"
        self._preload([(layer, e) for layer in self.plan.expert_layers for e in range(n)])

    def map_all(self, ranked: list[Key]) -> None:
        """Place every record of the used layers once: the first gpu_slots of `ranked` (every used record,
        hottest first) in device slots, the others in the pinned RAM cache, where the kernels read them in
        place over PCIe (zero-copy: as many bytes as a copy, without the copy's wait or a slot). From then
        on nothing moves, MoE layers never ask the host, and their uses are counted on the device."""
        p, n = self.plan, self.manifest.args.n_routed_experts
        used = [(layer, e) for layer in sorted(p.expert_layers) for e in range(n)]
        assert sorted(ranked) == used, "map_all() ranks every used record once"
        assert p.gpu_slots + p.ram_slots >= p.total_records, "map_all() needs a device or RAM slot per record"
        self._preload(ranked)
        tier = self.residency()  # [blocks, experts]: 2 on the device, 1 in RAM only
        host = torch.full(tier.shape, -1, dtype=torch.int32)  # the RAM slots of the records read in place
        for (layer, e), rslot in self.ram_pool.slot_of.items():
            host[layer, e] = rslot if tier[layer, e] == 1 else -1
        assert int((tier > 0).sum()) == p.total_records, "a record found no slot"
        self._host_slots, self._device_counts = host.to(self.device), DeviceUseCounts(tier == 2, self.device)
        self._offsets_stale, self.mapped = True, True

    def _preload(self, ranked: list[Key]) -> None:
        t0 = time.perf_counter()
        n_gpu = self.plan.gpu_slots
        to_gpu, to_ram = ranked[:n_gpu], ranked[n_gpu : n_gpu + self.plan.ram_slots]
        for layer in sorted({layer for layer, _ in to_gpu}):
            keys = sorted((k for k in to_gpu if k[0] == layer), key=self.file_position)
            for i in range(0, len(keys), self.plan.ram_slots):  # through RAM, as much at once as it holds
                self.read_ahead(keys[i : i + self.plan.ram_slots], set())
                for key in keys[i : i + self.plan.ram_slots]:
                    self._start(key, set(), wait=True)
        self.sync()  # the device part's RAM copies become evictable, so the RAM part reads without a break
        self.read_ahead(to_ram, set())
        self.sync()
        self._counters.warm_records = len(to_gpu) + len(to_ram)
        self._counters.warm_s = time.perf_counter() - t0

    @property
    def all_resident(self) -> bool:
        """Every record the run uses sits on the device, none in flight (nothing can be evicted then)."""
        return len(self.gpu_pool.slot_of) == self.plan.total_records > 0 and not self.gpu_jobs

    @property
    def visible(self) -> bool:
        """The kernels reach every record the run uses without the host: all resident, or mapped."""
        return self.mapped or self.all_resident

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
                self._device_counts.take()  # the runs inside counted on the device too: dropped

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

    def sync(self) -> None:
        """Wait for every job in flight (raising the first error)."""
        while self.gpu_jobs or self.ram_jobs:
            self._wait_any()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.uploads.shutdown(wait=True, cancel_futures=True)  # an upload whose read was cancelled ends too
        for f in self.files.values():
            f.close()
        self.files = {}
        if self.cuda:
            self.copy_stream.synchronize()  # no copy may still read the RAM cache once it is unpinned
        if self._unpin is not None:
            self._unpin()
        # the record memory goes back now, not when the store is collected: the process may go on
        n = self.gpu.shape[1]
        self.gpu = self.gpu.new_empty((0, n))
        self.ram_np = np.empty((0, n), dtype=np.uint8)
        self.ram, self._host = torch.from_numpy(self.ram_np), self.ram_np.reshape(-1)

    def residency(self) -> np.ndarray:
        """[layers, experts] int8: 2 on the device, 1 in RAM only, 0 on the SSD only (for tests and stats)."""
        a = self.manifest.args
        out = np.zeros((a.n_blocks, a.n_routed_experts), dtype=np.int8)
        for layer, e in self.ram_pool.slot_of:
            out[layer, e] = 1
        for layer, e in self.gpu_pool.slot_of:
            out[layer, e] = 2
        return out
