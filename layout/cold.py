"""Cold codes: an FP4 matrix's e2m1 codes narrowed to 2 or 3 bits, for the experts outside a profile's hot set.

Each cold level is an e2m1 value, so widening is exact: a cold matrix widens to an FP4 matrix of its own format
(NVFP4 or MXFP4) with the same block scales, and the decode and prefill kernels never see a cold record (the store
widens it on its way to a device slot). A cold code is sign << (bits - 1) | m, m indexing COLD_MAGNITUDES[bits].
Packing, along K: 2 bits, four codes per byte, element 4j + i at bits 2i; 3 bits, eight codes per three bytes
(24 bits little-endian), element 8j + i at bits 3i.
Legend: N output rows, K input columns, B = K / block.
"""

from __future__ import annotations

import torch

from dsfp4.errors import FormatError
from dsfp4.layout.fp4 import (
    E2M1_MAGNITUDES,
    E4M3_MIN_SUBNORMAL,
    E8M0_BIAS,
    E8M0_NAN,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    e8m0_to_float,
    pack_fp4,
)

COLD_BITS = (2, 3)
# The magnitudes each width keeps: near the Lloyd-Max levels of a Gaussian block scaled to its largest value
# (2 bits: 1 : 3.3; 3 bits: 1 : 3.1 : 5.5 : 8.8).
COLD_MAGNITUDES = {2: (1.0, 3.0), 3: (0.5, 1.5, 3.0, 4.0)}
# Per block, the share of its absolute maximum put on the top level: each is tried, the least squared error wins
# (a block's outlier may cost more clipped than its other values lose to a coarse step).
TOP_SHARES = (1.0, 0.875, 0.75, 0.625)
# rows narrowed together: bounds the working memory of a wide matrix
ROWS_AT_ONCE = 256
# bits -> (codes, bytes) of one packing group
GROUP = {2: (4, 1), 3: (8, 3)}
BLOCKS = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}


def _check_bits(bits: int) -> None:
    if bits not in COLD_BITS:
        raise FormatError(f"cold codes are {' or '.join(map(str, COLD_BITS))} bits wide, not {bits}")


def cold_to_e2m1(bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[2^bits] uint8: the e2m1 code of each cold code."""
    _check_bits(bits)
    mags = [E2M1_MAGNITUDES.index(m) for m in COLD_MAGNITUDES[bits]]
    return torch.tensor(mags + [8 | m for m in mags], dtype=torch.uint8, device=device)


def cold_luts(device: torch.device | str = "cpu") -> dict[int, torch.Tensor]:
    """bits -> cold_to_e2m1(bits): the tables the widening kernel reads, one per width."""
    return {bits: cold_to_e2m1(bits, device) for bits in COLD_BITS}


def cold_values(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Cold codes -> their float32 levels (before the block scale)."""
    levels = torch.tensor(COLD_MAGNITUDES[bits], device=codes.device)
    half = len(COLD_MAGNITUDES[bits])
    mag = levels[(codes % half).long()]
    return torch.where(codes >= half, -mag, mag)


def pack_cold(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [N, K] uint8 (0 .. 2^bits - 1) -> [N, K * bits / 8] uint8."""
    _check_bits(bits)
    n, k = codes.shape
    per, nbytes = GROUP[bits]
    if k % per:
        raise FormatError(f"cannot pack {k} codes of {bits} bits per row: not a multiple of {per}")
    groups = codes.reshape(n, k // per, per).to(torch.int32)
    word = sum(groups[..., i] << (bits * i) for i in range(per))  # [N, K / per]
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(nbytes)], dim=-1).reshape(n, -1).to(torch.uint8)


def unpack_cold(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed: [N, K * bits / 8] uint8 -> codes [N, K] uint8."""
    _check_bits(bits)
    n, (per, nbytes) = packed.shape[0], GROUP[bits]
    b = packed.to(torch.int32).reshape(n, -1, nbytes)
    word = sum(b[..., i] << (8 * i) for i in range(nbytes))  # [N, K / per]
    mask = (1 << bits) - 1
    return torch.stack([(word >> (bits * i)) & mask for i in range(per)], dim=-1).reshape(n, -1).to(torch.uint8)


def widen(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Torch reference of the widening kernel: cold codes [N, K * bits / 8] -> packed e2m1 [N, K / 2]."""
    codes = unpack_cold(packed, bits)
    return pack_fp4(cold_to_e2m1(bits, packed.device)[codes.long()])


def _nearest(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Scaled values -> the nearest cold code (ties to the smaller magnitude; the sign from signbit)."""
    mags = COLD_MAGNITUDES[bits]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(mags, mags[1:], strict=False)], device=x.device)
    m = torch.bucketize(x.abs(), mids).to(torch.uint8)
    return m | (torch.signbit(x).to(torch.uint8) << (bits - 1))


def _scale_candidates(fmt: str, amax: torch.Tensor, top: float, g: torch.Tensor | None) -> list[torch.Tensor]:
    """Each TOP_SHARES candidate's block scale, representable in the format: NVFP4 an e4m3 multiple of the global
    scale g (the e4m3 factor returned: the stored scale), MXFP4 a power of two (its e8m0 byte returned)."""
    out = []
    for share in TOP_SHARES:
        target = amax * share / top  # [rows, B]
        if fmt == "nvfp4":
            s = (target / g).to(torch.float8_e4m3fn).float()
            # zero blocks too: their codes are +-m0
            s = torch.where(s == 0, torch.full_like(s, E4M3_MIN_SUBNORMAL), s)
            out.append(s)
        else:
            mant, exp = torch.frexp(target)
            # the smallest power of two >= target
            exp = exp - (mant == 0.5).to(exp.dtype)
            biased = torch.where(target > 0, exp + E8M0_BIAS, torch.zeros_like(exp)).clamp(0, E8M0_NAN - 1)
            out.append(biased.to(torch.float32))
    return out


def narrow(fmt: str, w: torch.Tensor, bits: int, g: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] dense -> (cold codes packed [N, K * bits / 8], block scales [N, B] in the format's scale dtype:
    e4m3 for NVFP4, relative to the global scale g, which the caller keeps; e8m0 bytes for MXFP4). Per block the
    scale with the least squared error among TOP_SHARES wins."""
    _check_bits(bits)
    if fmt not in BLOCKS or (fmt == "nvfp4") != (g is not None):
        raise FormatError(f"cold codes narrow nvfp4 (with its global scale) or mxfp4, not {fmt}")
    block, top = BLOCKS[fmt], COLD_MAGNITUDES[bits][-1]
    codes_out, scales_out = [], []
    for r0 in range(0, w.shape[0], ROWS_AT_ONCE):
        blocks = w[r0 : r0 + ROWS_AT_ONCE].float().reshape(-1, w.shape[1] // block, block)  # [rows, B, block]
        amax = blocks.abs().amax(dim=-1)
        best_err, best_codes, best_scale = None, None, None
        for s in _scale_candidates(fmt, amax, top, g):
            factor = s * g if fmt == "nvfp4" else e8m0_to_float(s.to(torch.int32))  # [rows, B]
            codes = _nearest(blocks / factor[..., None], bits)
            err = ((cold_values(codes, bits) * factor[..., None] - blocks) ** 2).sum(dim=-1)  # [rows, B]
            if best_err is None:
                best_err, best_codes, best_scale = err, codes, s
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_codes = torch.where(better[..., None], codes, best_codes)
            best_scale = torch.where(better, s, best_scale)
        codes_out.append(pack_cold(best_codes.flatten(1), bits))
        scales_out.append(best_scale.to(torch.float8_e4m3fn) if fmt == "nvfp4" else best_scale.to(torch.uint8))
    return torch.cat(codes_out), torch.cat(scales_out)
