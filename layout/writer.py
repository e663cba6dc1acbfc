"""Writing a converted model's folder, for every writer of layout v1 (the converter, the synthetic bench models):
each layer's expert file record by record, and the manifest last, from what each finished file reports.

A layer file is written under a temporary name, records at their planned offsets in any order, then made durable
and renamed; manifest.json comes after every file, atomically: a folder is a converted model exactly when its
manifest exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsfp4.layout.manifest import ExpertFile, FileEntry, Manifest, TensorEntry
from dsfp4.layout.model_args import ModelArgs
from dsfp4.layout.record import RecordLayout, record_sha256
from dsfp4.layout.safetensors_file import file_sha256, pwrite_all

# the suffix of a file being written
PARTIAL = ".partial"


class ExpertFileWriter:
    """One MoE layer's expert file at `out / rel`: n_records records of `nbytes` each, record i at i * nbytes
    (the space is reserved up front, so writers may fill it in any order, from several threads)."""

    def __init__(self, out: Path, rel: str, n_records: int, nbytes: int):
        self.rel, self.nbytes = rel, nbytes
        self.path = Path(out) / rel
        self.tmp = self.path.with_name(self.path.name + PARTIAL)
        self.sha256: list[str | None] = [None] * n_records
        self.fd: int | None = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, n_records * nbytes)
        except BaseException:
            self.abort()
            raise

    def write(self, i: int, record: memoryview | bytes) -> str:
        """Record i's bytes (padded to nbytes by the caller); returns its sha256."""
        digest = record_sha256(record)
        pwrite_all(self.fd, record, i * self.nbytes)
        self.sha256[i] = digest
        return digest

    def finish(self) -> ExpertFile:
        """Make the file durable under its final name (and drop it from the page cache: records are read with
        O_DIRECT); its manifest entry."""
        if missing := [i for i, s in enumerate(self.sha256) if s is None]:
            raise AssertionError(f"{self.tmp}: record {missing[0]} was never written")
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._close()
        os.replace(self.tmp, self.path)
        return ExpertFile(self.rel, tuple(i * self.nbytes for i in range(len(self.sha256))), tuple(self.sha256))

    def _close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def abort(self) -> None:
        """Close after a failure (safe to call twice); the temporary file stays for the next run to replace."""
        self._close()


@dataclass
class ModelWriter:
    """What a writer has finished of a model folder, and the manifest written from it at the end."""

    out: Path
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)
    experts: dict[int, ExpertFile] = field(default_factory=dict)

    def backbone(self, file: str, entry: FileEntry, tensors: dict[str, TensorEntry]) -> None:
        """A finished backbone file (its size and sha256) and the tensors it holds by reference name."""
        self.files[file] = entry
        self.tensors.update(tensors)

    def expert_file(self, layer: int, ef: ExpertFile) -> None:
        self.experts[layer] = ef

    def copied(self, name: str) -> None:
        """A file beside the model (config.json, the tokenizer's), hashed as it is now."""
        path = self.out / name
        self.files[name] = FileEntry(path.stat().st_size, file_sha256(path))

    def finish(
        self,
        args: ModelArgs,
        source: dict[str, Any],
        options: dict[str, Any],
        record: RecordLayout | None,
        skipped: dict[str, int] | None = None,
        quant_error: dict[str, float] | None = None,
    ) -> Manifest:
        """Write manifest.json (last, atomically) and return it."""
        m = Manifest(
            args, source, options, self.tensors, self.files, record, self.experts, skipped or {}, quant_error or {}
        )
        m.write(self.out)
        return m
