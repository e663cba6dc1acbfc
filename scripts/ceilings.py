"""The machine's ceilings that every benchmark reports beside its numbers (docs/BENCHMARKS.md): HBM read,
pinned host->GPU copy, O_DIRECT read of given files. Shared by bench_convert.py and bench_store.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from dsfp4.layout.direct_io import aligned_buffer


def gpu_ceilings() -> dict:
    """HBM read (torch sum over 2 GiB) and pinned host->GPU (256 MiB copies), GB/s; {} without CUDA."""
    if not torch.cuda.is_available():
        return {}
    dev = torch.device("cuda")
    x = torch.randn(1 << 29, device=dev)  # 2 GiB of fp32
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        x.sum()
    torch.cuda.synchronize()
    hbm = 10 * x.numel() * 4 / (time.perf_counter() - t) / 1e9
    del x
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    host.random_()
    gpu = torch.empty_like(host, device=dev)
    for _ in range(3):
        gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 10 * host.numel() / (time.perf_counter() - t) / 1e9
    return {"gpu": torch.cuda.get_device_name(), "hbm_read_gbps": hbm, "pinned_h2d_gbps": h2d}


def odirect_read_gbps(paths: list[Path], threads: int = 1, chunk: int = 16 << 20) -> float:
    """Read the files once with O_DIRECT, in order, `chunk` bytes per read, `threads` reads in flight."""
    jobs = iter([(p, pos) for p in paths for pos in range(0, p.stat().st_size, chunk)])
    lock, fds = threading.Lock(), {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}
    done = [0] * threads

    def worker(i: int) -> None:
        buf = memoryview(aligned_buffer(chunk))
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            done[i] += os.preadv(fds[job[0]], [buf], job[1])

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


def odirect_write_gbps(folder: Path, nbytes: int = 4 << 30, chunk: int = 64 << 20) -> float:
    """Write a scratch file of nbytes with O_DIRECT, `chunk` bytes per write, then fsync and delete it."""
    path = Path(folder) / ".dsfp4-write-ceiling.tmp"
    buf = memoryview(aligned_buffer(chunk))
    buf[:] = os.urandom(chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        t = time.perf_counter()
        for pos in range(0, nbytes, chunk):
            os.pwritev(fd, [buf], pos)
        os.fsync(fd)
        seconds = time.perf_counter() - t
    finally:
        os.close(fd)
        path.unlink()
    return nbytes / seconds / 1e9
