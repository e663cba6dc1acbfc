"""Expert records: one contiguous, 4096-aligned block of bytes per routed expert.

A record holds everything needed to compute one expert, in the form the decode kernel reads:
  w13        gate rows then up rows, packed e2m1   [2I, D/2]  (one fused gate+up GEMV)
  w13_scale  their block scales                    [2I, D/block]
  w2         down projection, packed e2m1          [D, I/2]
  w2_scale   its block scales                      [D, I/block]
  scale_2    (nvfp4 only) fp32 global scales of w1, w3, w2   [3]
A cold record (code_bits 2 or 3, layout/cold.py) holds narrower codes in w13 and w2, [2I, D * bits / 8] and
[D, I * bits / 8], and the same scales: widened, it is a record of its format.
Legend: D model dim, I expert width. Parts start at multiples of PART_ALIGN; the record is padded with
zeros to a multiple of RECORD_ALIGN, so O_DIRECT can read it straight into pinned memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsfp4.errors import FormatError
from dsfp4.layout.cold import narrow, widen
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
    """Where each part of an expert record lives; the same for every expert of a model (or for each of its cold
    ones). code_bits: 4 (e2m1 codes), or 2 or 3 for a cold record."""

    format: str
    dim: int
    inter_dim: int
    parts: tuple[RecordPart, ...]
    nbytes: int
    code_bits: int = 4

    @classmethod
    def for_expert(cls, fmt: str, dim: int, inter_dim: int, code_bits: int = 4) -> RecordLayout:
        if fmt not in FP4_FORMATS:
            raise FormatError(f"expert records are stored in {' or '.join(FP4_FORMATS)}, not {fmt}")
        spec = get_format(fmt)
        w13 = component_shapes(spec, (2 * inter_dim, dim), "experts.w1/w3")
        w2 = component_shapes(spec, (dim, inter_dim), "experts.w2")
        # codes of code_bits each along K
        for shapes, k in ((w13, dim), (w2, inter_dim)):
            shapes[0] = (shapes[0][0], k * code_bits // 8)
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
        return cls(fmt, dim, inter_dim, tuple(parts), align_up(pos, RECORD_ALIGN), code_bits)

    @property
    def cold(self) -> bool:
        return self.code_bits != 4

    def cold_of(self, bits: int) -> RecordLayout:
        """The layout of this format's records in cold codes of `bits`."""
        return RecordLayout.for_expert(self.format, self.dim, self.inter_dim, bits)

    def wide(self) -> RecordLayout:
        """The layout this one widens to: its format's own record."""
        return RecordLayout.for_expert(self.format, self.dim, self.inter_dim)

    def widen(self, buf: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
        """Torch reference: a cold record's bytes -> the record of its format (uint8 [wide().nbytes], on buf's device
        if a tensor). kernels/fp4/widen.py does the same on CUDA."""
        wide, parts = self.wide(), self.unpack(buf)
        for name in ("w13", "w2"):
            parts[name] = widen(parts[name], self.code_bits)
        return wide.pack_tensor(parts)

    def narrow(self, buf: bytes | bytearray | memoryview | torch.Tensor, bits: int) -> torch.Tensor:
        """This (exact) record's matrices narrowed to cold codes of `bits`: the cold record's bytes (uint8 on buf's
        device if a tensor). NVFP4's global scales stay; every block scale is chosen anew (layout/cold.py)."""
        if self.cold:
            raise FormatError(f"a record of {self.code_bits}-bit codes cannot be narrowed again")
        cold, parts = self.cold_of(bits), self.unpack(buf)
        g = parts["scale_2"] if self.format == "nvfp4" else None
        for base, mats in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            out = [
                narrow(self.format, self.matrix(buf, m), bits, g[k] if g is not None else None)
                for m, k in zip(mats, (0, 1) if base == "w13" else (2,), strict=True)
            ]
            parts[base] = torch.cat([codes for codes, _ in out])
            parts[base + "_scale"] = torch.cat([scale for _, scale in out])
        return cold.pack_tensor(parts)

    def part(self, name: str) -> RecordPart:
        return next(p for p in self.parts if p.name == name)

    def pack(self, tensors: dict[str, torch.Tensor]) -> memoryview:
        """Build a record from its parts (shapes and dtypes must match exactly), in host memory."""
        return memoryview(self.pack_tensor({k: t.cpu() for k, t in tensors.items()}).numpy())

    def pack_tensor(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """pack(), as a uint8 tensor on the parts' device."""
        device = next(iter(tensors.values())).device
        buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        for p in self.parts:
            t = tensors[p.name].detach()
            if tuple(t.shape) != p.shape or SAFETENSORS_NAMES.get(t.dtype) != p.dtype:
                raise FormatError(
                    f"record part {p.name}: got {t.dtype} {list(t.shape)}, expected {p.dtype} {list(p.shape)}"
                )
            buf[p.offset : p.offset + p.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        return buf

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
        """One matrix of a record (w1, w3 or w2) in its format, in FORMATS order: views of its spans (its packed rows,
        their block scales and for NVFP4 its global scale); a cold record's codes come widened (a new tensor)."""
        raw = self._raw(buf)
        return self._fp4(
            tuple(raw[at : at + n].view(TORCH_DTYPES[dt]).reshape(shape) for dt, at, n, shape in self.spans(which))
        )

    def _fp4(self, stored: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (widen(stored[0], self.code_bits), *stored[1:]) if self.cold else stored

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

    def stored_from(self, read: Callable[[int, int], bytes | torch.Tensor], which: str) -> tuple[torch.Tensor, ...]:
        """stored()'s tensors of one matrix from read(offset in the record, bytes) of its spans alone (bytes, or a
        uint8 tensor taken as it is)."""
        spans = []
        for dt, at, n, shape in self.spans(which):
            raw = read(at, n)
            raw = raw if isinstance(raw, torch.Tensor) else torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            spans.append(raw.view(TORCH_DTYPES[dt]).reshape(shape))
        return self._fp4(tuple(spans))

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
            **({"code_bits": self.code_bits} if self.cold else {}),
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
        return cls(d["format"], d["dim"], d["inter_dim"], parts, d["nbytes"], int(d.get("code_bits", 4)))


def record_sha256(buf: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()
