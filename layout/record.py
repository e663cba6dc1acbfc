"""Expert records: one contiguous, 4096-aligned block of bytes per routed expert.

A record holds everything needed to compute one expert, in the form the decode kernel reads:
  w13        gate rows then up rows, packed e2m1   [2I, D/2]  (one fused gate+up GEMV)
  w13_scale  their block scales                    [2I, D/block]
  w2         down projection, packed e2m1          [D, I/2]
  w2_scale   its block scales                      [D, I/block]
  scale_2    (nvfp4 only) fp32 global scales of w1, w3, w2   [3]
Legend: D model dim, I expert width. Parts start at multiples of PART_ALIGN; the record is padded with
zeros to a multiple of RECORD_ALIGN, so O_DIRECT can read it straight into pinned memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsfp4.errors import FormatError
from dsfp4.layout.formats import DTYPE_NBYTES, FP4_FORMATS, component_shapes, get_format, shape_numel
from dsfp4.layout.quant import dequantize
from dsfp4.layout.safetensors_file import SAFETENSORS_NAMES, TORCH_DTYPES

RECORD_ALIGN = 4096
PART_ALIGN = 256


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class RecordPart:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RecordLayout:
    """Where each part of an expert record lives; the same for every expert of a model."""

    format: str
    dim: int
    inter_dim: int
    parts: tuple[RecordPart, ...]
    nbytes: int

    @classmethod
    def for_expert(cls, fmt: str, dim: int, inter_dim: int) -> RecordLayout:
        if fmt not in FP4_FORMATS:
            raise FormatError(f"expert records are stored in {' or '.join(FP4_FORMATS)}, not {fmt}")
        spec = get_format(fmt)
        w13 = component_shapes(spec, (2 * inter_dim, dim), "experts.w1/w3")
        w2 = component_shapes(spec, (dim, inter_dim), "experts.w2")
        (_, packed_dt), (_, scale_dt) = spec.components[:2]
        specs = [
            ("w13", packed_dt, w13[0]),
            ("w13_scale", scale_dt, w13[1]),
            ("w2", packed_dt, w2[0]),
            ("w2_scale", scale_dt, w2[1]),
        ]
        if spec.global_scale:
            specs.append(("scale_2", "F32", (3,)))
        parts, pos = [], 0
        for name, dtype, shape in specs:
            nbytes = shape_numel(shape) * DTYPE_NBYTES[dtype]
            parts.append(RecordPart(name, dtype, tuple(shape), pos, nbytes))
            pos = align_up(pos + nbytes, PART_ALIGN)
        return cls(fmt, dim, inter_dim, tuple(parts), align_up(pos, RECORD_ALIGN))

    def part(self, name: str) -> RecordPart:
        return next(p for p in self.parts if p.name == name)

    def pack(self, tensors: dict[str, torch.Tensor]) -> memoryview:
        """Build a record from its parts, on any device (shapes and dtypes must match exactly)."""
        buf = torch.zeros(self.nbytes, dtype=torch.uint8)
        for p in self.parts:
            t = tensors[p.name].detach()
            if tuple(t.shape) != p.shape or SAFETENSORS_NAMES.get(t.dtype) != p.dtype:
                raise FormatError(
                    f"record part {p.name}: got {t.dtype} {list(t.shape)}, expected {p.dtype} {list(p.shape)}"
                )
            buf[p.offset : p.offset + p.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        return memoryview(buf.numpy())

    def _raw(self, buf: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
        """A record's bytes as uint8 (a tensor stays where it is), checked to hold the whole layout."""
        raw = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        if raw.numel() < self.nbytes:
            raise FormatError(f"record is {raw.numel()} bytes, layout needs {self.nbytes}")
        return raw

    def unpack(self, buf: bytes | bytearray | memoryview | torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the parts of one record (buf: the record's bytes, on any device if a tensor)."""
        raw = self._raw(buf)
        return {
            p.name: raw[p.offset : p.offset + p.nbytes].view(TORCH_DTYPES[p.dtype]).reshape(p.shape) for p in self.parts
        }

    def stored(self, buf: bytes | bytearray | memoryview | torch.Tensor, which: str) -> tuple[torch.Tensor, ...]:
        """One matrix of a record (w1, w3 or w2) as stored, in FORMATS order: views of its spans (its packed rows,
        their block scales and for NVFP4 its global scale)."""
        raw = self._raw(buf)
        return tuple(raw[at : at + n].view(TORCH_DTYPES[dt]).reshape(shape) for dt, at, n, shape in self.spans(which))

    def spans(self, which: str) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """Where one matrix (w1, w3 or w2) lies in a record, in `stored`'s order: (dtype, byte offset in the record,
        bytes, shape) of its packed rows, of their block scales and, for NVFP4, of its global scale. A reader that
        wants one matrix reads these bytes only."""
        first, count = {"w1": (0, self.inter_dim), "w3": (self.inter_dim, self.inter_dim), "w2": (0, None)}[which]
        base, out = "w2" if which == "w2" else "w13", []
        for p in (self.part(base), self.part(base + "_scale")):
            rows, row = p.shape[0] if count is None else count, p.nbytes // p.shape[0]
            out.append((p.dtype, p.offset + first * row, rows * row, (rows, *p.shape[1:])))
        if self.format == "nvfp4":
            p, k = self.part("scale_2"), ("w1", "w3", "w2").index(which)
            out.append((p.dtype, p.offset + k * DTYPE_NBYTES[p.dtype], DTYPE_NBYTES[p.dtype], ()))
        return out

    def stored_from(self, read: Callable[[int, int], bytes], which: str) -> tuple[torch.Tensor, ...]:
        """stored()'s tensors of one matrix from read(offset in the record, bytes) of its spans alone."""
        return tuple(
            torch.frombuffer(bytearray(read(at, n)), dtype=TORCH_DTYPES[dt]).reshape(shape)
            for dt, at, n, shape in self.spans(which)
        )

    def matrix(
        self, buf: bytes | bytearray | memoryview | torch.Tensor, which: str, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Torch reference: one matrix of a record, dense: w1 [I, D], w3 [I, D] or w2 [D, I]."""
        return dequantize(self.format, self.stored(buf, which), dtype=dtype)

    def dequantize(
        self, buf: bytes | bytearray | memoryview | torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Torch reference: record -> dense (w1 [I, D], w3 [I, D], w2 [D, I])."""
        return tuple(self.matrix(buf, w, dtype) for w in ("w1", "w3", "w2"))

    def to_dict(self) -> dict:
        return {
            "format": self.format,
            "dim": self.dim,
            "inter_dim": self.inter_dim,
            "nbytes": self.nbytes,
            "parts": [
                {"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": p.offset, "nbytes": p.nbytes}
                for p in self.parts
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> RecordLayout:
        parts = tuple(
            RecordPart(p["name"], p["dtype"], tuple(p["shape"]), p["offset"], p["nbytes"]) for p in d["parts"]
        )
        return cls(d["format"], d["dim"], d["inter_dim"], parts, d["nbytes"])


def record_sha256(buf: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()
