"""Safetensors files read and written tensor by tensor, never whole.

Reading parses the header and preads one tensor at a time (no mmap, so touched pages never pile up in
RSS). Writing plans the header first, then places each tensor at its offset with pwrite, in any order:
workers can fill one file in parallel and the bytes do not depend on their order.
Format: u64 little-endian header length, JSON header (space-padded to 8 bytes), tensor data.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from dsfp4.errors import SourceError
from dsfp4.layout.formats import DTYPE_NBYTES, shape_numel

TORCH_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
MAX_HEADER = 100 << 20
CHUNK = 64 << 20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor in a safetensors file: `offset` is absolute in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a header; a file cut short or with inconsistent offsets is a SourceError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceError(f"{path}: truncated safetensors file ({size} bytes); download it again")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            raise SourceError(
                f"{path}: truncated or not a safetensors file (header claims {n} bytes, "
                f"file has {size}); download it again"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SourceError(f"{path}: unreadable safetensors header ({e}); download it again") from e
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        dtype = meta["dtype"]
        if dtype in DTYPE_NBYTES and end - begin != shape_numel(shape) * DTYPE_NBYTES[dtype]:
            raise SourceError(f"{path}: tensor {name} has {end - begin} bytes for {dtype} {list(shape)}")
        if data_start + end > size:
            raise SourceError(
                f"{path}: truncated: tensor {name} ends at byte {data_start + end} but the "
                f"file has {size} bytes; download it again"
            )
        out[name] = TensorInfo(name, dtype, shape, data_start + begin, end - begin)
    return out


def pread_exact(fd: int, nbytes: int, offset: int, path: Path | str = "") -> torch.Tensor:
    """Read nbytes at offset into a new uint8 tensor (no intermediate bytes object)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise SourceError(f"{path}: unexpected end of file at byte {offset + done}")
        done += got
    return buf


def bytes_to_tensor(raw: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterpret uint8 bytes as a tensor of a safetensors dtype."""
    return raw.view(TORCH_DTYPES[dtype]).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (moved to CPU, made contiguous)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class SafetensorsWriter:
    """A safetensors file with a header planned up front; tensors are then pwritten at their offsets.

    `entries` are (name, dtype, shape). Tensors are laid out by descending element size, then name, so
    every tensor is aligned to its element size, as the safetensors library does.
    """

    def __init__(
        self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
    ):
        self.path = path
        ordered = sorted(entries, key=lambda e: (-DTYPE_NBYTES[e[1]], e[0]))
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        pos = 0
        self.layout: dict[str, tuple[int, int]] = {}
        for name, dtype, shape in ordered:
            nbytes = shape_numel(shape) * DTYPE_NBYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self.layout[name] = (pos, nbytes)
            pos += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.data_start = 8 + len(blob)
        self.nbytes = self.data_start + pos
        self.written: set[str] = set()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.nbytes)
        pwrite_all(self.fd, struct.pack("<Q", len(blob)) + blob, 0)

    def span(self, name: str) -> tuple[int, int]:
        """Absolute (offset, nbytes) of a planned tensor."""
        pos, nbytes = self.layout[name]
        return self.data_start + pos, nbytes

    def write(self, name: str, data: torch.Tensor | memoryview) -> None:
        offset, nbytes = self.span(name)
        view = tensor_bytes(data) if isinstance(data, torch.Tensor) else data
        if len(view) != nbytes:
            raise ValueError(f"{self.path}: {name} is {len(view)} bytes, planned {nbytes}")
        pwrite_all(self.fd, view, offset)
        self.written.add(name)

    def mark_written(self, name: str) -> None:
        """For tensors whose bytes the caller placed itself (chunked copies through span())."""
        self.written.add(name)

    def abort(self) -> None:
        """Close without checks, after a failure; the caller discards the file."""
        os.close(self.fd)

    def close(self) -> None:
        """fsync and close; every planned tensor must have been written."""
        missing = set(self.layout) - self.written
        os.fsync(self.fd)
        os.close(self.fd)
        if missing:
            raise ValueError(f"{self.path}: tensors never written: {sorted(missing)[:3]}")


def file_sha256(path: Path, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
