"""Re-hash a converted model against its manifest: every file, every expert record, every tensor header.

The first mismatch raises ChecksumError (or ManifestError for structural problems) naming the file,
and the expert or tensor, so `dsfp4 verify` can stop there with a one-line answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsfp4.errors import ChecksumError, ManifestError
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import record_sha256
from dsfp4.layout.safetensors_file import file_sha256, read_header


@dataclass(frozen=True)
class VerifyReport:
    n_files: int
    n_records: int
    nbytes: int


def _check_headers(model_dir: Path, m: Manifest) -> None:
    headers = {rel: read_header(model_dir / rel) for rel in {t.file for t in m.tensors.values()}}
    for name, t in m.tensors.items():
        for stored in t.tensors.values():
            if stored not in headers[t.file]:
                raise ManifestError(f"{t.file}: tensor {stored} (of {name}) listed in the manifest is missing")


def checked_bytes(m: Manifest) -> int:
    """Bytes verify() reads: every listed file and every expert record."""
    records = sum(m.layout_of((layer, e)).nbytes for layer, ef in m.experts.items() for e in range(len(ef.offsets)))
    return sum(f.nbytes for f in m.files.values()) + records


def verify(
    model_dir: Path,
    on_bytes: Callable[[int], None] = lambda n: None,
    workers: int = 4,
    on_start: Callable[[int], None] = lambda total: None,
) -> VerifyReport:
    """Check sizes and sha256 of every file and record listed in model_dir/manifest.json, and its hot profile. The
    quick checks come first (the manifest, each file's size, hot.json); then `on_start` gets the bytes the hashing
    will read and `on_bytes` each part read."""
    model_dir = Path(model_dir)
    # every file there at its size
    m = Manifest.open(model_dir)
    hot = model_dir / HOT_NAME
    # run refuses a damaged or foreign profile: verify says so
    if hot.is_file():
        HotProfile.read(hot).check(m, hot)
    on_start(checked_bytes(m))
    for rel, f in m.files.items():
        path = model_dir / rel
        if file_sha256(path) != f.sha256:
            raise ChecksumError(f"{path}: sha256 mismatch; the file is damaged, convert again")
        on_bytes(f.nbytes)
    _check_headers(model_dir, m)
    n_records = 0
    for layer, ef in sorted(m.experts.items()):
        path = model_dir / ef.file
        sizes = [m.layout_of((layer, e)).nbytes for e in range(len(ef.offsets))]
        fd = os.open(path, os.O_RDONLY)
        try:

            def digest(span: tuple[int, int], fd: int = fd) -> str:
                return record_sha256(os.pread(fd, *span))

            with ThreadPoolExecutor(workers) as pool:
                spans = pool.map(digest, zip(sizes, ef.offsets, strict=True))
                for e, (want, got) in enumerate(zip(ef.sha256, spans, strict=True)):
                    if want != got:
                        raise ChecksumError(
                            f"{path}: the record of expert {e} (layer {layer}, offset "
                            f"{ef.offsets[e]}) fails its sha256 check; convert again"
                        )
                    on_bytes(sizes[e])
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        n_records += len(ef.offsets)
    return VerifyReport(len(m.files) + len(m.experts), n_records, checked_bytes(m))
