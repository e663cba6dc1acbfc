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

from dsfp4.errors import FormatError, SourceError
from dsfp4.layout.formats import DTYPE_NBYTES, shape_numel
from dsfp4.layout.fp4 import E8M0_NAN

TORCH_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
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


def header_length(where: Path | str, size: int, head: bytes) -> int:
    """The JSON header's length from a file's first 8 bytes (a SourceError when they cannot be right)."""
    if len(head) < 8:
        raise SourceError(f"{where}: truncated safetensors file ({size} bytes); download it again")
    (n,) = struct.unpack("<Q", head[:8])
    if n > min(size - 8, MAX_HEADER):
        raise SourceError(
            f"{where}: truncated or not a safetensors file (header claims {n} bytes, file has {size}); "
            f"download it again"
        )
    return n


def parse_header(where: Path | str, size: int, raw: bytes) -> dict[str, TensorInfo]:
    """Parse and validate a header (`raw`: its JSON bytes) of a file of `size` bytes."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{where}: unreadable safetensors header ({e}); download it again") from e
    if not isinstance(header, dict):
        raise SourceError(f"{where}: safetensors header is not a JSON object; download it again")
    data_start = 8 + len(raw)
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name != "__metadata__":
            out[name] = _tensor_info(where, name, meta, data_start, size)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out.values())
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise SourceError(f"{where}: tensors {a} and {b} overlap in the file; download it again")
    return out


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a file's header; a file cut short or with inconsistent offsets is a SourceError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = header_length(path, size, f.read(8))
        return parse_header(path, size, f.read(n))


def _tensor_info(path: Path | str, name: str, meta: object, data_start: int, size: int) -> TensorInfo:
    """Validate one header entry: types, a non-negative span that fits the dtype, shape and file."""
    ok = isinstance(meta, dict) and isinstance(meta.get("dtype"), str)
    shape, offsets = (meta.get("shape"), meta.get("data_offsets")) if ok else (None, None)
    ok = ok and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    if not ok or not 0 <= offsets[0] <= offsets[1]:
        raise SourceError(f"{path}: malformed header entry for tensor {name}; download it again")
    (begin, end), dtype = offsets, meta["dtype"]
    if dtype in DTYPE_NBYTES and end - begin != shape_numel(tuple(shape)) * DTYPE_NBYTES[dtype]:
        raise SourceError(f"{path}: tensor {name} has {end - begin} bytes for {dtype} {shape}")
    if data_start + end > size:
        raise SourceError(
            f"{path}: truncated: tensor {name} ends at byte {data_start + end} but the "
            f"file has {size} bytes; download it again"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, end - begin)


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


def check_finite_bytes(raw: torch.Tensor, dtype: str, what: str) -> None:
    """Reject NaN/Inf in raw bytes of a safetensors dtype (e4m3 has no Inf; its NaN is S.1111.111; e8m0's
    NaN is 255)."""
    if dtype == "F8_E4M3":
        bad = bool(((raw & 0x7F) == 0x7F).any())
    elif dtype == "F8_E8M0":
        bad = bool((raw == E8M0_NAN).any())
    elif dtype in ("BF16", "F16", "F32", "F64"):
        bad = not bool(torch.isfinite(raw.view(TORCH_DTYPES[dtype])).all())
    else:
        return
    if bad:
        raise FormatError(f"{what}: contains NaN or Inf values; the source weight is corrupt")


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
        """Close without checks after a failure (the caller discards the file); safe to call twice."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def close(self) -> None:
        """Check that every planned tensor was written, fsync and close."""
        missing = set(self.layout) - self.written
        if missing:
            self.abort()
            raise ValueError(f"{self.path}: tensors never written: {sorted(missing)[:3]}")
        os.fsync(self.fd)
        self.abort()


def file_sha256(path: Path, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
