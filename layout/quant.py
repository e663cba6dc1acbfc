"""quantize / dequantize by format name: one entry point over the pure functions in fp4.py and fp8.py.

Components are returned and taken in the order of FORMATS[fmt].components.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsfp4.errors import FormatError
from dsfp4.layout import fp4, fp8
from dsfp4.layout.formats import get_format

PLAIN_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i64": torch.int64}
# read from checkpoints, never written
SOURCE_ONLY = ("fp8_e4m3_e8m0_b128",)


def quantize(
    fmt: str, w: torch.Tensor, name: str = "tensor", amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Encode w [N, K] in `fmt`; `amax` (nvfp4 only) overrides the tensor's own maximum."""
    get_format(fmt)
    if fmt in SOURCE_ONLY:
        raise FormatError(f"{name}: {fmt} is a source format; dsfp4 does not encode weights in it")
    if amax is not None and fmt != "nvfp4":
        raise FormatError(f"{name}: a shared amax only applies to nvfp4, not {fmt}")
    if fmt == "nvfp4":
        return fp4.nvfp4_quantize(w, name, amax)
    if fmt == "mxfp4":
        return fp4.mxfp4_quantize(w, name)
    if fmt == "fp8_e4m3_b128":
        return fp8.fp8_block_quantize(w, name)
    fp4.check_finite(w, name)
    return (w.to(PLAIN_DTYPES[fmt]),)


def dequantize(
    fmt: str, parts: Sequence[torch.Tensor], name: str = "tensor", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode the components of one weight stored in `fmt` to a dense tensor of `dtype`."""
    spec = get_format(fmt)
    if len(parts) != len(spec.components):
        raise FormatError(f"{name}: {fmt} needs {len(spec.components)} components, got {len(parts)}")
    if fmt == "nvfp4":
        return fp4.nvfp4_dequantize(*parts, dtype=dtype)
    if fmt == "mxfp4":
        return fp4.mxfp4_dequantize(*parts, dtype=dtype, name=name)
    if fmt == "fp8_e4m3_b128":
        return fp8.fp8_block_dequantize(*parts, name=name, dtype=dtype)
    if fmt == "fp8_e4m3_e8m0_b128":
        return fp8.fp8_block_dequantize(parts[0], fp8.e8m0_scales(parts[1], name), name=name, dtype=dtype)
    return parts[0].to(dtype)
