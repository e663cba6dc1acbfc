"""FP8 e4m3 with one fp32 multiplier per 128x128 block: DeepSeek's release format, as pure torch functions.

W[i, j] = float(q[i, j]) * scale[i // 128, j // 128]; the scale grid is [ceil(N/128), ceil(K/128)], so
edge blocks may be partial (kv_a_proj_with_mqa has 576 rows: a [5, 56] grid).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsfp4.errors import FormatError
from dsfp4.layout.formats import FORMATS, ceil_div
from dsfp4.layout.fp4 import E4M3_MAX, E8M0_NAN, check_finite, e8m0_to_float, exact_div

FP8_BLOCK = FORMATS["fp8_e4m3_b128"].block[0]


def scale_grid(shape: tuple[int, ...]) -> tuple[int, int]:
    n, k = shape
    return ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)


def e8m0_scales(scale: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """E8M0 block scales (bytes, as uint8 or float8_e8m0fnu) -> the same values in fp32, exactly: every
    2^(b - 127) for b in 0..254 is an fp32 number (b = 0 a subnormal)."""
    b = scale.view(torch.uint8)
    if bool((b == E8M0_NAN).any()):
        raise FormatError(f"{name}: e8m0 scale byte 255 (NaN) found; the tensor is corrupt")
    return e8m0_to_float(b)


def _padded_blocks(w: torch.Tensor) -> torch.Tensor:
    """w: [N, K] -> [Nb, 128, Kb, 128], zero-padded at ragged edges."""
    n, k = w.shape
    nb, kb = scale_grid((n, k))
    if (nb * FP8_BLOCK, kb * FP8_BLOCK) != (n, k):
        w = F.pad(w, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    return w.reshape(nb, FP8_BLOCK, kb, FP8_BLOCK)


def fp8_block_dequantize(
    q: torch.Tensor, scale: torch.Tensor, name: str = "tensor", dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """q: [N, K] e4m3, scale: [ceil(N/128), ceil(K/128)] fp32 -> w [N, K] in `dtype`.

    The product is taken in fp32 and rounded once to `dtype` (bf16 by default, as DeepSeek's and
    NVIDIA's conversion scripts do, so our FP4 output reproduces theirs).
    """
    if q.dim() != 2 or tuple(scale.shape) != scale_grid(tuple(q.shape)):
        raise FormatError(
            f"{name}: scale shape {list(scale.shape)} does not fit weight shape "
            f"{list(q.shape)} (expected {list(scale_grid(tuple(q.shape)))})"
        )
    n, k = q.shape
    blocks = _padded_blocks(q.float()) * scale.float()[:, None, :, None]
    return blocks.reshape(blocks.shape[0] * FP8_BLOCK, -1)[:n, :k].to(dtype)


def fp8_block_quantize(w: torch.Tensor, name: str = "tensor", pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (q [N, K] e4m3, scale [ceil(N/128), ceil(K/128)] fp32), scale = block amax / 448, or with
    `pow2` the power of two at or above it (the E8M0 scales DeepSeek-V4 ships)."""
    if w.dim() != 2:
        raise FormatError(f"{name}: fp8 block quantization needs a 2-D weight, got {list(w.shape)}")
    check_finite(w, name)
    n, k = w.shape
    blocks = _padded_blocks(w.float())  # [Nb, 128, Kb, 128]
    amax = blocks.abs().amax(dim=(1, 3))  # [Nb, Kb]
    scale = torch.where(amax > 0, exact_div(amax, E4M3_MAX), torch.ones_like(amax))
    if pow2:
        # scale = mant * 2^exp, mant in [0.5, 1): 2^exp is above it
        mant, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - (mant == 0.5).to(exp.dtype))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(blocks.shape[0] * FP8_BLOCK, -1)[:n, :k].contiguous(), scale
