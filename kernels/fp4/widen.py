"""Cold records widened on the device: 2- or 3-bit cold codes to packed e2m1 (layout/cold.py), each matrix at its
recipe's bits (layout/recipe.py; a matrix kept at 4 bits and the scales copied as they are), so the decode and
prefill kernels read the record of its format. Torch reference: RecordLayout.widen; the one
rule of kernels/backend.py picks which runs.

Packed e2m1 byte j holds codes 2j and 2j + 1 (even in the low nibble). They sit side by side in the cold bytes:
2 bits, bits 4(j % 2) .. +4 of cold byte j // 2; 3 bits, bits 6(j % 4) .. +6 of the 24-bit group j // 4.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsfp4.kernels.backend import tl, triton, use_kernels
from dsfp4.layout.recipe import EXACT_BITS
from dsfp4.layout.record import RecordLayout

# output bytes per program
WIDEN_BLOCK = 1024


if triton is not None:

    @triton.jit
    def _widen_kernel(src, dst, lut, n_out, BITS: tl.constexpr, BLOCK: tl.constexpr):
        # output bytes of this program
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = j < n_out
        if BITS == 2:
            pair = (tl.load(src + j // 2, mask=mask, other=0).to(tl.int32) >> (4 * (j % 2))) & 0xF
        else:
            g = (j // 4) * 3
            word = tl.load(src + g, mask=mask, other=0).to(tl.int32)
            word |= tl.load(src + g + 1, mask=mask, other=0).to(tl.int32) << 8
            word |= tl.load(src + g + 2, mask=mask, other=0).to(tl.int32) << 16
            pair = (word >> (6 * (j % 4))) & 0x3F
        low = tl.load(lut + (pair & ((1 << BITS) - 1)), mask=mask, other=0).to(tl.int32)
        high = tl.load(lut + (pair >> BITS), mask=mask, other=0).to(tl.int32)
        tl.store(dst + j, (low | (high << 4)).to(tl.uint8), mask=mask)


def widen_codes(src: torch.Tensor, dst: torch.Tensor, lut: torch.Tensor, bits: int) -> None:
    """The kernel: cold codes src (uint8, contiguous) -> packed e2m1 dst (uint8, 8 / bits times src's bytes / 2).
    lut: cold_to_e2m1(bits) on the device."""
    n_out = dst.numel()
    assert src.numel() * 8 == n_out * 2 * bits, (src.numel(), n_out, bits)
    _widen_kernel[(triton.cdiv(n_out, WIDEN_BLOCK),)](src, dst, lut, n_out, BITS=bits, BLOCK=WIDEN_BLOCK)


def widen_record(src: torch.Tensor, dst: torch.Tensor, cold: RecordLayout, luts: Mapping[int, torch.Tensor]) -> None:
    """A cold record's bytes src (uint8 [>= cold.nbytes]) widened into dst (uint8 [>= cold.wide().nbytes]), on
    the stream current for both. luts: bits -> cold_to_e2m1(bits) on the device (layout/cold.py cold_luts)."""
    wide = cold.wide()
    if not use_kernels(dst):
        dst[: wide.nbytes].copy_(cold.widen(src[: cold.nbytes]))
        return
    codes = {p.name: (bits, at) for p, bits, at in cold.code_parts()}
    for part in cold.parts:
        at = src[part.offset : part.offset + part.nbytes]
        bits, into = codes[part.name] if part.name in codes else (EXACT_BITS, wide.part(part.name).offset)
        n_out = part.nbytes * EXACT_BITS // bits
        if bits == EXACT_BITS:
            # the scales, and a matrix kept exact, as they are
            dst[into : into + n_out].copy_(at)
        else:
            widen_codes(at, dst[into : into + n_out], luts[bits], bits)
