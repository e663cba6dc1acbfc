"""Per-tensor work of a conversion: decode a source weight, encode it in its target format, measure the
error; or copy its bytes unchanged when source and target formats agree.

Legend: D model dim, I expert width.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsfp4.convert.hf_names import MappedTensor
from dsfp4.convert.plan import OutTensor
from dsfp4.convert.source import SourceCheckpoint
from dsfp4.layout.formats import FORMATS
from dsfp4.layout.quant import dequantize, quantize
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.safetensors_file import CHUNK, SafetensorsWriter, pread_exact, pwrite_all


@dataclass
class ErrorStats:
    """Sums for the relative RMS error ||ref - q|| / ||ref|| of one class of tensors."""

    sse: float = 0.0
    ssr: float = 0.0

    def add(self, ref: torch.Tensor, approx: torch.Tensor) -> None:
        ref = ref.float()
        self.sse += (ref - approx.float()).square().sum(dtype=torch.float64).item()
        self.ssr += ref.square().sum(dtype=torch.float64).item()

    def merge(self, other: ErrorStats) -> None:
        self.sse += other.sse
        self.ssr += other.ssr

    @property
    def relative_rms(self) -> float:
        return (self.sse / self.ssr) ** 0.5 if self.ssr > 0 else 0.0


def read_dense(src: SourceCheckpoint, item: MappedTensor, device: torch.device) -> torch.Tensor:
    """A source weight decoded to dense values: FP8 through bf16, as DeepSeek's and NVIDIA's scripts do
    (so NVFP4 made from it matches theirs), other storage to fp32."""
    parts = [src.read(item.sources[c]).to(device) for c, _ in FORMATS[item.storage].components]
    dtype = torch.bfloat16 if item.storage == "fp8_e4m3_b128" else torch.float32
    return dequantize(item.storage, parts, item.ref, dtype=dtype)


def copy_tensor(src: SourceCheckpoint, name: str, writer: SafetensorsWriter, dest: str) -> None:
    """Copy a tensor's bytes from the source into the output file, in chunks (bounded memory)."""
    fd, offset, nbytes = src.fd_span(name)
    out_offset, out_nbytes = writer.span(dest)
    if out_nbytes != nbytes:
        raise ValueError(f"{name}: {nbytes} bytes cannot fill {dest} ({out_nbytes} planned)")
    for pos in range(0, nbytes, CHUNK):
        chunk = pread_exact(fd, min(CHUNK, nbytes - pos), offset + pos, src.path)
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
    w = read_dense(src, out.item, device)
    parts = quantize(out.format, w, out.item.sources["weight"])
    for (comp, _), t in zip(FORMATS[out.format].components, parts, strict=True):
        writer.write(out.names[comp], t)
    stats = ErrorStats()
    stats.add(w, dequantize(out.format, parts, out.item.ref))
    return stats


def expert_record(
    src: SourceCheckpoint,
    trio: tuple[MappedTensor, MappedTensor, MappedTensor],
    layout: RecordLayout,
    device: torch.device,
) -> tuple[bytearray, ErrorStats | None]:
    """One expert's record from its (w1, w3, w2) sources; repacked byte for byte when they are already
    stored in the record's format, else quantized (error returned)."""
    w1, w3, w2 = trio
    fmt = layout.format
    if all(i.storage == fmt for i in trio):
        raw = [{c: src.read(s) for c, s in i.sources.items()} for i in trio]
        tensors = {
            "w13": torch.cat([raw[0]["weight"], raw[1]["weight"]]),
            "w13_scale": torch.cat([raw[0]["scale"], raw[1]["scale"]]),
            "w2": raw[2]["weight"],
            "w2_scale": raw[2]["scale"],
        }
        if "scale_2" in raw[0]:
            tensors["scale_2"] = torch.stack([r["scale_2"].reshape(()) for r in raw])
        return layout.pack(tensors), None
    d1, d3, d2 = (read_dense(src, i, device) for i in trio)
    w13 = torch.cat([d1, d3])  # [2I, D]; gate and up share one global scale (their joint amax)
    del d1, d3
    q13 = quantize(fmt, w13, f"{w1.sources['weight']} + {w3.sources['weight']}")
    q2 = quantize(fmt, d2, w2.sources["weight"])
    tensors = {"w13": q13[0], "w13_scale": q13[1], "w2": q2[0], "w2_scale": q2[1]}
    if fmt == "nvfp4":
        tensors["scale_2"] = torch.stack([q13[2], q13[2], q2[2]])
    stats = ErrorStats()
    stats.add(w13, dequantize(fmt, q13))
    stats.add(d2, dequantize(fmt, q2))
    return layout.pack(tensors), stats
