"""Format descriptors: each stored weight format as data (block shape, element and scale encodings).

A quantized weight W [N, K] is stored as component tensors named `<base>.<component>`; the descriptor
lists them and gives their shapes and dtypes, so planning, writing and reading never hard-code them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsfp4.errors import FormatError


@dataclass(frozen=True)
class FormatSpec:
    """name: format key. element: element encoding; bits: per element. block: (rows, cols) of elements
    sharing one scale. scale: scale encoding (None: unscaled). global_scale: one more fp32 factor per
    tensor. components: stored tensors as (suffix, safetensors dtype)."""

    name: str
    element: str
    bits: int
    block: tuple[int, int]
    scale: str | None
    global_scale: bool
    components: tuple[tuple[str, str], ...]


FORMATS: dict[str, FormatSpec] = {
    # NVIDIA ModelOpt NVFP4: value = e2m1 * e4m3 block scale (16 along K) * fp32 global scale.
    "nvfp4": FormatSpec(
        "nvfp4", "e2m1", 4, (1, 16), "e4m3", True, (("weight", "U8"), ("scale", "F8_E4M3"), ("scale_2", "F32"))
    ),
    # OCP MXFP4: value = e2m1 * 2^(e8m0 - 127), one scale per 32 along K.
    "mxfp4": FormatSpec("mxfp4", "e2m1", 4, (1, 32), "e8m0", False, (("weight", "U8"), ("scale", "U8"))),
    # DeepSeek's release format: e4m3 weight, fp32 multiplier per 128x128 block (ragged edges allowed).
    "fp8_e4m3_b128": FormatSpec(
        "fp8_e4m3_b128", "e4m3", 8, (128, 128), "f32", False, (("weight", "F8_E4M3"), ("scale", "F32"))
    ),
    # DeepSeek-V4's backbone: e4m3 weight, a power-of-two multiplier 2^(e - 127) per 128x128 block. A source
    # format only: the converter writes its scales as fp32 (exactly the same values), so the backbone is
    # fp8_e4m3_b128 and runs on the FP8 kernels as it is.
    "fp8_e4m3_e8m0_b128": FormatSpec(
        "fp8_e4m3_e8m0_b128", "e4m3", 8, (128, 128), "e8m0", False, (("weight", "F8_E4M3"), ("scale", "U8"))
    ),
    # Plain tensors, stored as they are.
    "bf16": FormatSpec("bf16", "bf16", 16, (1, 1), None, False, (("weight", "BF16"),)),
    "f16": FormatSpec("f16", "f16", 16, (1, 1), None, False, (("weight", "F16"),)),
    "f32": FormatSpec("f32", "f32", 32, (1, 1), None, False, (("weight", "F32"),)),
    # V4's tid2eid table
    "i64": FormatSpec("i64", "i64", 64, (1, 1), None, False, (("weight", "I64"),)),
}

FP4_FORMATS = ("nvfp4", "mxfp4")


def get_format(name: str) -> FormatSpec:
    if name not in FORMATS:
        raise FormatError(f"unknown format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, n - 1).bit_length()


def component_shapes(fmt: FormatSpec, shape: tuple[int, ...], name: str = "tensor") -> list[tuple[int, ...]]:
    """Stored shape of each component of a weight of logical `shape` ([N, K] for scaled formats)."""
    if fmt.scale is None:
        return [tuple(shape)]
    if len(shape) != 2:
        raise FormatError(f"{name}: {fmt.name} needs a 2-D weight, got shape {list(shape)}")
    n, k = shape
    br, bc = fmt.block
    if fmt.element == "e2m1":
        if k % bc:
            raise FormatError(f"{name}: input dim {k} is not a multiple of the {fmt.name} block {bc}")
        shapes = [(n, k // 2), (n, k // bc)]
    else:
        shapes = [(n, k), (ceil_div(n, br), ceil_div(k, bc))]
    return shapes + ([()] if fmt.global_scale else [])


DTYPE_NBYTES = {
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "BF16": 2,
    "F16": 2,
    "I16": 2,
    "F32": 4,
    "I32": 4,
    "F64": 8,
    "I64": 8,
    "BOOL": 1,
}


def shape_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def stored_nbytes(fmt: FormatSpec, shape: tuple[int, ...]) -> int:
    """Bytes of all components of one weight."""
    return sum(
        shape_numel(s) * DTYPE_NBYTES[dt]
        for s, (_, dt) in zip(component_shapes(fmt, shape), fmt.components, strict=True)
    )
