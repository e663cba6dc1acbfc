"""Hot-first repack: rewrite each layer file with its experts in hotness order, so that the warm start
reads the hot prefix of every layer in one sequential read; with `Cold`, the records outside each layer's hot set
are narrowed to 2- or 3-bit codes on the way (layout/cold.py), each matrix at its recipe's bits (layout/recipe.py),
so each SSD miss reads fewer bytes.

Safe to interrupt, one layer at a time: the layer's new file is written under a new name and synced,
then manifest.json is replaced atomically to point at it, then the old file is removed. The manifest
always names complete files, so an interrupted repack leaves a model that loads (some layers in the new
order, the rest in the old) and gives the same tokens; running it again finishes the job and removes
what the interrupted run left behind. A plain repack changes only file names and offsets, so the conversion's
identity stays; narrowing changes records and their checksums (conversion_sha256), while the manifest keeps each
cold record's source checksum, so hot.json (bound to exact_sha256) stays valid. Extra disk space: one layer file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dsfp4.errors import ChecksumError, ConfigError, OutputError
from dsfp4.layout.atomic import fsync_dir, lock_folder
from dsfp4.layout.cold import COLD_BITS
from dsfp4.layout.direct_io import RecordFile, aligned_buffer, open_direct
from dsfp4.layout.hot_profile import HotProfile
from dsfp4.layout.manifest import ExpertFile, Manifest
from dsfp4.layout.recipe import EXACT, Bits, ColdRecipe
from dsfp4.layout.record import RecordLayout, record_sha256
from dsfp4.layout.safetensors_file import pwrite_all
from dsfp4.units import format_bytes

EXPERTS_DIR = "experts"
# records per write while copying a layer
COPY_RECORDS = 8
# chunks read ahead of the writer (RAM: COPY_DEPTH x COPY_RECORDS records)
COPY_DEPTH = 4


@dataclass(frozen=True)
class RepackReport:
    # layer files written in the new order
    rewritten: int
    # already in that order
    unchanged: int
    # bytes written
    nbytes: int
    seconds: float
    # records narrowed to cold codes
    narrowed: int = 0


@dataclass(frozen=True)
class Cold:
    """Narrow the records outside each layer's hot set: the hottest `hot_share` of its experts stay exact, the rest
    are stored, after the hot ones, in cold codes of `recipe`'s bits for their layer (given as one width: every
    matrix at it, `--cold-bits`)."""

    recipe: ColdRecipe | int
    hot_share: float

    def __post_init__(self) -> None:
        if isinstance(self.recipe, int):
            if self.recipe not in COLD_BITS:
                raise ConfigError(f"cold records take {COLD_BITS} bits, not {self.recipe}")
            object.__setattr__(self, "recipe", ColdRecipe.uniform(self.recipe))
        if not 0 <= self.hot_share < 1:
            raise ConfigError(f"cold records take a hot share in [0, 1), not {self.hot_share}")

    def bits(self, layer: int) -> Bits:
        return self.recipe.of(layer)

    def experts(self, order: list[int], layer: int) -> tuple[int, ...]:
        """The layer's experts a repack narrows: none where its recipe keeps every matrix exact."""
        return cold_experts(order, self.hot_share) if self.bits(layer) != EXACT else ()


def cold_experts(order: list[int], hot_share: float) -> tuple[int, ...]:
    """order: a layer's experts hottest first -> those a cold repack narrows: all but its hottest ceil(hot_share x
    len(order)), in expert order (the projection's cold records follow the same rule)."""
    return tuple(sorted(order[math.ceil(hot_share * len(order)) :]))


@dataclass(frozen=True)
class Target:
    """Where a layer's records go: in `order` through the file, `cold` ones narrowed to `layouts[1]`, each at
    offsets[e]."""

    order: list[int]
    cold: tuple[int, ...]
    offsets: tuple[int, ...]
    # exact, cold
    layouts: tuple[RecordLayout, RecordLayout | None]

    @classmethod
    def of(cls, manifest: Manifest, layer: int, order: list[int], cold: Cold | None) -> Target:
        wide = manifest.record
        narrowed = cold.experts(order, layer) if cold else manifest.experts[layer].cold
        narrow = manifest.experts[layer].cold_record
        if cold and narrowed:
            narrow = wide.cold_of(cold.bits(layer))
        offsets, at = [0] * len(order), 0
        for e in order:
            offsets[e] = at
            at += (narrow if e in narrowed else wide).nbytes
        return cls(order, narrowed, tuple(offsets), (wide, narrow))

    def layout(self, e: int) -> RecordLayout:
        return self.layouts[e in self.cold]

    def done(self, ef: ExpertFile) -> bool:
        return ef.offsets == self.offsets and ef.cold == self.cold


def hot_file_name(ef: ExpertFile, order: list[int]) -> str:
    """experts/layer-NNN.<digest of the order>.bin: a new name per order, so a new file never replaces
    one the manifest still names."""
    stem = Path(ef.file).name.split(".")[0]
    digest = hashlib.sha256(",".join(map(str, order)).encode()).hexdigest()[:8]
    return f"{EXPERTS_DIR}/{stem}.{digest}.bin"


def _check_narrowing(manifest: Manifest, layer: int, target: Target) -> None:
    """Narrowing is one-way: a layer already narrowed may only be narrowed the same way again (an interrupted run)."""
    ef = manifest.experts[layer]
    bits = target.layouts[1].code_bits if target.cold else None
    if ef.cold and (set(ef.cold) - set(target.cold) or ef.cold_record.code_bits != bits):
        have = "/".join(map(str, ef.cold_record.code_bits))
        raise ConfigError(
            f"layer {layer}: {len(ef.cold)} experts are already stored in cold codes of {have} bits (gate/up/down), "
            f"which cannot be undone; run the same --cold-bits or --cold-recipe and hot share again, or convert again"
        )


def _copy_layer(
    model_dir: Path, manifest: Manifest, layer: int, target: Target, dst: Path, device: torch.device
) -> dict[int, str]:
    """Write the layer's records to dst as `target` places them, checking each record's sha256 on the way and
    narrowing the ones `target` makes cold; returns the sha256 of each narrowed record. Reader threads run
    COPY_DEPTH chunks ahead of the writer, both with O_DIRECT where the filesystem allows."""
    ef = manifest.experts[layer]
    src = RecordFile(model_dir / ef.file)
    fd, direct = open_direct(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    chunks = [target.order[i : i + COPY_RECORDS] for i in range(0, len(target.order), COPY_RECORDS)]
    wide = target.layouts[0].nbytes
    bufs = [aligned_buffer(COPY_RECORDS * wide) for _ in range(min(COPY_DEPTH, len(chunks)))]
    narrowed: dict[int, str] = {}

    def read(k: int) -> memoryview:
        buf, at = bufs[k % len(bufs)], 0
        for e in chunks[k]:
            have, out = manifest.layout_of((layer, e)), target.layout(e)
            record = buf[at : at + have.nbytes] if have.nbytes <= out.nbytes else aligned_buffer(have.nbytes)
            src.read_into([record], ef.offsets[e])
            if record_sha256(record) != ef.sha256[e]:
                raise ChecksumError(
                    f"{src.path}: the record of expert {e} fails its sha256 check; nothing was repacked "
                    f"past this layer (run `dsfp4 verify`, then convert again)"
                )
            if out != have:
                cold = have.narrow(torch.from_numpy(record).to(device), out.code_bits).cpu().numpy()
                buf[at : at + out.nbytes] = cold
                narrowed[e] = record_sha256(cold)
            at += out.nbytes
        return memoryview(buf)[:at]

    try:
        with ThreadPoolExecutor(len(bufs)) as pool:
            pending = {k: pool.submit(read, k) for k in range(len(bufs))}
            for k in range(len(chunks)):
                pwrite_all(fd, pending.pop(k).result(), target.offsets[chunks[k][0]])
                # its buffer is free again
                if k + len(bufs) < len(chunks):
                    pending[k + len(bufs)] = pool.submit(read, k + len(bufs))
        os.fsync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        src.close()
    return narrowed


def _leftovers(model_dir: Path, manifest: Manifest) -> list[Path]:
    """Layer files in experts/ that the manifest does not name: what an interrupted repack left."""
    named = {Path(ef.file).name for ef in manifest.experts.values()}
    folder = model_dir / EXPERTS_DIR
    return [p for p in sorted(folder.iterdir()) if p.name not in named and p.suffix in (".bin", ".tmp")]


def _placed(ef: ExpertFile, name: str, target: Target, narrowed: dict[int, str]) -> ExpertFile:
    """The layer's manifest entry once its new file is written."""
    sha, source = list(ef.sha256), dict(zip(ef.cold, ef.source_sha256, strict=True))
    for e, digest in narrowed.items():
        source[e], sha[e] = sha[e], digest
    layout = target.layouts[1] if target.cold else None
    return ExpertFile(name, target.offsets, tuple(sha), target.cold, tuple(source[e] for e in target.cold), layout)


def repack(
    model_dir: Path,
    profile: HotProfile,
    on_layer: Callable[[int, int], None] = lambda done, total: None,
    cold: Cold | None = None,
) -> RepackReport:
    """Store every profiled layer's experts hottest first (HotProfile.order), narrowing each layer's cold ones
    with `cold`; layers the profile does not cover (the MTP layer) keep their order and records."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    busy = f"another dsfp4 process (convert or repack) is writing {model_dir}; wait for it"
    # before reading the manifest: another repack may just have changed it
    fd = lock_folder(model_dir, busy)
    # narrowing is quicker there
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        manifest = Manifest.open(model_dir)
        profile.check(manifest, "the hot profile")
        if manifest.record is None:
            raise ConfigError(f"{model_dir}: this model has no expert records to repack")
        for stale in _leftovers(model_dir, manifest):
            stale.unlink()
        targets = {
            layer: Target.of(manifest, layer, profile.order(layer), cold)
            for layer in sorted(manifest.experts)
            if layer in profile.counts
        }
        if cold is not None:
            cold.recipe.check_layers(set(targets))
        for layer, target in targets.items():
            _check_narrowing(manifest, layer, target)
        todo = [(layer, t) for layer, t in targets.items() if not t.done(manifest.experts[layer])]
        largest = max((t.offsets[t.order[-1]] + t.layout(t.order[-1]).nbytes for _, t in todo), default=0)
        free = shutil.disk_usage(model_dir / EXPERTS_DIR).free
        if largest > free:
            raise OutputError(
                f"{model_dir / EXPERTS_DIR}: a repack needs {format_bytes(largest)} free (one layer file), "
                f"{format_bytes(free)} is free; free some space and run it again"
            )
        written = narrowed = 0
        for done, (layer, target) in enumerate(todo, 1):
            ef = manifest.experts[layer]
            # check() did
            assert sorted(target.order) == list(range(len(ef.offsets))), (layer, len(target.order))
            name = hot_file_name(ef, target.order + ([-1, *target.cold] if target.cold else []))
            tmp = model_dir / (name + ".tmp")
            try:
                new = _copy_layer(model_dir, manifest, layer, target, tmp, device)
            except Exception:
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(model_dir / name)
            # the new name is durable before the manifest points at it
            fsync_dir(tmp.parent)
            experts = {**manifest.experts, layer: _placed(ef, name, target, new)}
            manifest = dataclasses.replace(manifest, experts=experts)
            # atomic: from here the new file is the layer's
            manifest.write(model_dir)
            if ef.file != name:
                (model_dir / ef.file).unlink(missing_ok=True)
            written += sum(target.layout(e).nbytes for e in target.order)
            narrowed += len(new)
            on_layer(done, len(todo))
    finally:
        # the lock file stays: unlinking it would let two later writers lock different files
        os.close(fd)
    return RepackReport(len(todo), len(targets) - len(todo), written, time.perf_counter() - t0, narrowed)
