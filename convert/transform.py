"""Per-tensor work of a conversion: decode a source weight, encode it in its target format, measure the
error; or copy its bytes unchanged when source and target formats agree.

Large matrices are decoded and encoded a slab of rows at a time: every format here is row-independent
once the global amax is fixed (FP8 blocks are 128 rows, so slabs are multiples of 128 rows), so the bytes
equal a whole-matrix encode while the fp32 temporaries stay bounded. Legend: N rows, K columns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsfp4.convert.names.rules import MappedTensor
from dsfp4.convert.plan import OutTensor
from dsfp4.convert.source.checkpoint import SourceCheckpoint
from dsfp4.layout.formats import FORMATS, ceil_div
from dsfp4.layout.fp8 import FP8_BLOCK, e8m0_scales
from dsfp4.layout.quant import dequantize, quantize
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.safetensors_file import (
    CHUNK,
    TORCH_DTYPES,
    SafetensorsWriter,
    check_finite_bytes,
    pread_exact,
    pwrite_all,
)

# Elements decoded at once: small on the CPU (cache-friendly, bounded RSS), large on a GPU (fewer launches).
SLAB_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


@dataclass
class ErrorStats:
    """Sums for the relative RMS error ||ref - q|| / ||ref|| of one class of tensors."""

    sse: float = 0.0
    ssr: float = 0.0

    def add(self, ref: torch.Tensor, approx: torch.Tensor) -> None:
        ref = ref.float()
        sums = torch.stack(
            [(ref - approx.float()).square().sum(dtype=torch.float64), ref.square().sum(dtype=torch.float64)]
        )
        # one device sync for both
        sse, ssr = sums.tolist()
        self.sse += sse
        self.ssr += ssr

    def merge(self, other: ErrorStats) -> None:
        self.sse += other.sse
        self.ssr += other.ssr

    @property
    def relative_rms(self) -> float:
        return (self.sse / self.ssr) ** 0.5 if self.ssr > 0 else 0.0


def read_parts(src: SourceCheckpoint, item: MappedTensor, device: torch.device) -> list[torch.Tensor]:
    """A weight's components as its format types them (V4's int8 codes and float8_e8m0 scales are read as
    the bytes they are: uint8)."""
    return [src.read(item.sources[c]).view(TORCH_DTYPES[dt]).to(device) for c, dt in FORMATS[item.storage].components]


class DenseSource:
    """One source weight held in its stored (compact) form, decoded a slab of rows at a time: FP8 through
    bf16, as DeepSeek's and NVIDIA's scripts do (so NVFP4 made from it matches theirs), others to fp32."""

    def __init__(self, src: SourceCheckpoint, item: MappedTensor, device: torch.device):
        self.item = item
        self.parts = read_parts(src, item, device)
        self.spec = FORMATS[item.storage]
        self.dtype = torch.bfloat16 if self.spec.element == "e4m3" else torch.float32
        self.n_rows = item.shape[0]
        cols = item.shape[1] if len(item.shape) > 1 else 1
        slab = SLAB_ELEMENTS.get(device.type, SLAB_ELEMENTS["cuda"]) // cols
        self.slab = max(FP8_BLOCK, slab // FP8_BLOCK * FP8_BLOCK)
        # the amax pass keeps a lone slab
        self._last: tuple[int, int, torch.Tensor] | None = None

    def slabs(self) -> list[tuple[int, int]]:
        return [(r, min(r + self.slab, self.n_rows)) for r in range(0, self.n_rows, self.slab)]

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """Decoded rows [r0, r1); r0 is a multiple of 128."""
        if self._last is not None and self._last[:2] == (r0, r1):
            return self._last[2]
        # 128-row blocks share a scale row
        if self.spec.element == "e4m3":
            w, s = self.parts
            parts = [w[r0:r1], s[r0 // FP8_BLOCK : ceil_div(r1, FP8_BLOCK)]]
        else:
            # row-wise components, then a global scale (nvfp4)
            n_rowwise = len(self.parts) - self.spec.global_scale
            parts = [p[r0:r1] for p in self.parts[:n_rowwise]] + self.parts[n_rowwise:]
        return dequantize(self.item.storage, parts, self.item.ref, dtype=self.dtype)

    def amax(self) -> torch.Tensor:
        slabs = self.slabs()
        # decode once: encode() asks for the same rows next
        if len(slabs) == 1:
            self._last = (*slabs[0], self.rows(*slabs[0]))
        return torch.stack([self.rows(*s).abs().max().float() for s in slabs]).max()


def encode(
    fmt: str, sources: list[DenseSource], name: str, stats: ErrorStats, amax_from: list[DenseSource] = ()
) -> list[torch.Tensor]:
    """Encode the row-wise concatenation of `sources` in `fmt` slab by slab; returns the components.
    For nvfp4 one global scale covers them all, from the joint amax of `sources` and `amax_from` (gate and
    up share one, as in NVIDIA's exports)."""
    amax = torch.stack([s.amax() for s in (*sources, *amax_from)]).max() if fmt == "nvfp4" else None
    chunks: list[list[torch.Tensor]] = []
    for s in sources:
        for r0, r1 in s.slabs():
            w = s.rows(r0, r1)
            parts = quantize(fmt, w, name, amax)
            stats.add(w, dequantize(fmt, parts, name))
            chunks.append(list(parts))
    # the global scale (last component) is the same in every slab: it depends only on the shared amax
    n_rowwise = len(chunks[0]) - FORMATS[fmt].global_scale
    return [torch.cat([c[i] for c in chunks]) for i in range(n_rowwise)] + chunks[0][n_rowwise:]


def copy_tensor(src: SourceCheckpoint, name: str, writer: SafetensorsWriter, dest: str) -> None:
    """Copy a tensor's bytes from the source into the output file, in chunks (bounded memory)."""
    fd, offset, nbytes = src.fd_span(name)
    out_offset, out_nbytes = writer.span(dest)
    if out_nbytes != nbytes:
        raise ValueError(f"{name}: {nbytes} bytes cannot fill {dest} ({out_nbytes} planned)")
    st = src.tensors[name]
    for pos in range(0, nbytes, CHUNK):
        chunk = pread_exact(fd, min(CHUNK, nbytes - pos), offset + pos, src.path)
        check_finite_bytes(chunk, st.info.dtype, f"{name} in {st.shard}")
        pwrite_all(writer.fd, memoryview(chunk.numpy()), out_offset + pos)
    writer.mark_written(dest)
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def write_backbone_tensor(
    src: SourceCheckpoint, out: OutTensor, writer: SafetensorsWriter, device: torch.device
) -> ErrorStats | None:
    """Place one backbone weight in the output file; returns its error (None when copied bit-exact)."""
    if out.is_copy:
        for comp, name in out.item.sources.items():
            copy_tensor(src, name, writer, out.names[comp])
        return None
    if out.item.storage == "fp8_e4m3_e8m0_b128" and out.format == "fp8_e4m3_b128":
        # the same e4m3 bytes; each power-of-two scale written as the fp32 number it is (no rounding)
        copy_tensor(src, out.item.sources["weight"], writer, out.names["weight"])
        writer.write(out.names["scale"], e8m0_scales(src.read(out.item.sources["scale"]), out.item.sources["scale"]))
        return None
    stats = ErrorStats()
    partner = [DenseSource(src, out.amax_partner, device)] if out.amax_partner else []
    parts = encode(out.format, [DenseSource(src, out.item, device)], out.item.sources["weight"], stats, partner)
    for (comp, _), t in zip(FORMATS[out.format].components, parts, strict=True):
        writer.write(out.names[comp], t)
    return stats


def expert_record(
    src: SourceCheckpoint,
    trio: tuple[MappedTensor, MappedTensor, MappedTensor],
    layout: RecordLayout,
    device: torch.device,
) -> tuple[memoryview, ErrorStats | None]:
    """One expert's record from its (w1, w3, w2) sources; repacked byte for byte when they are already
    stored in the record's format, else quantized (error returned)."""
    w1, w3, w2 = trio
    fmt = layout.format
    if all(i.storage == fmt for i in trio):
        comps = [c for c, _ in FORMATS[fmt].components]
        raw = [dict(zip(comps, read_parts(src, i, torch.device("cpu")), strict=True)) for i in trio]
        for i, parts in zip(trio, raw, strict=True):
            for c, t in parts.items():
                info = src.tensors[i.sources[c]].info
                check_finite_bytes(t.reshape(-1).view(torch.uint8), info.dtype, i.sources[c])
        tensors = {
            "w13": torch.cat([raw[0]["weight"], raw[1]["weight"]]),
            "w13_scale": torch.cat([raw[0]["scale"], raw[1]["scale"]]),
            "w2": raw[2]["weight"],
            "w2_scale": raw[2]["scale"],
        }
        if "scale_2" in raw[0]:
            tensors["scale_2"] = torch.stack([r["scale_2"].reshape(()) for r in raw])
        return layout.pack(tensors), None
    stats = ErrorStats()
    gate_up = [DenseSource(src, w1, device), DenseSource(src, w3, device)]  # [2I, D], one global scale
    q13 = encode(fmt, gate_up, f"{w1.sources['weight']} + {w3.sources['weight']}", stats)
    q2 = encode(fmt, [DenseSource(src, w2, device)], w2.sources["weight"], stats)
    tensors = {"w13": q13[0], "w13_scale": q13[1], "w2": q2[0], "w2_scale": q2[1]}
    if fmt == "nvfp4":
        tensors["scale_2"] = torch.stack([q13[2], q13[2], q2[2]])
    return layout.pack(tensors), stats
