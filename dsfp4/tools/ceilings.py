"""Measurements of this machine's data-movement ceilings: HBM read, host->GPU copies (pinned and pageable),
sequential and random-record reads from a disk (O_DIRECT where the filesystem allows it), and scratch
writes. `dsfp4 doctor` and the benchmark scripts report every speed against these (docs/BENCHMARKS.md).
All speeds are GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from dsfp4.layout.direct_io import DIRECT_ALIGN, aligned_buffer, open_direct
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import align_up
from dsfp4.runtime.plan.probes import h2d_gbps


def hbm_read_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """torch's sum over `nbytes` of fp32 on the device, `reps` times (a plain streaming read)."""
    x = torch.ones(nbytes // 4, device=device)
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        x.sum()
    torch.cuda.synchronize(device)
    return reps * nbytes / (time.perf_counter() - t) / 1e9


def direct_io_allowed(path: Path) -> bool:
    fd, direct = open_direct(path, os.O_RDONLY)
    os.close(fd)
    return direct


def _read_jobs(jobs: Iterator[tuple[Path, int]], chunk: int, threads: int) -> float:
    """Read `chunk` bytes at each (path, offset) with `threads` reads in flight -> GB/s."""
    lock, fds, done = threading.Lock(), {}, [0] * threads
    jobs = list(jobs)
    for p, _ in jobs:
        if p not in fds:
            fds[p] = open_direct(p, os.O_RDONLY)[0]
    it = iter(jobs)

    def worker(i: int) -> None:
        buf = memoryview(aligned_buffer(chunk))
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            fd = fds[job[0]]
            done[i] += os.preadv(fd, [buf], job[1])
            # a buffered read must not be re-served
            os.posix_fadvise(fd, job[1], chunk, os.POSIX_FADV_DONTNEED)

    t = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return sum(done) / seconds / 1e9


def sequential_read_gbps(paths: list[Path], threads: int = 8, chunk: int = 32 << 20, limit: int = 4 << 30) -> float:
    """The files read once in order (at most `limit` bytes), `chunk` bytes per read, `threads` in flight."""

    def jobs() -> Iterator[tuple[Path, int]]:
        left = limit
        for p in paths:
            # the last read may come back short
            for pos in range(0, p.stat().st_size, chunk):
                if left <= 0:
                    return
                left -= chunk
                yield p, pos

    return _read_jobs(jobs(), chunk, threads)


def random_read_gbps(paths: list[Path], record: int, count: int = 48, threads: int = 4, seed: int = 0) -> float:
    """`count` record-sized reads at random aligned offsets of the files, `threads` in flight: how the
    expert store reads demand misses."""
    record = align_up(record, DIRECT_ALIGN)
    spots = [(p, pos) for p in paths for pos in range(0, p.stat().st_size - record + 1, DIRECT_ALIGN * 64)]
    rng = random.Random(seed)
    return _read_jobs((rng.choice(spots) for _ in range(count)), record, threads)


# the store's reads (runtime/store/expert_store.py): single records or runs of RUN_RECORDS adjacent ones, with
# io_threads (default 4) reads in flight; the sweep takes the best of these and of deeper queues
STORE_RUNS, STORE_DEPTHS = (1, 4), (4, 8, 16)
# read per configuration
STORE_SWEEP_BYTES = 512 << 20


def store_read_gbps(paths: list[Path], record: int, seed: int = 0) -> float:
    """The disk as the expert store reads it: runs of 1 or 4 adjacent records at random record-aligned offsets,
    4 to 16 reads in flight; the best of the sweep. A bench's efficiency is taken against it too, so the store
    cannot read faster than its ceiling."""
    record = align_up(record, DIRECT_ALIGN)
    best = 0.0
    for run in STORE_RUNS:
        chunk = run * record
        spots = [(p, pos) for p in paths for pos in range(0, p.stat().st_size - chunk + 1, record)]
        if not spots:
            continue
        rng = random.Random(seed)
        count = max(STORE_SWEEP_BYTES // chunk, 2)
        for depth in STORE_DEPTHS:
            best = max(best, _read_jobs((rng.choice(spots) for _ in range(count)), chunk, depth))
    return best


def write_scratch(path: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Write a scratch file of nbytes (O_DIRECT where allowed), fsync it -> GB/s. The caller deletes it."""
    chunk = min(chunk, nbytes)
    buf = memoryview(aligned_buffer(chunk))
    buf[:] = os.urandom(chunk)
    fd, _ = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        t = time.perf_counter()
        for pos in range(0, nbytes, chunk):
            os.pwritev(fd, [buf], pos)
        os.fsync(fd)
        return nbytes / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def cpu_isa() -> list[str]:
    """The vector extensions a CPU kernel could use, from /proc/cpuinfo (x86 flags or ARM features)."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "sve")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.split(":", 1)[1].split())
            return [f for f in wanted if f in have]
    return []


# The ceilings every benchmark reports beside its numbers (docs/BENCHMARKS.md), measured the way the entries
# there were: HBM read over 2 GiB, pinned host->GPU in 256 MiB copies, O_DIRECT reads and writes of given files.


def gpu_ceilings() -> dict:
    """HBM read (torch sum over 2 GiB) and pinned host->GPU (256 MiB copies), GB/s; {} without CUDA."""
    if not torch.cuda.is_available():
        return {}
    dev = torch.device("cuda")
    return {
        "gpu": torch.cuda.get_device_name(),
        "hbm_read_gbps": hbm_read_gbps(dev, 2 << 30),
        "pinned_h2d_gbps": h2d_gbps(dev, 256 << 20, total=10 * (256 << 20)),
    }


def odirect_read_gbps(paths: list[Path], threads: int = 1, chunk: int = 16 << 20) -> float:
    """Read the files once with O_DIRECT, in order, `chunk` bytes per read, `threads` reads in flight."""
    return sequential_read_gbps(paths, threads, chunk, limit=1 << 62)


def odirect_write_gbps(folder: Path, nbytes: int = 4 << 30, chunk: int = 64 << 20) -> float:
    """Write a scratch file of nbytes with O_DIRECT, `chunk` bytes per write, then fsync and delete it."""
    path = Path(folder) / ".dsfp4-write-ceiling.tmp"
    try:
        return write_scratch(path, nbytes, chunk)
    finally:
        path.unlink(missing_ok=True)


def model_ceilings(manifest_dir: Path, manifest: Manifest) -> dict[str, float]:
    """HBM read, pinned host -> GPU copy, O_DIRECT read of the expert files (best of a few depths), GB/s."""
    gpu = gpu_ceilings()
    files = [manifest_dir / ef.file for ef in manifest.experts.values()]
    best = max(
        odirect_read_gbps(files, threads, chunk) for threads, chunk in ((4, 32 << 20), (8, 32 << 20), (16, 8 << 20))
    )
    return {"hbm_gb_s": gpu["hbm_read_gbps"], "h2d_gb_s": gpu["pinned_h2d_gbps"], "odirect_gb_s": best}
