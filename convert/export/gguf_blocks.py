"""MXFP4 rows between dsfp4's layout and GGUF's block (GGML_TYPE_MXFP4): the same codes and scales, moved.

dsfp4 keeps a row as packed codes [K/2] (byte j: element 2j in the low nibble, 2j+1 in the high) and E8M0 scales
[K/32]. GGUF keeps it as K/32 blocks of 17 bytes: the block's E8M0 scale, then 16 bytes whose low nibbles hold
elements 0-15 of the block and whose high nibbles hold elements 16-31. The codes (E2M1: sign bit, then magnitude) and
the scales (2^(e - 127)) mean the same in both, so the repack is lossless both ways. Legend: N rows, K columns.
"""

from __future__ import annotations

import numpy as np

# elements per MXFP4 block
BLOCK = 32
# a block's scale byte and its 16 bytes of codes
GGUF_BLOCK_BYTES = 1 + BLOCK // 2


def _codes(packed: np.ndarray) -> np.ndarray:
    """packed [N, K/2] u8 (element 2j low) -> codes [N, K] u8."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def mxfp4_to_gguf(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """packed [N, K/2] u8, scale [N, K/32] u8 (E8M0) -> GGUF rows [N, K/32 * 17] u8."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % BLOCK or scale.shape != (n, k // BLOCK):
        raise ValueError(f"MXFP4 rows of {k} elements need {k // BLOCK} scales each and a multiple of {BLOCK}")
    codes = _codes(packed).reshape(n, k // BLOCK, BLOCK)  # [N, K/32, 32]
    qs = codes[:, :, : BLOCK // 2] | (codes[:, :, BLOCK // 2 :] << 4)  # [N, K/32, 16]
    return np.concatenate([scale.reshape(n, k // BLOCK, 1), qs], axis=2).reshape(n, -1)


def gguf_to_mxfp4(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF rows [N, B * 17] u8 -> (packed [N, 16 B] u8, scale [N, B] u8): mxfp4_to_gguf's inverse."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, GGUF_BLOCK_BYTES)  # [N, B, 17]
    scale, qs = blocks[:, :, 0], blocks[:, :, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, -1)  # [N, K]
    return codes[:, 0::2] | (codes[:, 1::2] << 4), np.ascontiguousarray(scale)
