"""One routed expert on its FP4 record: y = W2 (silu(W1 x) * (W3 x)).

`expert_ffn` is the interface the MoE layer calls with the record exactly as stored (no dequantized
copies kept): on CUDA it runs the Triton FP4 matmul (gate and up fused into one), elsewhere the torch
reference `expert_ffn_ref`. Legend: T tokens, D dim, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsfp4.kernels.fp4_matmul import fp4_matmul, triton
from dsfp4.layout.record import RecordLayout


def expert_ffn_ref(x: torch.Tensor, record: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """x: [T, D], record: [nbytes] uint8 -> [T, D] in x's dtype."""
    w1, w3, w2 = layout.dequantize(record, dtype=x.dtype)  # [I, D], [I, D], [D, I]
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def expert_ffn_triton(x: torch.Tensor, record: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """The same through fp4_matmul: one launch for gate+up [T, 2I], one for down."""
    p = layout.unpack(record)
    i, fmt = layout.inter_dim, layout.format
    g = p.get("scale_2")  # NVFP4 global scales of w1, w3, w2 (views into the record); MXFP4 has none
    h = fp4_matmul(x, p["w13"], p["w13_scale"].view(torch.uint8), g if g is None else g[:2], i, fmt)  # [T, 2I]
    a = F.silu(h[:, :i]) * h[:, i:]
    g2 = g if g is None else g[2:]  # split = D: every row takes the one w2 scale
    return fp4_matmul(a, p["w2"], p["w2_scale"].view(torch.uint8), g2, layout.dim, fmt).to(x.dtype)


def expert_ffn(x: torch.Tensor, record: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    if x.is_cuda and triton is not None:
        return expert_ffn_triton(x, record, layout)
    return expert_ffn_ref(x, record, layout)


def warm_up(layout: RecordLayout, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the Triton kernels for this record layout and dtype before the first token is timed."""
    if device.type != "cuda" or triton is None:
        return
    record = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    for tokens in (1, 17):  # the decode and the prefill block shapes
        expert_ffn_triton(torch.zeros(tokens, layout.dim, dtype=dtype, device=device), record, layout)
