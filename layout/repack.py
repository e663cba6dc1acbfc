"""Hot-first repack: rewrite each layer file with its experts in hotness order, so that the warm start
reads the hot prefix of every layer in one sequential read.

Safe to interrupt, one layer at a time: the layer's new file is written under a new name and synced,
then manifest.json is replaced atomically to point at it, then the old file is removed. The manifest
always names complete files, so an interrupted repack leaves a model that loads (some layers in the new
order, the rest in the old) and gives the same tokens; running it again finishes the job and removes
what the interrupted run left behind. Record bytes and checksums never change, only file names and
offsets, so the conversion's identity (and hot.json) stay valid. Extra disk space: one layer file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsfp4.errors import ChecksumError, ConfigError, OutputError
from dsfp4.layout.atomic import fsync_dir, lock_folder
from dsfp4.layout.direct_io import RecordFile, aligned_buffer, open_direct
from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.manifest import ExpertFile, Manifest
from dsfp4.layout.record import record_sha256
from dsfp4.layout.safetensors_file import pwrite_all
from dsfp4.units import format_bytes

EXPERTS_DIR = "experts"
COPY_RECORDS = 8  # records per write while copying a layer
COPY_DEPTH = 4  # chunks read ahead of the writer (RAM: COPY_DEPTH x COPY_RECORDS records)


@dataclass(frozen=True)
class RepackReport:
    rewritten: int  # layer files written in the new order
    unchanged: int  # already in that order
    nbytes: int  # bytes copied
    seconds: float


def hot_file_name(ef: ExpertFile, order: list[int]) -> str:
    """experts/layer-NNN.<digest of the order>.bin: a new name per order, so a new file never replaces
    one the manifest still names."""
    stem = Path(ef.file).name.split(".")[0]
    digest = hashlib.sha256(",".join(map(str, order)).encode()).hexdigest()[:8]
    return f"{EXPERTS_DIR}/{stem}.{digest}.bin"


def _in_order(ef: ExpertFile, order: list[int], nbytes: int) -> bool:
    return all(ef.offsets[e] == i * nbytes for i, e in enumerate(order))


def _copy_layer(model_dir: Path, ef: ExpertFile, order: list[int], nbytes: int, dst: Path) -> None:
    """Write the layer's records to dst in `order`, checking each record's sha256 on the way. Reader
    threads run COPY_DEPTH chunks ahead of the writer, both with O_DIRECT where the filesystem allows."""
    src = RecordFile(model_dir / ef.file)
    fd, direct = open_direct(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    chunks = [order[i : i + COPY_RECORDS] for i in range(0, len(order), COPY_RECORDS)]
    bufs = [aligned_buffer(COPY_RECORDS * nbytes) for _ in range(min(COPY_DEPTH, len(chunks)))]

    def read(k: int) -> memoryview:
        buf = bufs[k % len(bufs)]
        for j, e in enumerate(chunks[k]):
            record = buf[j * nbytes : (j + 1) * nbytes]
            src.read_into([record], ef.offsets[e])
            if record_sha256(record) != ef.sha256[e]:
                raise ChecksumError(
                    f"{src.path}: the record of expert {e} fails its sha256 check; nothing was repacked "
                    f"past this layer (run `dsfp4 verify`, then convert again)"
                )
        return memoryview(buf)[: len(chunks[k]) * nbytes]

    try:
        with ThreadPoolExecutor(len(bufs)) as pool:
            pending = {k: pool.submit(read, k) for k in range(len(bufs))}
            for k in range(len(chunks)):
                pwrite_all(fd, pending.pop(k).result(), k * COPY_RECORDS * nbytes)
                if k + len(bufs) < len(chunks):  # its buffer is free again
                    pending[k + len(bufs)] = pool.submit(read, k + len(bufs))
        os.fsync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        src.close()


def _leftovers(model_dir: Path, manifest: Manifest) -> list[Path]:
    """Layer files in experts/ that the manifest does not name: what an interrupted repack left."""
    named = {Path(ef.file).name for ef in manifest.experts.values()}
    folder = model_dir / EXPERTS_DIR
    return [p for p in sorted(folder.iterdir()) if p.name not in named and p.suffix in (".bin", ".tmp")]


def repack(
    model_dir: Path, profile: HotProfile, on_layer: Callable[[int, int], None] = lambda done, total: None
) -> RepackReport:
    """Store every profiled layer's experts hottest first (HotProfile.order); layers the profile does not
    cover (the MTP layer) keep their order."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    busy = f"another dsfp4 process (convert or repack) is writing {model_dir}; wait for it"
    fd = lock_folder(model_dir, busy)  # before reading the manifest: another repack may just have changed it
    try:
        manifest = Manifest.open(model_dir)
        profile.check(manifest, "the hot profile")
        if manifest.record is None:
            raise ConfigError(f"{model_dir}: this model has no expert records to repack")
        n = manifest.record.nbytes
        for stale in _leftovers(model_dir, manifest):
            stale.unlink()
        todo = [
            (layer, profile.order(layer))
            for layer, ef in sorted(manifest.experts.items())
            if layer in profile.counts and not _in_order(ef, profile.order(layer), n)
        ]
        largest = max((len(manifest.experts[layer].offsets) * n for layer, _ in todo), default=0)
        free = shutil.disk_usage(model_dir / EXPERTS_DIR).free
        if largest > free:
            raise OutputError(
                f"{model_dir / EXPERTS_DIR}: a repack needs {format_bytes(largest)} free (one layer file), "
                f"{format_bytes(free)} is free; free some space and run it again"
            )
        copied = 0
        for done, (layer, order) in enumerate(todo, 1):
            ef = manifest.experts[layer]
            assert sorted(order) == list(range(len(ef.offsets))), (layer, len(order))  # check() saw to it
            name = hot_file_name(ef, order)
            tmp = model_dir / (name + ".tmp")
            try:
                _copy_layer(model_dir, ef, order, n, tmp)
            except Exception:
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(model_dir / name)
            fsync_dir(tmp.parent)  # the new name is durable before the manifest points at it
            position = {e: i for i, e in enumerate(order)}
            offsets = tuple(position[e] * n for e in range(len(order)))
            manifest = dataclasses.replace(
                manifest, experts={**manifest.experts, layer: ExpertFile(name, offsets, ef.sha256)}
            )
            manifest.write(model_dir)  # atomic: from here the new file is the layer's
            if ef.file != name:
                (model_dir / ef.file).unlink(missing_ok=True)
            copied += len(order) * n
            on_layer(done, len(todo))
    finally:
        os.close(fd)  # the lock file stays: unlinking it would let two later writers lock different files
    unchanged = sum(1 for layer in manifest.experts if layer in profile.counts) - len(todo)
    return RepackReport(len(todo), unchanged, copied, time.perf_counter() - t0)
