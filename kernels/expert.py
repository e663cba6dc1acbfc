"""One routed expert on its FP4 record: y = W2 (silu(W1 x) * (W3 x)).

`expert_ffn` is the interface the MoE layer calls with the record exactly as stored (no dequantized
copies kept); `expert_ffn_ref` is the torch reference (decode the record, then dense matmuls). The
kernels issue puts fused Triton kernels behind the same call. Legend: T tokens, D dim, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsfp4.layout.record import RecordLayout


def expert_ffn_ref(x: torch.Tensor, record: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """x: [T, D], record: [nbytes] uint8 -> [T, D] in x's dtype."""
    w1, w3, w2 = layout.dequantize(record, dtype=x.dtype)  # [I, D], [I, D], [D, I]
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def expert_ffn(x: torch.Tensor, record: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    return expert_ffn_ref(x, record, layout)
