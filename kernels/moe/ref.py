"""The routed-expert interface: every token's top-k experts computed on FP4 records, weighted and summed.

    y[t] = sum_j  weights[t, j] * W2_e (silu(W1_e x[t]) * (W3_e x[t])),   e = ids[t, j]

Records are found on the device: `offsets[e]` is the byte offset of expert e's record from the address
of `records` (the device slot pool), or ABSENT when the expert takes no part in this call (its terms are
left out, which lets a caller split a layer into waves). An offset may point outside `records`, into
pinned host memory (zero-copy: the kernel reads the record over PCIe), since the GPU sees host and device
memory in one address space (layout/record_offsets.py gives the offsets). No host sync is needed to route: ids
and offsets stay on the device.

`moe_ref` is the torch reference of the kernels in decode.py and prefill.py; kernels/moe/kernel.py picks
one. Legend: T tokens, K experts per token, E routed experts, D dim, I expert width, S slots.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from dsfp4.kernels.swiglu import swiglu
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import ABSENT


def record_at(records: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The record at `offset` of the device pool `records`, as a view (offsets outside it are an error here)."""
    flat = records.view(-1)
    if offset < 0 or offset + nbytes > flat.numel():
        raise ValueError(f"record offset {offset} is outside the slot pool; the reference reads device slots only")
    return flat[offset : offset + nbytes]


def routed(
    ids: torch.Tensor, records: torch.Tensor, offsets: torch.Tensor, layout: RecordLayout
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """ids: [T, K] -> for each expert chosen and present (offset not ABSENT), in expert order: (its record as a view,
    the tokens that chose it [n], the place of it in each one's choice [n])."""
    offs = offsets.tolist()
    for e in sorted(set(ids.flatten().tolist())):
        if offs[e] != ABSENT:
            token, j = (ids == e).nonzero(as_tuple=True)
            yield record_at(records, offs[e], layout.nbytes), token, j


def moe_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    layout: RecordLayout,
    limit: float = 0.0,
) -> torch.Tensor:
    """x: [T, D], ids: [T, K] int, weights: [T, K] float, records: [S, nbytes] u8, offsets: [E] int64
    -> y [T, D] in x's dtype, computed in x's dtype on dense copies of each expert (as DeepSeek's reference);
    limit: the SwiGLU clamp (kernels/swiglu.py), 0.0 for none."""
    y = torch.zeros_like(x)
    for record, token, j in routed(ids, records, offsets, layout):
        w1, w3, w2 = layout.dequantize(record, dtype=x.dtype)
        h = F.linear(swiglu(F.linear(x[token], w1), F.linear(x[token], w3), limit), w2)  # [n, D]
        y.index_add_(0, token, h * weights[token, j, None].to(x.dtype))
    return y
