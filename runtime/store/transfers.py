"""The worker side of the expert store: SSD reads into RAM slots on a thread pool (adjacent records of a layer
file in one read, each record checksummed on its first read), uploads of RAM slots to device slots on a copy
stream of their own, and the jobs in flight.

Only the main thread touches the bookkeeping; workers read and upload. A slot with a job in flight is pinned in its
pool until the job and its copy event complete, and a device slot is refilled only after the compute that last read
it (the copy stream waits on that event, on the device). A cold record (layout/cold.py) moves as it is stored, fewer
bytes from the SSD and over PCIe, into a device staging buffer, and is widened from there into its slot
(kernels/fp4/widen.py), so the kernels only ever read records of the model's format.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from dsfp4.errors import ChecksumError, ConfigError
from dsfp4.kernels.fp4.widen import widen_record
from dsfp4.layout.cold import cold_luts
from dsfp4.layout.direct_io import RecordFile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import RecordLayout, record_sha256
from dsfp4.runtime.store.counters import StoreCounters
from dsfp4.runtime.store.device_table import DeviceTable
from dsfp4.runtime.store.ram_cache import RamCache
from dsfp4.runtime.store.slots import SlotPool

# (layer, expert)
Key = tuple[int, int]


def _done(job: Future) -> bool:
    if not job.done() or job.exception() is not None:
        return job.done()
    # and its copy event, if any, has passed
    return job.result() is None or job.result().query()


def _run_now(fn: Callable[..., object], *args: object) -> Future:
    """fn(*args) on this thread, as a finished job: its result, or its error for whoever awaits the job (a read that
    already failed must not escape half-way through the bookkeeping: retire then forgets the slots it claimed)."""
    f: Future = Future()
    try:
        f.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 (re-raised where the job is awaited)
        f.set_exception(e)
    return f


class Transfers:
    """Reads and uploads of one store: `gpu` [slots, record] and `cache` (the RAM slots) are its tiers' bytes, the
    pools and the device table its bookkeeping."""

    def __init__(
        self,
        model_dir: Path,
        manifest: Manifest,
        tiers: tuple[torch.Tensor, RamCache],
        pools: tuple[SlotPool, SlotPool],
        table: DeviceTable,
        counters: StoreCounters,
        io_threads: int,
        verify: bool,
        share: Transfers | None = None,
    ):
        """`share`: the transfers whose SSD readers and files these use (a split run's cards share the RAM tier and
        the SSD, each card its uploads and copy stream: split_store.py); they join its group."""
        self.dir, self.manifest, self.table, self.counters, self.verify = model_dir, manifest, table, counters, verify
        self.gpu, self.cache = tiers
        self.gpu_pool, self.ram_pool = pools
        self.cuda = self.gpu.device.type == "cuda"
        # on CUDA one staging buffer, for the largest cold record: uploads queue on one stream, one at a time (_stage)
        if cold := manifest.cold_nbytes():
            self.staging = torch.empty(cold, dtype=torch.uint8, device=self.gpu.device) if self.cuda else None
            self.luts = cold_luts(self.gpu.device)
            self._stage = threading.Lock()
        self.copy_stream = torch.cuda.Stream(self.gpu.device) if self.cuda else None
        self.owns = share is None
        if self.owns:
            self.files = {layer: RecordFile(model_dir / ef.file) for layer, ef in manifest.experts.items()}
            self.reads = ThreadPoolExecutor(io_threads, thread_name_prefix="dsfp4-io")
        else:
            self.files, self.reads = share.files, share.reads
        # every card's transfers over the same RAM slots: their finished jobs unpin slots this one may need
        self.group: list[Transfers] = [self] if share is None else share.group
        if share is not None:
            self.group.append(self)
        # uploads wait for their read; on a thread of their own they never queue behind later reads
        self.uploads = ThreadPoolExecutor(1, thread_name_prefix="dsfp4-upload")
        # slot -> jobs filling it
        self.gpu_jobs: dict[int, list[Future]] = {}
        # slot -> jobs writing or reading it
        self.ram_jobs: dict[int, list[Future]] = {}
        self.released: list[torch.cuda.Event | None] = [None] * len(self.gpu_pool.key_of)
        self._verified: set[Key] = set()

    @property
    def direct(self) -> bool:
        """Every layer file is read with O_DIRECT (tmpfs, for one, refuses it)."""
        return all(f.direct for f in self.files.values())

    # -- worker threads -------------------------------------------------------------------------------

    def _read_run(self, run: list[tuple[Key, int]]) -> None:
        """Read adjacent records of one layer file into their RAM slots, in one sequential read."""
        (layer, first), _ = run[0]
        ef = self.manifest.experts[layer]
        t0 = time.perf_counter()
        records = [self.cache.row(rslot)[: self.manifest.layout_of(key).nbytes] for key, rslot in run]
        self.files[layer].read_into(records, ef.offsets[first])
        for (key, _), record in zip(run, records, strict=True):
            if self.verify and key not in self._verified:
                if record_sha256(record) != ef.sha256[key[1]]:
                    raise ChecksumError(
                        f"{self.dir / ef.file}: the record of expert {key[1]} (layer {layer}) fails its sha256 "
                        f"check; run `dsfp4 verify` and convert again"
                    )
                self._verified.add(key)
        self.counters.add_read(sum(r.nbytes for r in records), time.perf_counter() - t0)

    def _copy(self, gslot: int, rslot: int, layout: RecordLayout) -> None:
        """RAM slot -> device slot on the current stream; a cold record through the staging buffer, widened."""
        if not layout.cold:
            self.gpu[gslot].copy_(self.cache.tensor(rslot), non_blocking=True)
            return
        # the copy and its widening queue together: another upload's copy would overwrite
        with self._stage:
            src = self.cache.tensor(rslot)
            if self.cuda:
                src = self.staging[: layout.nbytes].copy_(src[: layout.nbytes], non_blocking=True)
            widen_record(src, self.gpu[gslot], layout, self.luts)

    def _upload(
        self, gslot: int, rslot: int, layout: RecordLayout, after: Future | None, released: object
    ) -> torch.cuda.Event | None:
        if after is not None:
            # the read of this record
            after.result()
        if not self.cuda:
            self._copy(gslot, rslot, layout)
            return None
        with torch.cuda.stream(self.copy_stream):
            if released is not None:
                # compute has finished reading the old record
                self.copy_stream.wait_event(released)
            self._copy(gslot, rslot, layout)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return event

    # -- bookkeeping (main thread) --------------------------------------------------------------------

    def _track(self, jobs: dict[int, list[Future]], pool: SlotPool, slot: int, job: Future) -> None:
        jobs.setdefault(slot, []).append(job)
        pool.pin(slot)

    def read(self, run: list[tuple[Key, int]]) -> Future | None:
        """Start reading a run of adjacent records (key, RAM slot) from the SSD; their slots stay pinned until
        it completes."""
        if not run:
            return None
        job = self.reads.submit(self._read_run, run)
        for _, rslot in run:
            self._track(self.ram_jobs, self.ram_pool, rslot, job)
        self.counters.ssd_reads += len(run)
        return job

    def upload(self, key: Key, gslot: int, rslot: int, read: Future | None) -> Future:
        """Start copying the record of key from RAM slot rslot to device slot gslot once `read` (its SSD read, if
        still in flight) is done; the job's result is the copy's event."""
        released, layout = self.released[gslot], self.manifest.layout_of(key)
        if read is None or read.done():
            job = _run_now(self._upload, gslot, rslot, layout, read, released)
        else:
            job = self.uploads.submit(self._upload, gslot, rslot, layout, read, released)
        self._track(self.gpu_jobs, self.gpu_pool, gslot, job)
        self._track(self.ram_jobs, self.ram_pool, rslot, job)
        self.counters.h2d_bytes += layout.nbytes
        return job

    def reading(self, rslot: int) -> Future | None:
        """A job still writing or reading RAM slot rslot (a prefetch may still be reading the record)."""
        return next(iter(self.ram_jobs.get(rslot, ())), None)

    def filling(self, gslot: int) -> Future | None:
        """The last job filling device slot gslot, if one is in flight."""
        jobs = self.gpu_jobs.get(gslot)
        return jobs[-1] if jobs else None

    def release(self, gslots: list[int], event: torch.cuda.Event) -> None:
        """These device slots may be refilled only after `event` (the compute queued so far that reads them)."""
        for gslot in gslots:
            self.released[gslot] = event

    @property
    def busy(self) -> bool:
        return bool(self.gpu_jobs or self.ram_jobs)

    def retire(self) -> None:
        """Unpin the slots of completed jobs, the group's too (their RAM slots are this one's); a failed load leaves
        nothing behind (its error is raised where it is awaited)."""
        for t in self.group:
            t.retire_own()

    def retire_own(self) -> None:
        """retire for this one's jobs."""
        for jobs, pool in ((self.gpu_jobs, self.gpu_pool), (self.ram_jobs, self.ram_pool)):
            for slot in list(jobs):
                left = [j for j in jobs[slot] if not _done(j)]
                for _ in range(len(jobs[slot]) - len(left)):
                    pool.unpin(slot)
                if any(j.done() and j.exception() for j in jobs[slot]) and pool.key_of[slot] is not None:
                    if pool is self.gpu_pool:
                        self.table.set(pool.key_of[slot], -1)
                    pool.drop(pool.key_of[slot])
                if left:
                    jobs[slot] = left
                else:
                    del jobs[slot]

    def wait_any(self) -> None:
        """Block until the oldest job in flight completes (a demand load needs its slot)."""
        jobs = [j for t in self.group for js in (*t.gpu_jobs.values(), *t.ram_jobs.values()) for j in js]
        if not jobs:
            raise ConfigError("every expert slot is held by the current layer; raise --gpu-mem or --cpu-mem")
        t0 = time.perf_counter()
        event = jobs[0].result()
        if event is not None:
            event.synchronize()
        self.counters.stall_s += time.perf_counter() - t0
        self.retire()

    def wait_on_device(self, jobs: list[Future]) -> None:
        """Make the current stream wait for these loads (the host only waits for them to be queued)."""
        for job in jobs:
            t0 = time.perf_counter()
            try:
                # the SSD read and the copy are queued (or a checksum error)
                event = job.result()
            except BaseException:
                # the wave's other jobs may share the failed read: all end, then every failure is forgotten
                wait(jobs)
                self.retire()
                raise
            self.counters.stall_s += time.perf_counter() - t0
            if event is not None:
                # on the device, not the host
                torch.cuda.current_stream(self.gpu.device).wait_event(event)

    def sync(self) -> None:
        """Wait for every job in flight (raising the first error)."""
        while self.busy:
            self.wait_any()

    def close(self) -> None:
        """End the workers (an upload whose read was cancelled ends too) and close the files; no copy reads the RAM
        cache afterwards."""
        # the readers and files are the owner's, closed last (split_store.py closes its cards in reverse)
        if self.owns:
            self.reads.shutdown(wait=True, cancel_futures=True)
        self.uploads.shutdown(wait=True, cancel_futures=True)
        if self.owns:
            for f in self.files.values():
                f.close()
        self.files = {}
        if self.cuda:
            self.copy_stream.synchronize()
        # the store frees its tiers' memory now
        self.gpu = self.cache = None
