"""FP4 (e2m1) weight formats as pure torch functions: NVFP4 (NVIDIA ModelOpt) and MXFP4 (OCP).

Legend: N output rows, K input columns (the block axis), B = K / block.
Packing follows NVIDIA's published checkpoints: two codes per byte along K, the even element in the
low nibble. Codes are sign << 3 | magnitude index into E2M1_MAGNITUDES.
"""

from __future__ import annotations

import torch

from dsfp4.errors import FormatError

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
# Midpoints between neighbouring magnitudes: a value on one rounds to the even code (round half to even).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


def exact_div(a: torch.Tensor, c: float) -> torch.Tensor:
    """a / c correctly rounded on every device: PyTorch's CUDA kernels multiply by 1/c when c is a Python
    scalar, which can differ from the CPU in the last bit and change an encoded byte."""
    return a / torch.full_like(a, c)


def e8m0_to_float(biased: torch.Tensor) -> torch.Tensor:
    """2^(b - 127) for e8m0 bytes b in 0..254, built from exponent bits: exact on every device."""
    b = biased.to(torch.int32)
    normal = (b << 23).view(torch.float32)
    return torch.where(b == 0, torch.full_like(normal, 2.0**-127), normal)


def check_finite(w: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise FormatError(f"{name}: contains NaN or Inf values; the source weight is corrupt")


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to the nearest e2m1 code (ties to even, saturating at +-6).

    The sign comes from signbit, so -0.0 gives code 8 and every code round-trips; ModelOpt tests x < 0
    and writes code 0 for an exact -0.0 (the only difference; both decode to zero)."""
    mag = x.abs().float()
    mids = torch.tensor(_E2M1_MIDPOINTS, device=x.device)
    # number of midpoints strictly below |x|: the code, rounding exact midpoints down ...
    idx = torch.bucketize(mag, mids, out_int32=True).to(torch.uint8)
    # ... which is right except on the midpoints whose lower neighbour has an odd code
    idx += (mag == 0.75) | (mag == 1.75) | (mag == 3.5)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15: sign, 2 exponent bits, 1 mantissa bit) -> float32 values, computed rather than looked
    up in a table made on the host, so a dequantization can run inside a CUDA graph's capture."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    # E2M1_MAGNITUDES[c & 7]
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).float()) * (1 + 0.5 * m))
    return torch.where(c >= 8, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., K] uint8 (0..15) -> [..., K/2] uint8, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise FormatError(f"cannot pack an odd number ({codes.shape[-1]}) of fp4 codes per row")
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed: [..., K/2] uint8 -> codes [..., K] uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _blocks(w: torch.Tensor, block: int, name: str) -> torch.Tensor:
    if w.dim() != 2:
        raise FormatError(f"{name}: fp4 quantization needs a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    if k % block:
        raise FormatError(f"{name}: input dim {k} is not a multiple of the fp4 block size {block}")
    check_finite(w, name)
    return w.float().reshape(n, k // block, block)  # [N, B, block]


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 global scale = amax / (6 * 448), so the largest block scale lands on e4m3's maximum."""
    amax = amax.float()
    return torch.where(amax > 0, exact_div(amax, E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def nvfp4_quantize(
    w: torch.Tensor, name: str = "tensor", amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (packed [N, K/2] u8, scale [N, K/16] e4m3, scale_2 [] f32).

    `amax` overrides the tensor's own absolute maximum; gate and up projections pass the larger of the
    two so that they share one global scale, as NVIDIA's checkpoints do.
    """
    blocks = _blocks(w, NVFP4_BLOCK, name)
    g = nvfp4_global_scale(blocks.abs().amax() if amax is None else amax).to(blocks.device)
    block_amax = blocks.abs().amax(dim=-1)  # [N, B]
    scale = (block_amax / (E2M1_MAX * g)).to(torch.float8_e4m3fn).float()
    # All-zero blocks get scale 1 (as ModelOpt does). A non-zero block whose scale underflows e4m3
    # gets the smallest subnormal instead of 0, so its largest values survive.
    scale = torch.where(block_amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(scale == 0, torch.full_like(scale, E4M3_MIN_SUBNORMAL), scale)
    codes = e2m1_encode(blocks / (scale * g)[..., None])  # [N, B, 16]
    return pack_fp4(codes.flatten(1)), scale.to(torch.float8_e4m3fn), g.reshape(())


def nvfp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(packed [N, K/2], scale [N, K/16] e4m3, scale_2 []) -> w [N, K]."""
    values = e2m1_decode(unpack_fp4(packed))  # [N, K]
    n, k = values.shape
    w = values.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK) * scale.float()[..., None]
    return (w.reshape(n, k) * scale_2.float()).to(dtype)


def mxfp4_quantize(w: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (packed [N, K/2] u8, scale [N, K/32] e8m0 as u8).

    The block exponent is ceil(log2(amax / 6)), so no element clips (ModelOpt's choice); all-zero blocks
    get 2^0.
    """
    blocks = _blocks(w, MXFP4_BLOCK, name)
    target = exact_div(blocks.abs().amax(dim=-1), E2M1_MAX)  # [N, B]
    # target = mant * 2^exp, mant in [0.5, 1)
    mant, exp = torch.frexp(target)
    # exact powers of two need no rounding up
    exp = exp - (mant == 0.5).to(exp.dtype)
    biased = torch.where(target > 0, exp + E8M0_BIAS, torch.full_like(exp, E8M0_BIAS))
    biased = biased.clamp(0, E8M0_NAN - 1)
    codes = e2m1_encode(blocks / e8m0_to_float(biased)[..., None])
    return pack_fp4(codes.flatten(1)), biased.to(torch.uint8)


def mxfp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "tensor"
) -> torch.Tensor:
    """(packed [N, K/2], scale [N, K/32] u8) -> w [N, K]."""
    if bool((scale == E8M0_NAN).any()):
        raise FormatError(f"{name}: e8m0 scale byte 255 (NaN) found; the tensor is corrupt")
    values = e2m1_decode(unpack_fp4(packed))
    n, k = values.shape
    w = values.reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK) * e8m0_to_float(scale)[..., None]
    return w.reshape(n, k).to(dtype)
