"""Expert records: one contiguous, 4096-aligned block of bytes per routed expert.

A record holds everything needed to compute one expert, in the form the decode kernel reads:
  w13        gate rows then up rows, packed e2m1   [2I, D/2]  (one fused gate+up GEMV)
  w13_scale  their block scales                    [2I, D/block]
  w2         down projection, packed e2m1          [D, I/2]
  w2_scale   its block scales                      [D, I/block]
  scale_2    (nvfp4 only) fp32 global scales of w1, w3, w2   [3]
A cold record (layout/cold.py) holds narrower codes, each matrix at the bits of its recipe (layout/recipe.py:
code_bits, gate w1, up w3, down w2, each 2, 3 or 4), and the same scales: widened, it is a record of its format.
Its codes are w13 [2I, D * bits / 8] while gate and up keep the same bits, else two parts, w1 and w3 [I, D * bits /
8]; w2 is [D, I * bits / 8]. A matrix at 4 bits keeps its e2m1 codes and block scales as they are.
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
from dsfp4.layout.recipe import EXACT, EXACT_BITS, MATRICES, Bits
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


def as_bits(code_bits: int | Bits) -> Bits:
    """One width for the three matrices, or (gate, up, down)."""
    return (code_bits,) * len(MATRICES) if isinstance(code_bits, int) else tuple(code_bits)


@dataclass(frozen=True)
class RecordLayout:
    """Where each part of an expert record lives; the same for every expert of a model (or for each of its cold
    ones, per layer). code_bits: (gate, up, down) code widths, 4 (e2m1 codes) or, in a cold record, 2 or 3."""

    format: str
    dim: int
    inter_dim: int
    parts: tuple[RecordPart, ...]
    nbytes: int
    code_bits: Bits = EXACT

    @classmethod
    def for_expert(cls, fmt: str, dim: int, inter_dim: int, code_bits: int | Bits = EXACT_BITS) -> RecordLayout:
        if fmt not in FP4_FORMATS:
            raise FormatError(f"expert records are stored in {' or '.join(FP4_FORMATS)}, not {fmt}")
        b1, b3, b2 = bits = as_bits(code_bits)
        spec = get_format(fmt)
        w13 = component_shapes(spec, (2 * inter_dim, dim), "experts.w1/w3")
        w2 = component_shapes(spec, (dim, inter_dim), "experts.w2")
        (_, packed_dt), (_, scale_dt) = spec.components[:2]
        # codes of their bits each along K
        if b1 == b3:
            codes = [("w13", packed_dt, (2 * inter_dim, dim * b1 // 8))]
        else:
            codes = [("w1", packed_dt, (inter_dim, dim * b1 // 8)), ("w3", packed_dt, (inter_dim, dim * b3 // 8))]
        specs = [
            *codes,
            ("w13_scale", scale_dt, w13[1]),
            ("w2", packed_dt, (dim, inter_dim * b2 // 8)),
            ("w2_scale", scale_dt, w2[1]),
        ]
        if spec.global_scale:
            specs.append(("scale_2", "F32", (3,)))
        parts, pos = [], 0
        for name, dtype, shape in specs:
            nbytes = shape_numel(shape) * DTYPE_NBYTES[dtype]
            parts.append(RecordPart(name, dtype, tuple(shape), pos, nbytes))
            pos = align_up(pos + nbytes, PART_ALIGN)
        return cls(fmt, dim, inter_dim, tuple(parts), align_up(pos, RECORD_ALIGN), bits)

    @property
    def cold(self) -> bool:
        return self.code_bits != EXACT

    def bits_of(self, which: str) -> int:
        """The code width of one matrix (w1, w3 or w2)."""
        return self.code_bits[MATRICES.index(which)]

    def cold_of(self, bits: int | Bits) -> RecordLayout:
        """The layout of this format's records in cold codes of `bits` (one width, or gate, up, down)."""
        return RecordLayout.for_expert(self.format, self.dim, self.inter_dim, bits)

    def wide(self) -> RecordLayout:
        """The layout this one widens to: its format's own record."""
        return RecordLayout.for_expert(self.format, self.dim, self.inter_dim)

    def code_parts(self) -> list[tuple[RecordPart, int, int]]:
        """(part, its code bits, where its widened bytes start in the wide record) of each part holding codes."""
        wide, out = self.wide(), []
        for p in self.parts:
            if p.name in MATRICES or p.name == "w13":
                # w3's rows follow w1's in the wide w13
                at = wide.part("w2" if p.name == "w2" else "w13").offset
                at += self.inter_dim * self.dim // 2 if p.name == "w3" else 0
                out.append((p, self.bits_of("w1" if p.name == "w13" else p.name), at))
        return out

    def widen(self, buf: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
        """Torch reference: a cold record's bytes -> the record of its format (uint8 [wide().nbytes], on buf's device
        if a tensor). kernels/fp4/widen.py does the same on CUDA."""
        wide, parts = self.wide(), self.unpack(buf)
        for p, bits, _ in self.code_parts():
            parts[p.name] = widen(parts[p.name], bits) if bits != EXACT_BITS else parts[p.name]
        if "w1" in parts:
            parts["w13"] = torch.cat([parts["w1"], parts["w3"]])
        return wide.pack_tensor(parts)

    def narrow(self, buf: bytes | bytearray | memoryview | torch.Tensor, bits: int | Bits) -> torch.Tensor:
        """This (exact) record's matrices narrowed to cold codes of `bits` (one width, or gate, up, down): the cold
        record's bytes (uint8 on buf's device if a tensor). NVFP4's global scales stay; a matrix kept at 4 bits keeps
        its codes and block scales, every other block scale is chosen anew (layout/cold.py)."""
        if self.cold:
            raise FormatError(f"a record of {self.code_bits} bit codes cannot be narrowed again")
        cold, parts = self.cold_of(bits), self.unpack(buf)
        g = parts["scale_2"] if self.format == "nvfp4" else None
        mats = {}
        for k, m in enumerate(MATRICES):
            b = cold.code_bits[k]
            if b == EXACT_BITS:
                mats[m] = self.stored(buf, m)[:2]
            else:
                mats[m] = narrow(self.format, self.matrix(buf, m), b, g[k] if g is not None else None)
        parts |= {"w1": mats["w1"][0], "w3": mats["w3"][0], "w2": mats["w2"][0], "w2_scale": mats["w2"][1]}
        if cold.code_bits[0] == cold.code_bits[1]:
            parts["w13"] = torch.cat([parts["w1"], parts["w3"]])
        parts["w13_scale"] = torch.cat([mats["w1"][1], mats["w3"][1]])
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
        their block scales and for NVFP4 its global scale); a cold matrix's codes come widened (a new tensor)."""
        raw = self._raw(buf)
        return self._fp4(
            tuple(raw[at : at + n].view(TORCH_DTYPES[dt]).reshape(shape) for dt, at, n, shape in self.spans(which)),
            which,
        )

    def _fp4(self, stored: tuple[torch.Tensor, ...], which: str) -> tuple[torch.Tensor, ...]:
        bits = self.bits_of(which)
        return (widen(stored[0], bits), *stored[1:]) if bits != EXACT_BITS else stored

    def spans(self, which: str) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """Where one matrix (w1, w3 or w2) lies in a record, in `stored`'s order: (dtype, byte offset in the record,
        bytes, shape) of its packed rows, of their block scales and, for NVFP4, of its global scale. A reader that
        wants one matrix reads these bytes only."""
        first, count = {"w1": (0, self.inter_dim), "w3": (self.inter_dim, self.inter_dim), "w2": (0, None)}[which]
        base, out = "w2" if which == "w2" else "w13", []
        # gate and up at different bits: each has a codes part of its own
        own = which != "w2" and not any(p.name == "w13" for p in self.parts)
        codes = (self.part(which), 0) if own else (self.part(base), first)
        for p, at in (codes, (self.part(base + "_scale"), first)):
            rows, row = p.shape[0] if count is None else count, p.nbytes // p.shape[0]
            out.append((p.dtype, p.offset + at * row, rows * row, (rows, *p.shape[1:])))
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
        return self._fp4(tuple(spans), which)

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
            **({"code_bits": self._bits_json()} if self.cold else {}),
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
        bits = d.get("code_bits", EXACT_BITS)
        many = isinstance(bits, list) and len(bits) == len(MATRICES) and all(isinstance(b, int) for b in bits)
        if not isinstance(bits, int) and not many:
            raise FormatError(f"code_bits is {bits!r}: one width, or one per matrix (gate, up, down)")
        return cls(d["format"], d["dim"], d["inter_dim"], parts, d["nbytes"], as_bits(bits))

    def _bits_json(self) -> int | list[int]:
        """code_bits as the manifest stores it: one width when the three share it (what layout version 1 reads)."""
        return self.code_bits[0] if len(set(self.code_bits)) == 1 else list(self.code_bits)

    @property
    def uniform(self) -> bool:
        """Every matrix at the same bits (a record layout version 1 can describe)."""
        return len(set(self.code_bits)) == 1


def record_sha256(buf: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(buf).hexdigest()
